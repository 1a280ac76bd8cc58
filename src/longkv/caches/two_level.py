"""Two-level KVM-Fold attention: the slots of a KVM state as an index into exact tokens.

Every token that leaves the window stays as an exact leaf, owned by the one slot it founded or
merged into. A query ranks the slots by its logit against their read-out plus log(count)
(`slot_scores`), opens its best, and attends in one softmax to the sinks, the window, the
leaves of its opened slots and, for each unopened slot, the slot's read-out weighted as its
count of tokens (logit + log count) (`longkv.caches.routed`). Opening every slot gives softmax
attention over sinks, leaves and window, the exact cache; opening none gives the coarse
KVM-Fold with the log(count) bias.

Who opens what (`KVMFoldConfig.routing`): by default the queries of a prefill chunk open one
set per KV head, the slots to which some of them gives the largest shares of its attention,
within `KVMFoldConfig.leaf_budget` leaves (`routed.block_units`), and a decoded token's query
heads open their `open` best each (`routed.top_units`); `routing="token"` has every query head
and query open its own `open` best in prefill too.

`TwoLevelRunner` reads a frozen model's input through such a cache (a `RetrievalRunner`): a
bounded part [sinks | slot read-outs | window], the leaves a `LeafStore` per layer, and each
layer's attention gathers the leaves of the slots its queries open (`TwoLevelRunner.attend`).
Unlike the bounded caches, which re-rotate their entries into positions inside the budget, it
keeps every token at the position the model gave it (the exact fold's), so that opening every
slot is the exact fold; or, with `positions="inside"` (`longkv.caches.retrieval`), the leaves
and read-outs un-rotated and met at one distance, the sinks and window at their cache index.
A slot's read-out key is by default the mean of its tokens' rotated keys (a query's logit
against it is the mean of its logits against them; `KVMFoldConfig.slot_key`).
With `KVMFoldConfig.slot_score="box"` a query ranks the slots instead by the largest logit any
key within the per-channel bounds of a slot's rotated keys can give (`routed.bound_scores`, as
Quest ranks pages); the read-outs stay the means.
The KVM state itself routes leaving tokens on un-rotated keys, as KVM-Fold does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longkv.attention.rope import angles_at, rotate
from longkv.attention.state import Rows, tensor_bytes
from longkv.caches.kvm_fold import KVMFoldConfig, KVMFoldRunner
from longkv.caches.kvm_state import read_slots
from longkv.caches.retrieval import RetrievalRunner
from longkv.caches.routed import (
    Part,
    attended_entries,
    block_units,
    bound_scores,
    grouped,
    leaf_mass,
    routed_attention,
    row_units,
    widen_bounds,
)
from longkv.fold.attention import Attend


def slot_scores(
    q: Tensor, slot_k: Tensor, count: Tensor, scale: float, spread: Tensor | None = None
) -> Tensor:  # fmt: skip
    """(B, Hkv, R, S): scale * q . slot_k + log(count) for the rows q (B, Hkv, R, D) of each KV
    head's query heads (`routed.grouped`) against its slots' read-out keys slot_k (B, Hkv, S, D),
    count (B, Hkv, S) tokens per slot; with spread (B, Hkv, S), plus the variance term
    1/2 scale^2 |q|^2 spread / D (`KVMFoldConfig.slot_variance`)."""
    B, Hkv, R, D = q.shape
    S = slot_k.shape[2]
    bias = count.log().reshape(B * Hkv, 1, S)
    flat_k = slot_k.reshape(B * Hkv, S, D).transpose(1, 2)
    rank = torch.baddbmm(bias, q.reshape(B * Hkv, R, D), flat_k, alpha=scale)  # one pass
    rank = rank.view(B, Hkv, R, S)
    if spread is None:
        return rank
    power = q.square().sum(-1, keepdim=True)  # (B, Hkv, R, 1)
    return rank + (0.5 * scale**2 / D) * power * spread.unsqueeze(2)


class TwoLevelRunner(RetrievalRunner, KVMFoldRunner):
    """KVM-Fold whose slots index the exact tokens they own (config.open > 0): a retrieval
    cache (`RetrievalRunner`) whose middle is the slots' read-outs and whose units are the
    slots; `absorb` receives the leaving tokens' keys as the model rotated them and undoes the
    rotation only for the KVM state."""

    method = "two-level KVM-Fold"
    KV_FIELDS = ("readouts", "bounds")
    config: KVMFoldConfig

    def __init__(self, model: nn.Module, config: KVMFoldConfig, track: bool = False):
        super().__init__(model, config, track=track)
        layers = model.config.num_hidden_layers
        # per slot: sums of its tokens' keys as held, their squared norms and their positions
        # (B, Hkv, S, D + 2)
        self.slot_sums: list[Rows | None] = [None] * layers
        # per layer, with slot_variance: each slot's spread, the mean squared norm of its keys
        # less that of their mean (B, Hkv, S), since the last update (`middle`)
        self.spreads: list[Tensor | None] = [None] * layers
        # per layer: the read-outs of its slots since the last update (`middle`)
        self.readouts: list[tuple[Tensor, Tensor] | None] = [None] * layers
        # slot_score "box": per slot the per-channel max and min of its rotated keys
        self.bounds: list[tuple[Tensor, Tensor] | None] = [None] * layers

    def absorb(self, layer: int, keys: Tensor, values: Tensor, first: int) -> None:
        """keys (as the runner holds them: rotated as the model produced them, or un-rotated
        with positions inside) become leaves of the slots their un-rotated keys founded or
        joined."""
        sinks = self.plain_keys(layer, self.sink_k[layer], 0)
        dest = self.fold_in(layer, self.plain_keys(layer, keys, first), values, first, sinks)
        self.readouts[layer] = None
        self.keep_leaves(layer, keys, values, dest)
        B, Hkv, m, _ = keys.shape
        positions = torch.arange(first, first + m, device=keys.device, dtype=torch.float64)
        held = keys.double()
        power = held.square().sum(-1, keepdim=True)
        rows = torch.cat([held, power, positions.expand(B, Hkv, m).unsqueeze(-1)], dim=-1)
        sums = self.slot_sums[layer]
        sums = Rows.of(rows[:, :, :0]) if sums is None else sums
        state = self.states[layer]
        assert state is not None
        new = rows.new_zeros(B, Hkv, state.num_slots - len(sums), rows.shape[-1])
        self.slot_sums[layer] = sums.append(new, True).add_at(dest, rows, True)
        if self.config.slot_score == "box":
            self.bounds[layer] = widen_bounds(self.bounds[layer], keys, dest, state.num_slots)

    def middle(self, layer: int) -> tuple[Tensor, Tensor]:
        """The slots' read-out (`KVMFoldConfig.slot_key`): keys (B, Hkv, S, D) rotated and
        mean values; kept until the slots change."""
        state, sums, kept = self.states[layer], self.slot_sums[layer], self.readouts[layer]
        if state is None or sums is None:
            return super().middle(layer)
        if kept is not None:
            return kept
        dtype, count = self.window_k[layer].dtype, state.count.unsqueeze(-1)
        means = sums.tensor / count  # (B, Hkv, S, D + 2): mean key as held, |k|^2, position
        mean_k = means[..., :-2]
        if self.config.slot_variance:  # |k|^2 is the same rotated or not
            spread = means[..., -2] - mean_k.square().sum(-1)
            self.spreads[layer] = spread.clamp_min(0) * self.config.slot_variance
        if self.config.slot_key == "rotated":  # with positions inside: the mean un-rotated key
            keys = mean_k
        else:  # the mean un-rotated key, rotated at the mean position
            cos, sin = angles_at(means[..., -1].reshape(-1), self.inv_freqs[layer])
            at = (*means.shape[:-1], -1)
            keys = rotate(state.key_sum.double() / count, cos.view(at), sin.view(at))
        kept = self.readouts[layer] = (keys.to(dtype), read_slots(state, "mean")[1].to(dtype))
        return kept

    def attend(self, layer: int) -> Attend:
        """This layer's attention for the forward's queries (`routed_attention`): they rank the
        slots (`slot_scores` on their read-outs, `middle`, or `bound_scores` on their key
        bounds, by `config.slot_score`) and open their best, per block (`block_units`: a
        prefill chunk, by `config.routing`) or each query head its own (`top_units`: a decoded
        token, or every forward by `config.routing`)."""
        state, leaves, config = self.states[layer], self.leaves[layer], self.config
        assert state is not None and leaves is not None
        sinks, readouts, recent = self.parts(layer)
        bounds = self.bounds[layer]

        def attend(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
            L, Hkv = q.shape[2], keys.shape[1]
            G = q.shape[1] // Hkv
            high = torch.promote_types(q.dtype, torch.float32)
            count = state.count.to(high)
            q_mem = self.memory_query(layer, q).to(high) if self.inside else None
            rows = grouped(q.to(high) if q_mem is None else q_mem, Hkv)
            if bounds is None:  # slot_score "mean"
                spread = self.spreads[layer]
                spread = None if spread is None else spread.to(high)
                rank = slot_scores(rows, readouts.keys.to(high), count, scale, spread)
            else:
                rank = bound_scores(rows, bounds[0].to(high), bounds[1].to(high), scale)
            if L > 1 and config.routing == "block":
                opened = block_units(rank, count, config.leaf_budget)
            elif config.rerank:  # candidates by score, opened by their leaves' exact mass
                candidates = row_units(rank, count, rank.shape[-1], config.rerank)
                mass = leaf_mass(rows, leaves.gather(candidates.any(2), high), candidates, scale)
                opened = candidates & row_units(mass, count, config.open, config.leaf_budget)
            else:
                opened = row_units(rank, count, config.open, config.leaf_budget)
            self.remember(layer, rank, opened, G, L)
            window = recent.keys.shape[2]
            self.tally(
                attended_entries(opened, count, sinks.keys.shape[2], window, L, config.readouts)
            )
            got = leaves.gather(opened.any(2), high)
            chunk = Part(keys, values)
            kept, counted = (readouts, count) if config.readouts else (None, None)
            return routed_attention(
                q, sinks, kept, recent, chunk, counted, opened, got, scale, q_mem
            )

        return attend

    def middle_bytes(self) -> int:
        """The states' bytes, their sums of rotated keys and positions and their key bounds."""
        sums = [s.tensor for s in self.slot_sums if s is not None]
        bounds = [t for b in self.bounds if b is not None for t in b]
        spreads = [s for s in self.spreads if s is not None]
        return super().middle_bytes() + tensor_bytes(*sums, *bounds, *spreads)
