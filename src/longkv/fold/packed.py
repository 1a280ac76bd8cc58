"""A transformers cache layer that keeps a full-attention layer's keys and values in storage
allocated ahead for the tokens to come, in a dtype of its own (16 bits to halve the cache).

transformers' `DynamicLayer` concatenates every chunk onto new tensors: a fold of T tokens in
chunks of C copies about T^2 / (2C) rows, and the tensors it frees, each larger than the last,
leave the allocator holes no later one fits, which the process keeps resident. A
`PackedLayer` writes each chunk in place into storage of `capacity` rows, growing it by an
eighth when a forward passes its end, and holds `keys` and `values` as views of the rows
written, so whatever reads a layer's keys and values (a save, a fork, the benchmarks) sees what
it saw before.

In `dtype` narrower than the model's (float16 or bfloat16), the stored keys and values are
rounded once; a forward's attention sees the stored ones widened back to the dtype of the
forward's own keys, and its own keys and values as computed (llama.cpp rounds those too). A
copy of the layer (a fork, `longkv.caches.fork`, or a saved read) holds the rows written
and allocates storage of its own at its first update.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

# what a layer grows by when a forward passes its end: this share of the rows it needs, at least
GROWTH, MIN_GROWTH = 8, 256


class PackedLayer(DynamicLayer):
    """A full-attention layer's keys and values (B, Hkv, n, D) in preallocated storage of
    `capacity` rows and dtype `dtype` (None: the dtype of the first keys written)."""

    def __init__(self, dtype: torch.dtype | None = None, capacity: int = 0):
        super().__init__()
        self.store_dtype, self.capacity = dtype, capacity
        self.stored: tuple[Tensor, Tensor] | None = None  # (B, Hkv, capacity, D) each

    def __getstate__(self) -> dict[str, object]:
        """What a copy (a fork) or a save keeps: the rows `keys` and `values` show, not the
        storage, which the copy's first update allocates anew (a fork then writes into storage
        of its own, as a `DynamicLayer`'s fork concatenates onto tensors of its own)."""
        return {**vars(self), "stored": None}

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.stored = None

    def held(self) -> int:
        """Rows the storage holds now that `keys` shows (0 where `keys` was replaced by
        something else: a crop's view stays, other tensors are copied in at the next update)."""
        if self.stored is None or self.keys.numel() == 0:
            return 0
        same = self.keys.data_ptr() == self.stored[0].data_ptr()
        return self.keys.shape[-2] if same and self.keys.dtype == self.stored[0].dtype else -1

    def storage_for(self, keys: Tensor, values: Tensor, rows: int) -> tuple[Tensor, Tensor]:
        """Storage of at least `rows` rows shaped like keys, values (B, Hkv, *, D), holding
        the rows `self.keys` and `self.values` show."""
        n = self.keys.shape[-2] if self.keys.numel() else 0
        if self.held() == n and self.stored is not None and self.stored[0].shape[-2] >= rows:
            return self.stored
        size = self.capacity if self.capacity >= rows else rows + max(MIN_GROWTH, rows // GROWTH)
        dtype = self.store_dtype or keys.dtype
        new = tuple(
            t.new_empty((*t.shape[:-2], size, t.shape[-1]), dtype=dtype) for t in (keys, values)
        )
        if n:
            new[0][..., :n, :] = self.keys
            new[1][..., :n, :] = self.values
        self.capacity = size
        return new  # type: ignore[return-value]

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Write key_states, value_states (B, Hkv, L, D) after the rows held; return every
        row's keys and values for the forward's attention (the earlier ones widened to the
        forward's dtype where they are stored narrower, its own as given)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self.keys.numel() else 0
        end = n + key_states.shape[-2]
        self.stored = k, v = self.storage_for(key_states, value_states, end)
        k[..., n:end, :] = key_states
        v[..., n:end, :] = value_states
        self.keys, self.values = k[..., :end, :], v[..., :end, :]
        if k.dtype == key_states.dtype:
            return self.keys, self.values
        wide = key_states.dtype
        return (
            torch.cat([k[..., :n, :].to(wide), key_states], dim=-2),
            torch.cat([v[..., :n, :].to(wide), value_states], dim=-2),
        )
