"""The KVM-Fold state: what a frozen model's tokens become once they leave the exact window.

Spec kvm.md sections 3-5, applied per (batch row, KV head) to keys with their rotation undone,
through the layer's slot arithmetic (`longkv.kvm.slots`). A frozen model has no state
LayerNorm, merge gate or temperatures, so:
- similarity is cosine similarity between an un-rotated key and a slot's key sum;
- a token is novel by its highest similarity to the sinks' keys and the current slots; while the
  budget grows, the least similar tokens of a block become new slots (time order), the others
  merge winner-take-all into their most similar slot of the post-append state (sums + count);
  the sinks are exact cache entries, compared with for novelty, never merged into;
- with a `threshold`, a token whose best similarity is below it is dropped instead of merged;
- with a `cap`, a slot whose count exceeds cap times the mean count of the state's slots as a
  block arrives takes none of that block's tokens, which join their most similar open slot
  (novelty still compares with every slot); a slot can grow past the bound only within one
  block, and cap >= 1 leaves a slot of at most the mean count open;
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

from longkv.attention.state import Rows
from longkv.kvm.slots import read_founder, read_mean, route, take
from longkv.kvm.state import pack_slots

DROPPED = -1  # the destination of a token that neither founded nor joined a slot
READOUTS = ("founder", "mean")


@dataclass(frozen=True)
class FoldState:
    """Slots of one layer: S is the same for every row and head.

    slots: rows [key sum | value sum | count] (B, Hkv, S, D + Dv + 1), as the layer keeps its
    slots: the sums of the tokens in each slot (un-rotated keys) and how many they are, founder
    included; key_norm and value_norm (B, Hkv, S): the founder's norms; founder (B, Hkv, S): its
    input index; key_dim: D.
    """

    slots: Rows
    key_norm: Tensor
    value_norm: Tensor
    founder: Tensor
    key_dim: int

    @classmethod
    def of(
        cls, key_sum: Tensor, value_sum: Tensor, count: Tensor, key_norm: Tensor,
        value_norm: Tensor, founder: Tensor,
    ) -> FoldState:  # fmt: skip
        """A state from its parts: key_sum (B, Hkv, S, D), value_sum (B, Hkv, S, Dv), the
        others (B, Hkv, S)."""
        slots = Rows.of(pack_slots(key_sum, value_sum, count))
        return cls(slots, key_norm, value_norm, founder, key_sum.shape[-1])

    @property
    def key_sum(self) -> Tensor:
        """(B, Hkv, S, D) the sum of each slot's keys."""
        return self.slots.tensor[..., : self.key_dim]

    @property
    def value_sum(self) -> Tensor:
        """(B, Hkv, S, Dv) the sum of each slot's values."""
        return self.slots.tensor[..., self.key_dim : -1]

    @property
    def count(self) -> Tensor:
        """(B, Hkv, S) the tokens in each slot, founder included."""
        return self.slots.tensor[..., -1]

    @property
    def num_slots(self) -> int:
        return len(self.slots)


def empty_state(keys: Tensor, values: Tensor) -> FoldState:
    """No slots, shaped and typed for keys (B, Hkv, *, D), values (B, Hkv, *, Dv): sums in at
    least float32."""
    high = torch.promote_types(keys.dtype, torch.float32)
    k, v = keys[:, :, :0].to(high), values[:, :, :0].to(high)
    per_slot = k[..., 0]  # (B, Hkv, 0)
    return FoldState.of(k, v, per_slot, per_slot, per_slot, per_slot.long())


def read_slots(state: FoldState, readout: str = "mean") -> tuple[Tensor, Tensor]:
    """Slot keys (B, Hkv, S, D) and values (B, Hkv, S, Dv), un-rotated, in the state's dtype,
    read out as `readout` says (module docstring)."""
    if readout == "mean":
        return read_mean(state.key_sum, state.count), read_mean(state.value_sum, state.count)
    keys = read_founder(state.key_sum, state.key_norm)
    return keys, read_founder(state.value_sum, state.value_norm)


def update_state(
    state: FoldState,
    keys: Tensor,
    values: Tensor,
    first: int,
    target: int,
    sink_keys: Tensor,
    threshold: float | None = None,
    donate: bool = False,
    cap: float | None = None,
) -> tuple[FoldState, Tensor]:
    """Fold the m tokens first .. first + m - 1 that leave the window into the slots.

    keys (B, Hkv, m, D) un-rotated, values (B, Hkv, m, Dv); target: slots wanted afterwards
    (at least the current number); sink_keys (B, Hkv, s, D): compared with for novelty, never
    merged into; donate: the given state's slots may be changed in place (it must not be read
    again); cap: the count bound of an open slot, in mean counts (module docstring). Returns
    the new state and dest (B, Hkv, m): the slot each token founded or joined, or DROPPED.
    """
    S0, s, m = state.num_slots, sink_keys.shape[2], keys.shape[2]
    n_append = min(max(target - S0, 0), m)
    if S0 + n_append == 0:
        raise ValueError("target: a block cannot merge into a state without slots; target >= 1")
    dtype = state.slots.tensor.dtype
    k, v = keys.to(dtype), values.to(dtype)
    unit = F.normalize(k, dim=-1)
    known = F.normalize(torch.cat([sink_keys.to(dtype), state.key_sum], dim=2), dim=-1)
    closed = None
    if cap is not None and S0:
        count = state.count  # (B, Hkv, S0)
        closed = count > cap * count.mean(dim=-1, keepdim=True)
    to = route(unit, known, s, n_append, lambda picked: take(unit, picked), closed)
    joins = to.merges if threshold is None else to.merges & (to.best >= threshold)
    dest = to.dest - s  # the sinks are no slots of this state
    new_k, new_v = take(k, to.picked), take(v, to.picked)
    slots = state.slots.append(pack_slots(new_k, new_v, torch.ones_like(new_k[..., 0])), donate)
    w = joins.unsqueeze(-1).to(dtype)  # founders and dropped tokens add nothing
    slots = slots.add_at(dest, torch.cat([k * w, v * w, w], dim=-1), donate)
    new = FoldState(
        slots,
        torch.cat([state.key_norm, torch.linalg.vector_norm(new_k, dim=-1)], dim=2),
        torch.cat([state.value_norm, torch.linalg.vector_norm(new_v, dim=-1)], dim=2),
        torch.cat([state.founder, to.picked + first], dim=2),
        state.key_dim,
    )
    return new, dest.masked_fill(to.merges & ~joins, DROPPED)
