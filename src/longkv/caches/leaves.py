"""The leaves of two-level KVM-Fold: every token that left the window, exact, owned by one slot.

A leaf is a token's key and value as the model produced them, and the slot it founded or merged
into (`caches.kvm_state.update_state`'s dest). They are kept in one of two stores:
- "exact": in the model's dtype; opening every slot then gives the exact cache.
- "int8": a code in [-127, 127] per channel and a float32 scale per token and head, one for the
  key and one for the value (scale = the row's largest magnitude / 127), so a channel comes back
  within half a step: |x - read(x)| <= max |row| / 254. A quarter of fp32's bytes (plus 8 bytes of
  scales per token and head).
Leaves sit outside the bounded part of the cache: `nbytes` counts them on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from longkv.attention.state import Rows

LEAF_STORES = ("exact", "int8")
LEVELS = 127  # the largest int8 code


@dataclass(frozen=True)
class Leaves:
    """Leaves of one layer, in order of leaving: rows (B, Hkv, L, D + Dv) keys then values, as
    stored; scale (B, Hkv, L, 2) the int8 scales of key and value (None when exact); owner
    (B, Hkv, L, 1) the slot each leaf belongs to; key_dim: D."""

    rows: Rows
    scale: Rows | None
    owner: Rows
    key_dim: int

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the leaves held: codes or keys and values, scales, owners."""
        parts = [self.rows.tensor, self.owner.tensor]
        if self.scale is not None:
            parts.append(self.scale.tensor)
        return sum(t.numel() * t.element_size() for t in parts)


def empty_leaves(keys: Tensor, values: Tensor, store: str = "exact") -> Leaves:
    """No leaves, shaped for keys (B, Hkv, *, D) and values (B, Hkv, *, Dv) in `store` (one of
    LEAF_STORES, as `KVMFoldConfig.leaves` checks)."""
    B, Hkv, D = keys.shape[0], keys.shape[1], keys.shape[-1]
    width = D + values.shape[-1]
    dtype = torch.int8 if store == "int8" else keys.dtype
    new = keys.new_zeros
    scale = Rows.of(new(B, Hkv, 0, 2, dtype=torch.float32)) if store == "int8" else None
    return Leaves(
        Rows.of(new(B, Hkv, 0, width, dtype=dtype)),
        scale,
        Rows.of(new(B, Hkv, 0, 1, dtype=torch.long)),
        D,
    )


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """int8 codes (..., n) and float32 scales (..., 1) of rows x (..., n): x ~ codes * scale."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / LEVELS
    codes = torch.where(scale > 0, x / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return codes.round().clamp(-LEVELS, LEVELS).to(torch.int8), scale


def add_leaves(
    leaves: Leaves, keys: Tensor, values: Tensor, owner: Tensor, donate: bool = False
) -> Leaves:
    """leaves with the tokens keys (B, Hkv, m, D), values (B, Hkv, m, Dv) appended, owned by
    owner (B, Hkv, m); donate: the given leaves' buffers may be grown in place."""
    own = leaves.owner.append(owner.unsqueeze(-1), donate)
    if leaves.scale is None:
        rows = leaves.rows.append(torch.cat([keys, values], dim=-1), donate)
        return Leaves(rows, None, own, leaves.key_dim)
    k_codes, k_scale = quantize(keys)
    v_codes, v_scale = quantize(values)
    rows = leaves.rows.append(torch.cat([k_codes, v_codes], dim=-1), donate)
    scale = leaves.scale.append(torch.cat([k_scale, v_scale], dim=-1), donate)
    return Leaves(rows, scale, own, leaves.key_dim)


def read_leaves(leaves: Leaves, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The leaves' keys (B, Hkv, L, D) and values (B, Hkv, L, Dv) in dtype, and their owners
    (B, Hkv, L)."""
    rows, D = leaves.rows.tensor, leaves.key_dim
    keys, values = rows[..., :D], rows[..., D:]
    if leaves.scale is not None:
        scale = leaves.scale.tensor
        keys, values = keys.float() * scale[..., :1], values.float() * scale[..., 1:]
    return keys.to(dtype), values.to(dtype), leaves.owner.tensor[..., 0]
