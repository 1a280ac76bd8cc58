"""Two-level KVM-Fold attention: the slots of a KVM state as an index into exact tokens.

Every token that leaves the window stays as an exact leaf, owned by the one slot it founded or
merged into. A query head ranks the slots by its logit against their read-out plus log(count),
opens its top `k_open`, and attends in one softmax to the sinks, the window, the leaves of its
opened slots and, for each unopened slot, the slot's read-out weighted as its count of tokens
(logit + log count). Opening every slot gives softmax attention over sinks, leaves and window,
the exact cache; opening none gives the coarse KVM-Fold with the log(count) bias.

The keys of one layer are laid out as entries [sinks | slot read-outs | leaves | window]; the
routing becomes an additive bias per query head and entry (`two_level_bias`), which the model's
own attention adds to its logits. `two_level_attention` is that softmax written out; the tests
compare it with `naive.two_level_attention_naive`, one query and head at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor


def open_slots(q: Tensor, slot_k: Tensor, count: Tensor, k_open: int, scale: float) -> Tensor:
    """Which slots each query head opens: its top k_open by scale * q . slot_k + log(count).

    q (B, H, T, D); slot_k (B, Hkv, S, D) the slots' read-out keys, H a multiple of Hkv (query
    heads share their KV head's slots); count (B, Hkv, S) tokens per slot. Returns (B, H, T, S)
    bool, exactly min(k_open, S) True per query head; ties go to the earlier slot.
    """
    B, H, T, _ = q.shape
    S = slot_k.shape[2]
    opened = torch.zeros(B, H, T, S, dtype=torch.bool, device=q.device)
    k = min(k_open, S)
    if k == 0:
        return opened
    rank = slot_logits(q, slot_k, count, scale)  # (B, H, T, S)
    # a stable descending sort keeps the earlier slot first among equal scores
    top = rank.argsort(dim=-1, descending=True, stable=True)[..., :k]
    return opened.scatter(-1, top, True)


def slot_logits(q: Tensor, slot_k: Tensor, count: Tensor, scale: float) -> Tensor:
    """(B, H, T, S): scale * q . slot_k + log(count), each query head against its KV head's
    slots (q (B, H, T, D), slot_k (B, Hkv, S, D), count (B, Hkv, S))."""
    groups = q.shape[1] // slot_k.shape[1]
    keys = slot_k.repeat_interleave(groups, dim=1)
    bias = count.log().repeat_interleave(groups, dim=1).unsqueeze(2)
    return scale * (q @ keys.transpose(-1, -2)) + bias


def two_level_bias(opened: Tensor, count: Tensor, owner: Tensor, sinks: int, window: int) -> Tensor:
    """The additive bias (B, H, T, sinks + S + L + window) over entries [sinks | slot read-outs |
    leaves | window]: 0 on the sinks, the window and the leaves of opened slots; log(count) on
    the read-out of an unopened slot; -inf on an opened slot's read-out (its leaves stand for it)
    and on the leaves of unopened slots.

    opened (B, H, T, S) from `open_slots`; count (B, Hkv, S); owner (B, Hkv, L) the slot of each
    leaf.
    """
    B, H, T, S = opened.shape
    groups = H // count.shape[1]
    log_count = count.log().repeat_interleave(groups, dim=1).unsqueeze(2).expand(B, H, T, S)
    blocked = torch.tensor(float("-inf"), dtype=log_count.dtype, device=opened.device)
    means = torch.where(opened, blocked, log_count)
    slot_of = owner.repeat_interleave(groups, dim=1).unsqueeze(2).expand(B, H, T, -1)
    leaves = torch.where(opened.gather(-1, slot_of), 0.0, blocked)
    edge = log_count.new_zeros
    return torch.cat([edge(B, H, T, sinks), means, leaves, edge(B, H, T, window)], dim=-1)


def two_level_attention(
    q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scale: float
) -> Tensor:
    """Softmax attention of q (B, H, T, D) over entries keys (B, Hkv, N, D), values (B, Hkv, N,
    Dv) with the additive bias (B, H, T, N) of `two_level_bias` (a causal window is the
    caller's: its future entries carry -inf in bias). Returns (B, H, T, Dv)."""
    groups = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1)
    v = values.repeat_interleave(groups, dim=1)
    logits = scale * (q @ k.transpose(-1, -2)) + bias
    return torch.softmax(logits, dim=-1) @ v
