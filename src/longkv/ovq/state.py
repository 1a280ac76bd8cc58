"""OVQState: an OVQ layer's dictionary and open chunk, carried between calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from longkv.attention.state import Rows, WindowCache, tensor_bytes
from longkv.ovq.config import OVQConfig


class Centroids(NamedTuple):
    """What a query reads from the visible centroids: mean keys (B, Hkv, d, Dk), mean values
    (B, Hkv, d, Dv) and the logit bias (B, Hkv, d) (log count, or None without the bias)."""

    k: Tensor
    v: Tensor
    bias: Tensor | None


@dataclass(frozen=True)
class OVQState:
    """What `ovq_attention` carries between calls.

    slots: (B, Hkv, R, Dk + Dv + 1) rows [sum of normalised keys | sum of values | count], one
    row per centroid (a centroid is the running mean of its tokens: sums / count; the counts
    are exact in the state's dtype, up to 2**24 tokens in float32); pending: the normalised keys
    and raw values of the open chunk, tokens [committed, seen). Every complete chunk has joined
    the dictionary (an eager commit, as the reference's decode cache). Queries see the first
    `visible` rows, config.size(committed); R exceeds it only while the schedule still gives 0
    centroids and slot 0 already holds tokens (spec ovq.md 9.11). read: the visible centroids'
    `Centroids`, computed once per commit and carried until the next (None: not yet computed).
    """

    config: OVQConfig
    slots: Rows
    pending: WindowCache
    read: Centroids | None = field(default=None, compare=False, repr=False)

    @property
    def seen(self) -> int:
        """Tokens processed so far."""
        return self.pending.seen

    @property
    def committed(self) -> int:
        """Tokens in the dictionary: every complete chunk, floor(seen / C) * C."""
        return self.pending.start

    @property
    def visible(self) -> int:
        """Centroids a query of the open chunk sees."""
        return self.config.size(self.committed)

    @property
    def key_dim(self) -> int:
        return self.pending.k.shape[-1]

    def means(self, rows: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The first `rows` centroids (default: the visible ones): keys (B, Hkv, n, Dk), values
        (B, Hkv, n, Dv) and counts (B, Hkv, n)."""
        n = self.visible if rows is None else rows
        slots = self.slots.tensor[:, :, :n]
        count = slots[..., -1:]
        Dk = self.key_dim
        return slots[..., :Dk] / count, slots[..., Dk:-1] / count, count[..., 0]

    def centroids(self) -> Centroids:
        """The visible centroids as a query reads them (`read`, or computed from the rows)."""
        if self.read is not None:
            return self.read
        keys, values, count = self.means()
        return Centroids(keys, values, count.log() if self.config.count_bias else None)

    def with_read(self, pending: WindowCache) -> OVQState:
        """This dictionary with another open chunk, its centroids' read computed and kept."""
        return OVQState(self.config, self.slots, pending, self.centroids())

    @property
    def nbytes(self) -> int:
        """Bytes of the dictionary's rows, its read (where kept) and the open chunk."""
        read = 0 if self.read is None else sum(tensor_bytes(t) for t in self.read if t is not None)
        return tensor_bytes(self.slots.tensor) + read + self.pending.nbytes

    @property
    def batch_size(self) -> int:
        return self.pending.batch_size

    def select_rows(self, rows: Tensor) -> OVQState:
        """Keep batch rows `rows` (R,), in that order (beam search)."""
        return OVQState(self.config, self.slots.select_rows(rows), self.pending.select_rows(rows))

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> OVQState:
        """A copy on another device and/or floating dtype."""
        return OVQState(
            self.config, self.slots.to(device, dtype), self.pending.to(device=device, dtype=dtype)
        )
