"""WindowCache: the raw keys and values of the most recent tokens, carried between calls; Rows,
the growable buffer that holds them (and the KVM slots) without a copy per token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from longkv.attention.core import Dims, records_grad


class Store:
    """A buffer data (B, Hkv, capacity, width) shared by the `Rows` of one sequence; rows
    [0, end) are written. Mutable: `Rows` decides when writing into it is safe; a store that
    wraps a caller's tensor (writable=False) is never written."""

    def __init__(self, data: Tensor, end: int, writable: bool = True) -> None:
        self.data = data
        self.end = end
        self.writable = writable

    @property
    def capacity(self) -> int:
        return self.data.shape[2]


def tensor_bytes(*tensors: Tensor) -> int:
    """Bytes of the elements of tensors (a view counts its own elements only)."""
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Rows:
    """Rows [lo, hi) along dim 2 of a Store (tensor: (B, Hkv, hi - lo, width)).

    Appending writes into the store in place when these rows are the newest the store holds
    (no other Rows extends past hi), the new rows fit, autograd is not recording and, for a
    store made in inference mode, inference mode is on (torch writes inference tensors only
    there): the rows of every older Rows stay as they were, so a state is never changed by a
    later call. Else the rows are copied into a new store with room to grow (twice the rows), or
    concatenated when autograd records. `own=True` also lets rows be moved or overwritten in
    place (older Rows of the store may then read changed data): for a caller that drops the
    old state.
    """

    store: Store
    lo: int
    hi: int

    @classmethod
    def of(cls, t: Tensor) -> Rows:
        """All rows of t (B, Hkv, n, width), without a copy; t is never written to."""
        return cls(Store(t, t.shape[2], writable=False), 0, t.shape[2])

    @property
    def tensor(self) -> Tensor:
        """(B, Hkv, hi - lo, width), a view of the store."""
        return self.store.data.narrow(2, self.lo, self.hi - self.lo)

    def __len__(self) -> int:
        return self.hi - self.lo

    @property
    def storage_bytes(self) -> int:
        """Bytes of the whole store, the rows beyond this view included."""
        data = self.store.data
        return data.numel() * data.element_size()

    def _writable(self) -> bool:
        """Whether the store may be written here: one made in inference mode only inside it."""
        s = self.store
        return s.writable and (torch.is_inference_mode_enabled() or not s.data.is_inference())

    def append(self, x: Tensor, own: bool = False) -> Rows:
        """These rows followed by x (B, Hkv, n, width)."""
        s, n, L = self.store, x.shape[2], len(self)
        if records_grad(s.data, x):  # nothing is written in place
            return Rows.of(torch.cat([self.tensor, x], dim=2))
        newest = self._writable() and s.end == self.hi
        if own and newest and self.hi + n > s.capacity and self.lo >= L and L + n <= s.capacity:
            # move the rows to the front of the store (lo >= L: the ranges do not overlap)
            s.data[:, :, :L] = s.data[:, :, self.lo : self.hi]
            s.end = L
            return Rows(s, 0, L).append(x, own)
        if newest and self.hi + n <= s.capacity:
            s.data.narrow(2, self.hi, n).copy_(x)
            s.end = self.hi + n
            return Rows(s, self.lo, self.hi + n)
        return Rows._grown(self.tensor, x)

    def add_at(self, index: Tensor, src: Tensor, own: bool = False) -> Rows:
        """These rows with src (B, Hkv, n, width) added at rows index (B, Hkv, n) (repeated
        rows sum); in place only with own, else into a copy of the rows."""
        if records_grad(self.store.data, src):
            return Rows.of(self.tensor.scatter_add(2, index.unsqueeze(-1).expand_as(src), src))
        s = self.store
        if own and self._writable() and s.data.is_contiguous():
            rows, data, base = self, s.data, self.lo
        else:
            data = self.tensor.clone(memory_format=torch.contiguous_format)
            rows, base = Rows(Store(data, len(self)), 0, len(self)), 0
        B, Hkv, cap, width = data.shape
        first = torch.arange(B * Hkv, device=index.device).view(B, Hkv, 1) * cap + base
        data.view(-1, width).index_add_(0, (first + index).view(-1), src.reshape(-1, width))
        return rows

    def drop_front(self, i: int) -> Rows:
        """Without the first i rows; copied into a store of their own size when they are under a
        quarter of the store (after a long prefill), so the dropped ones are freed."""
        rest = Rows(self.store, self.lo + i, self.hi)
        if 4 * len(rest) >= self.store.capacity:
            return rest
        return Rows.of(rest.tensor.clone()) if records_grad(self.store.data) else rest.copy()

    def copy(self) -> Rows:
        """The same rows in a store of their own, with room to grow."""
        return Rows._grown(self.tensor)

    def shared(self) -> Rows:
        """These rows over the same buffer, in a Store of their own that ends at hi: they append
        in place past hi (where another `shared` of the same rows may have written before) and
        never change rows [lo, hi), so each of several readers, one at a time, reads on from
        here without copying what they share."""
        return Rows(Store(self.store.data, self.hi, self.store.writable), self.lo, self.hi)

    def with_room(self, n: int) -> Rows:
        """These rows where n more append in place: themselves when their store has that room
        past hi, else copied into a store of len + n rows."""
        s = self.store
        if self._writable() and s.end == self.hi and s.capacity - self.hi >= n:
            return self
        data = self.tensor.new_empty(*self.tensor.shape[:2], len(self) + n, self.tensor.shape[3])
        data[:, :, : len(self)] = self.tensor
        return Rows(Store(data, len(self)), 0, len(self))

    def __reduce__(self) -> tuple[object, tuple[Tensor]]:
        """Pickled (and deep-copied) as its rows alone, not the store's room around them."""
        return owned_rows, (self.tensor.clone(memory_format=torch.contiguous_format),)

    @staticmethod
    def _grown(*parts: Tensor) -> Rows:
        """parts (B, Hkv, n_i, width) one after the other in a new store with twice their rows."""
        n = sum(t.shape[2] for t in parts)
        first = parts[0]
        data = first.new_empty(*first.shape[:2], 2 * n, first.shape[3])
        torch.cat(parts, dim=2, out=data[:, :, :n])
        return Rows(Store(data, n), 0, n)

    def select_rows(self, rows: Tensor) -> Rows:
        """The batch rows `rows` (R,), in that order, in a new store."""
        return Rows.of(self.tensor.index_select(0, rows.to(self.store.data.device)))

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Rows:
        """A copy on another device and/or floating dtype."""
        return Rows.of(self.tensor.to(device=device, dtype=dtype))


def owned_rows(t: Tensor) -> Rows:
    """All rows of t (B, Hkv, n, width) in a writable store of exactly those rows (t is owned:
    appending copies it into a grown store, `add_at(own=True)` writes it): an unpickled Rows."""
    return Rows(Store(t, t.shape[2]), 0, t.shape[2])


@dataclass(frozen=True)
class WindowCache:
    """Keys, values (and optional per-token gates) of tokens [seen - L, seen).

    k: (B, Hkv, L, Dk); v: (B, Hkv, L, Dv); g: (B, Hkv, L, 1) or None (KVM merge gates), each
    held as `Rows` so that appending a token writes in place. Full attention keeps every token;
    window attentions keep only what later queries read.
    """

    rows_k: Rows
    rows_v: Rows
    seen: int
    rows_g: Rows | None = None

    @classmethod
    def of(cls, k: Tensor, v: Tensor, seen: int, g: Tensor | None = None) -> WindowCache:
        """The cache holding k (B, Hkv, L, Dk), v and g of tokens [seen - L, seen)."""
        return cls(Rows.of(k), Rows.of(v), seen, None if g is None else Rows.of(g))

    @classmethod
    def empty(cls, k: Tensor, v: Tensor, with_gate: bool = False) -> WindowCache:
        """An empty cache shaped like new keys k (B, Hkv, T, Dk) and values v (B, Hkv, T, Dv)."""
        g = k.new_zeros(k.shape[0], k.shape[1], 0, 1) if with_gate else None
        return cls.of(k[:, :, :0], v[:, :, :0], 0, g)

    @property
    def k(self) -> Tensor:
        return self.rows_k.tensor

    @property
    def v(self) -> Tensor:
        return self.rows_v.tensor

    @property
    def g(self) -> Tensor | None:
        return None if self.rows_g is None else self.rows_g.tensor

    @property
    def start(self) -> int:
        """Absolute position of the first cached token."""
        return self.seen - len(self.rows_k)

    @property
    def batch_size(self) -> int:
        """B, the batch rows."""
        return self.k.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the cached tokens (`storage_bytes`: with the buffers' spare room)."""
        tensors = [self.k, self.v] + ([self.g] if self.g is not None else [])
        return tensor_bytes(*tensors)

    @property
    def storage_bytes(self) -> int:
        """Bytes of the buffers holding the cache, their room to grow included."""
        return sum(r.storage_bytes for r in self._rows())

    def _rows(self) -> list[Rows]:
        return [self.rows_k, self.rows_v] + ([self.rows_g] if self.rows_g is not None else [])

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> WindowCache:
        """A copy on another device and/or floating dtype."""
        g = None if self.rows_g is None else self.rows_g.to(device, dtype)
        k, v = self.rows_k.to(device, dtype), self.rows_v.to(device, dtype)
        return WindowCache(k, v, self.seen, g)

    def select_rows(self, rows: Tensor) -> WindowCache:
        """The cache of batch rows `rows` (R,), in that order (beam reorder, repeat, select)."""
        g = None if self.rows_g is None else self.rows_g.select_rows(rows)
        return WindowCache(
            self.rows_k.select_rows(rows), self.rows_v.select_rows(rows), self.seen, g
        )

    def extend(
        self, k: Tensor, v: Tensor, g: Tensor | None = None, own: bool = False
    ) -> WindowCache:
        """This cache followed by T new tokens (`Rows.append`; own: see there).

        k: (B, Hkv, T, Dk), v: (B, Hkv, T, Dv), g: (B, Hkv, T, 1) or None.
        """
        if self.seen == len(self.rows_k) == 0:
            return WindowCache.of(k, v, k.shape[2], g)
        rows_g = None if g is None or self.rows_g is None else self.rows_g.append(g, own)
        return WindowCache(
            self.rows_k.append(k, own), self.rows_v.append(v, own), self.seen + k.shape[2], rows_g
        )

    def keep_from(self, pos: int) -> WindowCache:
        """Only the tokens [pos, seen) (`Rows.drop_front`)."""
        i = pos - self.start
        if i <= 0:
            return self
        g = None if self.rows_g is None else self.rows_g.drop_front(i)
        return WindowCache(self.rows_k.drop_front(i), self.rows_v.drop_front(i), self.seen, g)

    def check_fits(self, dims: Dims, like: Tensor) -> None:
        """Raise unless this cache can continue a call with these sizes, dtype and device."""
        k, v = self.rows_k.store.data, self.rows_v.store.data
        want = (dims.B, dims.Hkv, dims.Dk, dims.Dv)
        got = (k.shape[0], k.shape[1], k.shape[3], v.shape[3])
        if got != want:
            raise ValueError(
                f"state: holds (B, Hkv, Dk, Dv) = {got} but this call has {want}; pass the "
                "state returned for the same batch and heads"
            )
        if k.dtype != like.dtype or k.device != like.device:
            raise ValueError(
                f"state: dtype/device {k.dtype}/{k.device} differs from the inputs' "
                f"{like.dtype}/{like.device}; move it with state.to(device, dtype)"
            )

    def require_from(self, pos: int, what: str) -> None:
        """Raise if tokens from absolute position `pos` on are no longer held."""
        if pos < self.start:
            raise ValueError(
                f"state: holds tokens from position {self.start} but {what} needs them from "
                f"{pos}; pass the state returned by the same attention with the same window"
            )
