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
forward's own keys, and its own keys and values as computed (llama.cpp rounds those too), in
a `Scratch` the cache's packed layers share.

A copy of the layer (a fork, `longkv.caches.fork`) shares the storage and writes its own rows
after those it holds, in place, where no other living layer of the storage holds rows there (a
read's question after the read's rows), else into storage of its own (a second extension of
the same read while the first lives); a saved read keeps the rows written, not the storage.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

# what a layer grows by when a forward passes its end: this share of the rows it needs, at least
GROWTH, MIN_GROWTH = 8, 256


def grown(rows: int) -> int:
    """The rows storage for `rows` rows is allocated with when it has to grow."""
    return rows + max(MIN_GROWTH, rows // GROWTH)


class Storage:
    """Keys and values (B, Hkv, capacity, D) that packed layers hold rows of (`users`): a layer
    and its copies, which share it (a deep copy is the storage itself)."""

    def __init__(self, keys: Tensor, values: Tensor):
        self.keys, self.values = keys, values
        self.users: weakref.WeakSet[PackedLayer] = weakref.WeakSet()

    def __deepcopy__(self, memo: dict[int, object]) -> Storage:
        return self

    def free_after(self, layer: PackedLayer, n: int) -> bool:
        """Whether `layer` may write past row n: no other living user holds rows there."""
        return all(user is layer or user.get_seq_length() <= n for user in self.users)


class Scratch:
    """Float keys and values (B, Hkv, rows, D) a forward's attention reads when the packed
    layers store narrower ones: one pair for every packed layer of a cache (and its forks),
    which run one after another, grown like a layer's storage, so widening allocates nothing
    per forward (tensors of a new size every chunk would leave the allocator holes)."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def __deepcopy__(self, memo: dict[int, object]) -> Scratch:
        return self

    def __getstate__(self) -> dict[str, object]:
        return {"keys": None, "values": None}  # a save keeps none of it

    def take(self, like: Tensor, rows: int) -> tuple[Tensor, Tensor]:
        """Views of `rows` rows shaped and typed like `like` (B, Hkv, *, D)."""
        k = self.keys
        shape = (*like.shape[:-2], like.shape[-1])
        fits = k is not None and k.dtype == like.dtype and (*k.shape[:-2], k.shape[-1]) == shape
        if not fits or k.shape[-2] < rows:  # type: ignore[union-attr]
            self.keys, self.values = (
                like.new_empty((*like.shape[:-2], grown(rows), like.shape[-1])) for _ in range(2)
            )
        return self.keys[..., :rows, :], self.values[..., :rows, :]  # type: ignore[index]


class PackedLayer(DynamicLayer):
    """A full-attention layer's keys and values (B, Hkv, n, D), rows of a `Storage` of
    `capacity` rows and dtype `dtype` (None: the dtype of the first keys written)."""

    def __init__(
        self, dtype: torch.dtype | None = None, capacity: int = 0, scratch: Scratch | None = None
    ):
        super().__init__()
        self.store_dtype, self.capacity = dtype, capacity
        self.stored: Storage | None = None
        self.scratch = Scratch() if scratch is None else scratch

    def __getstate__(self) -> dict[str, object]:
        """What a save keeps: the rows `keys` and `values` show, not the storage (a loaded
        read allocates it at its first update)."""
        return {**vars(self), "stored": None}

    def __deepcopy__(self, memo: dict[int, object]) -> PackedLayer:
        """A copy (a fork) sharing the storage, and the rows shown where memo shares them."""
        twin = PackedLayer.__new__(PackedLayer)
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy(vars(self), memo))
        if twin.stored is not None:
            twin.stored.users.add(twin)
        return twin

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.stored = None

    def held(self) -> int:
        """The rows of the storage that `keys` shows (-1 where `keys` was replaced by other
        tensors, copied in at the next update; a crop's view stays)."""
        if self.stored is None or self.get_seq_length() == 0:
            return 0
        k = self.stored.keys
        same = self.keys.data_ptr() == k.data_ptr() and self.keys.dtype == k.dtype
        return self.keys.shape[-2] if same else -1

    def storage_for(self, keys: Tensor, values: Tensor, rows: int) -> Storage:
        """A storage of at least `rows` rows shaped like keys, values (B, Hkv, *, D), holding
        the rows `self.keys` and `self.values` show, whose rows past them are this layer's."""
        n = self.get_seq_length()
        s = self.stored
        room = s is not None and self.held() == n and s.keys.shape[-2] >= rows
        if room and s.free_after(self, n):  # type: ignore[union-attr]
            return s  # type: ignore[return-value]
        size = self.capacity if self.capacity >= rows else grown(rows)
        dtype = self.store_dtype or keys.dtype
        new = Storage(*(
            t.new_empty((*t.shape[:-2], size, t.shape[-1]), dtype=dtype) for t in (keys, values)
        ))  # fmt: skip
        if n:
            new.keys[..., :n, :] = self.keys
            new.values[..., :n, :] = self.values
        self.capacity = size
        return new

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Write key_states, value_states (B, Hkv, L, D) after the rows held; return every
        row's keys and values for the forward's attention (the earlier ones widened to the
        forward's dtype where they are stored narrower, its own as given)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        end = n + key_states.shape[-2]
        self.stored = self.storage_for(key_states, value_states, end)
        self.stored.users.add(self)
        k, v = self.stored.keys, self.stored.values
        # storage made by a read under inference mode is written in place in it, whatever the
        # mode of a later forward (a concatenation makes new tensors in either)
        with torch.inference_mode(k.is_inference()):
            k[..., n:end, :] = key_states
            v[..., n:end, :] = value_states
            self.keys, self.values = k[..., :end, :], v[..., :end, :]
            if k.dtype == key_states.dtype:
                return self.keys, self.values
            wide_k, wide_v = self.scratch.take(key_states, end)
            for wide, stored, new in ((wide_k, k, key_states), (wide_v, v, value_states)):
                wide[..., :n, :] = stored[..., :n, :]
                wide[..., n:end, :] = new
            return wide_k, wide_v
