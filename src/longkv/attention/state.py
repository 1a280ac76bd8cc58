"""WindowCache: the raw keys and values of the most recent tokens, carried between calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from longkv.attention.core import Dims


@dataclass(frozen=True)
class WindowCache:
    """Keys, values (and optional per-token gates) of tokens [seen - L, seen).

    k: (B, Hkv, L, Dk); v: (B, Hkv, L, Dv); g: (B, Hkv, L, 1) or None (KVM merge gates).
    Full attention keeps every token; window attentions keep only what later queries read.
    """

    k: Tensor
    v: Tensor
    seen: int
    g: Tensor | None = None

    @classmethod
    def empty(cls, k: Tensor, v: Tensor, with_gate: bool = False) -> WindowCache:
        """An empty cache shaped like new keys k (B, Hkv, T, Dk) and values v (B, Hkv, T, Dv)."""
        g = k.new_zeros(k.shape[0], k.shape[1], 0, 1) if with_gate else None
        return cls(k=k[:, :, :0], v=v[:, :, :0], seen=0, g=g)

    @property
    def start(self) -> int:
        """Absolute position of the first cached token."""
        return self.seen - self.k.shape[2]

    @property
    def batch_size(self) -> int:
        """B, the batch rows."""
        return self.k.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached tensors."""
        tensors = [self.k, self.v] + ([self.g] if self.g is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> WindowCache:
        """A copy on another device and/or floating dtype."""
        g = None if self.g is None else self.g.to(device=device, dtype=dtype)
        return WindowCache(
            k=self.k.to(device=device, dtype=dtype),
            v=self.v.to(device=device, dtype=dtype),
            seen=self.seen,
            g=g,
        )

    def select_rows(self, rows: Tensor) -> WindowCache:
        """The cache of batch rows `rows` (R,), in that order (beam reorder, repeat, select)."""
        rows = rows.to(self.k.device)
        g = None if self.g is None else self.g.index_select(0, rows)
        return WindowCache(
            k=self.k.index_select(0, rows), v=self.v.index_select(0, rows), seen=self.seen, g=g
        )

    def extend(self, k: Tensor, v: Tensor, g: Tensor | None = None) -> WindowCache:
        """This cache followed by T new tokens.

        k: (B, Hkv, T, Dk), v: (B, Hkv, T, Dv), g: (B, Hkv, T, 1) or None.
        """
        if self.seen == self.k.shape[2] == 0:
            return WindowCache(k=k, v=v, seen=k.shape[2], g=g)
        g_all = None if g is None or self.g is None else torch.cat([self.g, g], dim=2)
        return WindowCache(
            k=torch.cat([self.k, k], dim=2),
            v=torch.cat([self.v, v], dim=2),
            seen=self.seen + k.shape[2],
            g=g_all,
        )

    def keep_from(self, pos: int) -> WindowCache:
        """Only the tokens [pos, seen), copied so the dropped ones are freed."""
        i = pos - self.start
        if i <= 0:
            return self
        g = None if self.g is None else self.g[:, :, i:].clone()
        return WindowCache(
            k=self.k[:, :, i:].clone(), v=self.v[:, :, i:].clone(), seen=self.seen, g=g
        )

    def check_fits(self, dims: Dims, like: Tensor) -> None:
        """Raise unless this cache can continue a call with these sizes, dtype and device."""
        want = (dims.B, dims.Hkv, dims.Dk, dims.Dv)
        got = (self.k.shape[0], self.k.shape[1], self.k.shape[3], self.v.shape[3])
        if got != want:
            raise ValueError(
                f"state: holds (B, Hkv, Dk, Dv) = {got} but this call has {want}; pass the "
                "state returned for the same batch and heads"
            )
        if self.k.dtype != like.dtype or self.k.device != like.device:
            raise ValueError(
                f"state: dtype/device {self.k.dtype}/{self.k.device} differs from the inputs' "
                f"{like.dtype}/{like.device}; move it with state.to(device, dtype)"
            )

    def require_from(self, pos: int, what: str) -> None:
        """Raise if tokens from absolute position `pos` on are no longer held."""
        if pos < self.start:
            raise ValueError(
                f"state: holds tokens from position {self.start} but {what} needs them from "
                f"{pos}; pass the state returned by the same attention with the same window"
            )
