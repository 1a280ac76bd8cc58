"""The KVM-Fold state: what a frozen model's tokens become once they leave the exact window.

Spec kvm.md sections 3-5, applied per (batch row, KV head) to keys with their rotation undone.
A frozen model has no state LayerNorm, merge gate or temperatures, so:
- similarity is cosine similarity between an un-rotated key and a slot's key sum;
- a token is novel by its highest similarity to the sinks' keys and the current slots; while the
  budget grows, the least similar tokens of a block become new slots (time order), the others
  merge winner-take-all into their most similar slot of the post-append state (sums + count);
- with a `threshold`, a token whose best similarity is below it is dropped instead of merged;
- read-out, `mean`: the mean key and the mean value of the slot's tokens; `founder` (spec
  section 3's vlens, applied to keys too): key = unit(key sum) * the founder key's norm, value =
  unit(value sum) * the founder value's norm. Either way a slot of one token reads back that
  token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

DROPPED = -1  # the destination of a token that neither founded nor joined a slot
READOUTS = ("founder", "mean")


@dataclass(frozen=True)
class FoldState:
    """Slots of one layer: S is the same for every row and head.

    key_sum (B, Hkv, S, D) and value_sum (B, Hkv, S, Dv): sums of the tokens in each slot
    (un-rotated keys); count (B, Hkv, S): tokens per slot, founder included; key_norm and
    value_norm (B, Hkv, S): the founder's norms; founder (B, Hkv, S): its input index.
    """

    key_sum: Tensor
    value_sum: Tensor
    count: Tensor
    key_norm: Tensor
    value_norm: Tensor
    founder: Tensor

    @property
    def num_slots(self) -> int:
        return self.key_sum.shape[2]


def empty_state(keys: Tensor, values: Tensor) -> FoldState:
    """No slots, shaped and typed for keys (B, Hkv, *, D), values (B, Hkv, *, Dv): sums in at
    least float32."""
    B, Hkv, D, Dv = keys.shape[0], keys.shape[1], keys.shape[-1], values.shape[-1]
    high = torch.promote_types(keys.dtype, torch.float32)
    new = keys.new_zeros
    return FoldState(
        key_sum=new(B, Hkv, 0, D, dtype=high),
        value_sum=new(B, Hkv, 0, Dv, dtype=high),
        count=new(B, Hkv, 0, dtype=high),
        key_norm=new(B, Hkv, 0, dtype=high),
        value_norm=new(B, Hkv, 0, dtype=high),
        founder=new(B, Hkv, 0, dtype=torch.long),
    )


def read_slots(state: FoldState, readout: str = "mean") -> tuple[Tensor, Tensor]:
    """Slot keys (B, Hkv, S, D) and values (B, Hkv, S, Dv), un-rotated, in the state's dtype,
    read out as `readout` says (module docstring)."""
    if readout == "mean":
        count = state.count.unsqueeze(-1)
        return state.key_sum / count, state.value_sum / count
    keys = F.normalize(state.key_sum, dim=-1) * state.key_norm.unsqueeze(-1)
    values = F.normalize(state.value_sum, dim=-1) * state.value_norm.unsqueeze(-1)
    return keys, values


def update_state(
    state: FoldState,
    keys: Tensor,
    values: Tensor,
    first: int,
    target: int,
    sink_keys: Tensor,
    threshold: float | None = None,
) -> tuple[FoldState, Tensor]:
    """Fold the m tokens first .. first + m - 1 that leave the window into the slots.

    keys (B, Hkv, m, D) un-rotated, values (B, Hkv, m, Dv); target: slots wanted afterwards
    (at least the current number); sink_keys (B, Hkv, s, D): compared with for novelty, never
    merged into. Returns the new state and dest (B, Hkv, m): the slot each token founded or
    joined, or DROPPED.
    """
    S0, m = state.num_slots, keys.shape[2]
    k, v = keys.to(state.key_sum.dtype), values.to(state.value_sum.dtype)
    unit = F.normalize(k, dim=-1)
    n_append = min(max(target - S0, 0), m)
    order = torch.arange(m, device=k.device).expand(*k.shape[:2], m)
    if n_append in (0, m):
        picked = order[..., :n_append]
    else:
        known = torch.cat([sink_keys.to(k.dtype), state.key_sum], dim=2)
        if known.shape[2] == 0:  # nothing to compare with: every token equally novel
            novelty = torch.zeros_like(unit[..., 0])
        else:
            novelty = (unit @ F.normalize(known, dim=-1).transpose(-1, -2)).amax(dim=-1)
        picked = novelty.argsort(dim=-1, stable=True)[..., :n_append].sort(dim=-1).values
    appended = torch.zeros_like(order, dtype=torch.bool).scatter(2, picked, True)
    k_new = k.gather(2, picked.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1]))
    v_new = v.gather(2, picked.unsqueeze(-1).expand(-1, -1, -1, v.shape[-1]))
    state = FoldState(
        key_sum=torch.cat([state.key_sum, k_new], dim=2),
        value_sum=torch.cat([state.value_sum, v_new], dim=2),
        count=torch.cat([state.count, torch.ones_like(k_new[..., 0])], dim=2),
        key_norm=torch.cat([state.key_norm, torch.linalg.vector_norm(k_new, dim=-1)], dim=2),
        value_norm=torch.cat([state.value_norm, torch.linalg.vector_norm(v_new, dim=-1)], dim=2),
        founder=torch.cat([state.founder, picked + first], dim=2),
    )
    if state.num_slots == 0:
        raise ValueError("target: a block cannot merge into a state without slots; target >= 1")
    similarity = unit @ F.normalize(state.key_sum, dim=-1).transpose(-1, -2)  # (B, Hkv, m, S)
    best, slot = similarity.max(dim=-1)
    merges = ~appended
    if threshold is not None:
        merges &= best >= threshold
    # founders point at their new slot: S0 + their rank among the block's appended tokens
    dest = torch.where(appended, S0 + appended.cumsum(dim=-1) - 1, slot)
    dest = torch.where(appended | merges, dest, DROPPED)
    weight = merges.to(k.dtype)
    return (
        FoldState(
            key_sum=state.key_sum.scatter_add(
                2, slot.unsqueeze(-1).expand_as(k), k * weight.unsqueeze(-1)
            ),
            value_sum=state.value_sum.scatter_add(
                2, slot.unsqueeze(-1).expand_as(v), v * weight.unsqueeze(-1)
            ),
            count=state.count.scatter_add(2, slot, weight),
            key_norm=state.key_norm,
            value_norm=state.value_norm,
            founder=state.founder,
        ),
        dest,
    )
