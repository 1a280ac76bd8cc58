"""The slot arithmetic of a KVM state (spec: docs/kvm.md sections 3 and 5), shared by the
trained layer (`longkv.kvm.functional`) and KVM-Fold (`longkv.caches.kvm_state`).

A block of m tokens leaves the window. Each is compared with the slots by the dot product of
the forms its caller prepares: the layer's LN_s(Z(k)) against LN_s(slot keys), KVM-Fold's unit
keys against unit slot keys (cosine similarity). `route` ranks the tokens by novelty, picks the
new slots and gives every other token its winner-take-all merge target; the caller adds the
tokens into its slot rows with one indexed add (`Rows.add_at`). `read_mean` and `read_founder`
are the two read-outs of a slot's sums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Route:
    """Where the m tokens of a leaving block go, with K slots known before it (the protected
    sinks first) and n new ones after them.

    picked (B, Hkv, n): the tokens that found the slots K .. K + n - 1, in time order;
    dest (B, Hkv, m): the slot of each token: the one it founded, else its merge target;
    best (B, Hkv, m): a merging token's similarity to its merge target.
    """

    picked: Tensor
    dest: Tensor
    best: Tensor

    @property
    def merges(self) -> Tensor:
        """(B, Hkv, m) bool: the tokens that merge, all but the picked."""
        return torch.ones_like(self.dest, dtype=torch.bool).scatter(2, self.picked, False)


@torch.no_grad()
def route(
    tokens: Tensor,
    known: Tensor,
    sinks: int,
    n_append: int,
    new_slots: Callable[[Tensor], Tensor],
    closed: Tensor | None = None,
) -> Route:
    """Route a leaving block into the slots (spec section 5, steps 3 and 4), without gradient.

    tokens (B, Hkv, m, D) and known (B, Hkv, K, D): the tokens and the slots in the compared
    form, the first `sinks` slots protected (compared for novelty, never merged into);
    n_append (0 .. m): how many tokens found slots; new_slots: picked (B, Hkv, n) -> the new
    slots in the compared form (B, Hkv, n, D); closed (B, Hkv, K - sinks) bool: known slots
    that take no token (compared for novelty still; default: none).

    The n_append tokens least similar to every known slot (novelty; earlier first among
    equals) found the new slots. Every other token merges into the most similar open non-sink
    slot after appending, the first among equals: a new slot wins only where strictly more
    similar. There must be an open non-sink slot after appending.
    """
    K = known.shape[2]
    sims = tokens @ known.transpose(-1, -2)  # (B, Hkv, m, K): one product for both uses
    if K > sinks:
        merge = sims[..., sinks:]  # non-sink slots
        if closed is None:
            best, dest = merge.max(dim=-1)  # the first on ties
            near = best  # (B, Hkv, m) the most similar, open or not
        else:
            near = merge.amax(dim=-1)
            best, dest = merge.masked_fill(closed.unsqueeze(2), float("-inf")).max(dim=-1)
        dest += sinks
    else:  # no slot to merge into before the new ones
        best = near = sims.new_full(sims.shape[:-1], float("-inf"))
        dest = torch.zeros(sims.shape[:-1], dtype=torch.long, device=sims.device)
    picked = dest[..., :0]
    if n_append > 0:
        novelty = near if sinks == 0 else torch.maximum(near, sims[..., :sinks].amax(dim=-1))
        picked = novelty.argsort(dim=-1, stable=True)[..., :n_append].sort(dim=-1).values
        new_best, new_dest = (tokens @ new_slots(picked).transpose(-1, -2)).max(dim=-1)
        won = new_best > best
        best = torch.where(won, new_best, best)
        dest = torch.where(won, new_dest + K, dest)
        founded = torch.arange(K, K + n_append, device=dest.device).expand_as(picked)
        dest = dest.scatter(2, picked, founded)
    return Route(picked, dest, best)


def take(x: Tensor, index: Tensor) -> Tensor:
    """Rows index (B, Hkv, n) of x (B, Hkv, m, D): (B, Hkv, n, D)."""
    return x.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))


def read_mean(sums: Tensor, count: Tensor) -> Tensor:
    """The mean of each slot's tokens: sums (B, Hkv, S, D) / count (B, Hkv, S)."""
    return sums / count.unsqueeze(-1)


def read_founder(sums: Tensor, norm: Tensor) -> Tensor:
    """Each slot's direction at its founder's norm (spec section 3's vlens): unit(sums) * norm,
    sums (B, Hkv, S, D), norm (B, Hkv, S)."""
    length = torch.linalg.vector_norm(sums, dim=-1).clamp_min(1e-12)
    return sums * (norm / length).unsqueeze(-1)
