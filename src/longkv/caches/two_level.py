"""Two-level KVM-Fold attention: the slots of a KVM state as an index into exact tokens.

Every token that leaves the window stays as an exact leaf, owned by the one slot it founded or
merged into. A query head ranks the slots by its logit against their read-out plus log(count),
opens its top `k_open`, and attends in one softmax to the sinks, the window, the leaves of its
opened slots and, for each unopened slot, the slot's read-out weighted as its count of tokens
(logit + log count). Opening every slot gives softmax attention over sinks, leaves and window,
the exact cache; opening none gives the coarse KVM-Fold with the log(count) bias.

Over a layer's entries [sinks | slot read-outs | leaves | window] the routing is an additive
bias per query head and entry (`two_level_bias`), added to the logits. `two_level_attention` is
that softmax written out; the tests compare it with `naive.two_level_attention_naive`, one query
and head at a time.

`TwoLevelRunner` reads a frozen model's input through such a cache: the model's cache holds the
bounded part [sinks | slot read-outs | window], the leaves a `LeafStore` per layer, and each
layer's attention inserts the leaves of the slots its queries open (`TwoLevelRunner.route`).
Unlike the bounded caches, which re-rotate their entries into positions inside the budget, it
keeps every token at the position the model gave it (the exact fold's), so that opening every
slot is the exact fold. A slot's read-out key is by default the mean of its tokens' rotated keys
(a query's logit against it is the mean of its logits against them; `KVMFoldConfig.slot_key`).
The KVM state itself routes leaving tokens on un-rotated keys, as KVM-Fold does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from longkv.attention.rope import angles_at, rotate
from longkv.attention.state import Rows, tensor_bytes
from longkv.caches.kvm_fold import KVMFoldConfig, KVMFoldRunner
from longkv.caches.kvm_state import read_slots
from longkv.caches.leaves import LeafStore, make_leaves
from longkv.fold.attention import AttentionHooks, Route, RouteResult
from longkv.fold.fold import check_positions


def open_slots(q: Tensor, slot_k: Tensor, count: Tensor, k_open: int, scale: float) -> Tensor:
    """Which slots each query head opens: its top k_open by scale * q . slot_k + log(count).

    q (B, H, T, D); slot_k (B, Hkv, S, D) the slots' read-out keys, H a multiple of Hkv (query
    heads share their KV head's slots); count (B, Hkv, S) tokens per slot. Returns (B, H, T, S)
    bool, exactly min(k_open, S) True per query head; ties go to the earlier slot.
    """
    return top_slots(slot_logits(q, slot_k, count, scale), k_open)


def top_slots(rank: Tensor, k_open: int) -> Tensor:
    """(..., S) bool: the k_open highest of the scores rank (..., S), the earlier on ties."""
    k = min(k_open, rank.shape[-1])
    if k == 0:
        return torch.zeros_like(rank, dtype=torch.bool)
    kth = rank.topk(k, dim=-1).values[..., -1:]  # each query head's k-th highest score
    above, tied = rank > kth, rank == kth
    room = k - above.sum(-1, keepdim=True)  # how many of the tied slots still open
    return above | (tied & (tied.cumsum(-1) <= room))  # the earlier tied slots first


def slot_logits(q: Tensor, slot_k: Tensor, count: Tensor, scale: float) -> Tensor:
    """(B, H, T, S): scale * q . slot_k + log(count), each query head against its KV head's
    slots (q (B, H, T, D), slot_k (B, Hkv, S, D), count (B, Hkv, S))."""
    groups = q.shape[1] // slot_k.shape[1]
    keys = slot_k.repeat_interleave(groups, dim=1)
    bias = count.log().repeat_interleave(groups, dim=1).unsqueeze(2)
    return scale * (q @ keys.transpose(-1, -2)) + bias


def two_level_bias(
    opened: Tensor, count: Tensor, owner: Tensor, sinks: int, window: int,
    valid: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The additive bias (B, H, T, sinks + S + L + window) over entries [sinks | slot read-outs |
    leaves | window]: 0 on the sinks, the window and the leaves of opened slots; log(count) on
    the read-out of an unopened slot; -inf on an opened slot's read-out (its leaves stand for it)
    and on the leaves of unopened slots and the padding.

    opened (B, H, T, S) from `open_slots`; count (B, Hkv, S); owner (B, Hkv, L) the slot of each
    leaf; valid (B, Hkv, L) False on padding leaves (`LeafStore.gather`), None: none.
    """
    B, H, T, S = opened.shape
    groups = H // count.shape[1]
    L = owner.shape[-1]
    out = count.new_zeros(B, H, T, sinks + S + L + window)
    log_count = count.log().repeat_interleave(groups, dim=1).unsqueeze(2)  # (B, H, 1, S)
    out[..., sinks : sinks + S] = log_count.masked_fill(opened, float("-inf"))
    slot_of = owner.repeat_interleave(groups, dim=1).unsqueeze(2).expand(B, H, T, L)
    seen = opened.gather(-1, slot_of)
    if valid is not None:  # padding of a KV head with fewer leaves
        seen &= valid.repeat_interleave(groups, dim=1).unsqueeze(2)
    out[..., sinks + S : sinks + S + L].masked_fill_(~seen, float("-inf"))
    return out


def attended_entries(opened: Tensor, count: Tensor, sinks: int, window: int) -> Tensor:
    """(B, H, T) float: how many entries each query head attends under `two_level_bias`, with
    the window causal (query t of T sees its first window - T + t + 1 entries): the sinks, the
    unopened read-outs, the leaves of the opened slots (as many as their count) and the window.

    opened (B, H, T, S); count (B, Hkv, S) the tokens (leaves) of each slot."""
    T = opened.shape[2]
    groups = opened.shape[1] // count.shape[1]
    per_slot = count.repeat_interleave(groups, dim=1).unsqueeze(-1)  # (B, H, S, 1)
    leaves = (opened.to(count.dtype) @ per_slot)[..., 0]  # (B, H, T)
    unopened = opened.shape[-1] - opened.sum(-1)
    causal = torch.arange(window - T + 1, window + 1, device=opened.device)
    return sinks + unopened + leaves + causal


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


def check_two_level_room(model: nn.Module, tokens: int, what: str) -> None:
    """Refuse unless the model has positions for `tokens` (`what` takes them): two-level
    KVM-Fold keeps every token at its own position and never runs past the model's; the
    refusal points to the caches that place positions inside their budget."""
    check_positions(
        model, tokens, what,
        switch="read it with a cache that places positions inside its budget (streaming, "
        "snapkv, kvm-fold without --kvm-open / open=0)",
    )  # fmt: skip


class TwoLevelRunner(KVMFoldRunner):
    """KVM-Fold whose slots index the exact tokens they own (config.open > 0): the cache holds
    the bounded part (sinks, slot read-outs, window), the leaves live in a `LeafStore` per
    layer, and each forward's attention gathers the leaves of the slots its queries open
    (`route`); every key stays at its own position.

    Unlike the bounded runners it keeps the sinks' and window's keys as the model rotated them
    (`keep_chunk`), so `absorb` receives rotated keys and undoes the rotation only for the
    state, and `build_cache` rotates nothing."""

    method = "two-level KVM-Fold"

    def __init__(self, model: nn.Module, config: KVMFoldConfig, track: bool = False):
        super().__init__(model, config, track)
        layers = model.config.num_hidden_layers
        self.leaves: list[LeafStore | None] = [None] * layers
        # per slot: sums of its tokens' rotated keys and of their positions (B, Hkv, S, D + 1)
        self.slot_sums: list[Rows | None] = [None] * layers
        # per layer: the last query's slot scores in its last forward (B, H, S)
        self.last_scores: list[Tensor | None] = [None] * layers

    @property
    def position(self) -> int:
        """The next token's position: the exact fold's."""
        return self.seen

    def unrotated(self, keys: Tensor, first: int) -> Tensor:
        """keys (B, Hkv, m, D) of the tokens first, first + 1, ... with their rotation undone."""
        positions = torch.arange(first, first + keys.shape[2], device=keys.device)
        cos, sin = angles_at(-positions, self.inv_freq)
        return rotate(keys.double(), cos, sin).to(keys.dtype)

    def absorb(self, layer: int, keys: Tensor, values: Tensor, first: int) -> None:
        """keys (rotated, as the model produced them) become leaves of the slots their
        un-rotated keys founded or joined."""
        sinks = self.unrotated(self.sink_k[layer], 0)
        dest = self.fold_in(layer, self.unrotated(keys, first), values, first, sinks)
        leaves = self.leaves[layer]
        if leaves is None:
            c = self.config
            leaves = self.leaves[layer] = make_leaves(c.leaves, keys, values, c.leaf_dir)
        leaves.append(keys, values, dest)
        B, Hkv, m, _ = keys.shape
        positions = torch.arange(first, first + m, device=keys.device, dtype=torch.float64)
        rows = torch.cat([keys.double(), positions.expand(B, Hkv, m).unsqueeze(-1)], dim=-1)
        sums = self.slot_sums[layer]
        sums = Rows.of(rows[:, :, :0]) if sums is None else sums
        state = self.states[layer]
        assert state is not None
        new = rows.new_zeros(B, Hkv, state.num_slots - len(sums), rows.shape[-1])
        self.slot_sums[layer] = sums.append(new, True).add_at(dest, rows, True)

    def middle(self, layer: int) -> tuple[Tensor, Tensor]:
        """The slots' read-out (`KVMFoldConfig.slot_key`): keys (B, Hkv, S, D) rotated and
        mean values."""
        state, sums = self.states[layer], self.slot_sums[layer]
        if state is None or sums is None:
            return super().middle(layer)
        dtype, count = self.window_k[layer].dtype, state.count.unsqueeze(-1)
        means = sums.tensor / count  # (B, Hkv, S, D + 1): mean rotated key, mean position
        if self.config.slot_key == "rotated":
            keys = means[..., :-1]
        else:  # the mean un-rotated key, rotated at the mean position
            cos, sin = angles_at(means[..., -1].reshape(-1), self.inv_freq)
            at = (*means.shape[:-1], -1)
            keys = rotate(state.key_sum.double() / count, cos.view(at), sin.view(at))
        return keys.to(dtype), read_slots(state, "mean")[1].to(dtype)

    def build_cache(self) -> DynamicCache:
        """Every layer's bounded part [sinks | slot read-outs | window], as rotated."""
        cache = DynamicCache()
        if self.seen == 0:
            return cache
        for i in range(len(self.sink_k)):
            slot_k, slot_v = self.middle(i)
            k = torch.cat([self.sink_k[i], slot_k, self.window_k[i]], dim=2)
            cache.update(k, torch.cat([self.sink_v[i], slot_v, self.window_v[i]], dim=2), i)
        return cache

    def keep_chunk(self, cache: DynamicCache, n: int, to_sinks: int) -> None:
        """The chunk's keys as the model rotated them (cache indices n, n + 1, ...)."""
        for i, layer in enumerate(cache.layers):
            self.keep(i, layer.keys[:, :, n:], layer.values[:, :, n:], to_sinks)

    def route(self, layer: int) -> Route:
        """This layer's entries for the forward's queries: the bounded part with the leaves
        of every slot some query head opens inserted after the slot read-outs (entries
        sinks .. sinks + S - 1, which the routing reads), and each query head's bias over
        them (`two_level_bias`)."""
        state, leaves = self.states[layer], self.leaves[layer]
        assert state is not None and leaves is not None
        sinks, S = self.sink_k[layer].shape[2], state.num_slots

        def entries(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> RouteResult:
            count = state.count.to(q.dtype)
            rank = slot_logits(q, keys[:, :, sinks : sinks + S], count, scale)  # (B, H, L, S)
            opened = top_slots(rank, self.config.open)
            self.last_scores[layer] = rank[:, :, -1]
            window = keys.shape[2] - sinks - S
            self.tally(attended_entries(opened, count, sinks, window))
            B, Hkv = count.shape[:2]
            chosen = opened.view(B, Hkv, -1, S).any(2)  # (B, Hkv, S): opened by some query head
            got = leaves.gather(chosen, keys.dtype)
            bias = two_level_bias(opened, count, got.owner, sinks, window, got.valid)
            cut = sinks + S
            return (
                torch.cat([keys[:, :, :cut], got.keys, keys[:, :, cut:]], dim=2),
                torch.cat([values[:, :, :cut], got.values, values[:, :, cut:]], dim=2),
                bias,
            )

        return entries

    def needle_route(self, start: int, stop: int) -> dict[str, float]:
        """How the last query read routed to the tokens start .. stop - 1 (a needle's answer),
        over layers, rows and query heads: `left`, the share of them that had left the window;
        of those, `routed`, the share whose slot it opened, and `slot_rank`, the median rank of
        their slots (0: its best; the earlier slot first on ties), both left out where none
        had left."""
        ranks: list[Tensor] = []
        for scores, leaves in zip(self.last_scores, self.leaves, strict=True):
            if scores is None or leaves is None:
                continue
            sinks = self.sink_k[0].shape[2]  # leaf j is token sinks + j
            lo, hi = max(start - sinks, 0), min(stop - sinks, len(leaves))
            if lo >= hi:
                continue
            groups = scores.shape[1] // leaves.owner.tensor.shape[1]
            slots = leaves.owner.tensor[:, :, lo:hi, 0].repeat_interleave(groups, dim=1)
            mine = scores.gather(-1, slots).unsqueeze(-1)  # (B, H, n, 1)
            index = torch.arange(scores.shape[-1], device=scores.device)
            ahead = (scores.unsqueeze(2) > mine) | (
                (scores.unsqueeze(2) == mine) & (index < slots.unsqueeze(-1))
            )  # (B, H, n, S): the slots ranked before each token's
            ranks.append(ahead.sum(-1).flatten())
        if not ranks:
            return {"left": 0.0}
        rank = torch.cat(ranks)
        scores = next(x for x in self.last_scores if x is not None)
        total = (stop - start) * scores.shape[0] * scores.shape[1] * len(self.leaves)
        return {
            "left": rank.numel() / total,
            "routed": float((rank < self.config.open).double().mean()),
            "slot_rank": float(rank.double().median()),
        }

    def count_attended(self, entries: int, L: int) -> None:
        """Once tokens have left the window, each layer's route counts per query head."""
        if self.leaves[0] is None:
            super().count_attended(entries, L)

    def middle_bytes(self) -> int:
        """The states' bytes and their sums of rotated keys and positions."""
        sums = [s.tensor for s in self.slot_sums if s is not None]
        return super().middle_bytes() + tensor_bytes(*sums)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes held now, over layers: the bounded part (sinks, window, the slots' state and
        key sums), the leaves in memory (with their owners) and the leaves in a file."""
        stores = [x for x in self.leaves if x is not None]
        return {
            **super().resident_bytes(),
            "leaves": sum(x.nbytes for x in stores),
            "leaves_file": sum(x.file_bytes for x in stores),
        }

    def hooks(self, chunk: int) -> AttentionHooks | None:
        if self.leaves[0] is None:
            return None  # nothing has left the window: plain attention
        return AttentionHooks(route=[self.route(i) for i in range(len(self.leaves))])

    def check_room(self, tokens: int) -> None:
        """Every token keeps its position: refuse unless the model has positions for the
        tokens read so far and `tokens` more (`check_two_level_room`)."""
        check_two_level_room(self.model, self.seen + tokens, "the input read so far and to come")

    def forward(self, ids: Tensor) -> Tensor:
        """Logits (B, L, V) of ids (B, L) at the next positions, after making room."""
        self.check_room(ids.shape[1])
        return super().forward(ids)
