"""Rotary position embedding on the leading channels of each head (partial RoPE)."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_angles(positions: Tensor, rope_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin (T, rope_dim) in float64 for integer positions (T,), rotate-half layout."""
    f64 = torch.float64
    inv_freq = base ** -(
        torch.arange(0, rope_dim, 2, dtype=f64, device=positions.device) / rope_dim
    )
    return angles_at(positions, inv_freq)


def angles_at(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin (T, 2F) in float64 at positions (T,) (negative ones undo a rotation) for
    inverse frequencies inv_freq (F,), rotate-half layout."""
    inv_freq = inv_freq.to(device=positions.device, dtype=torch.float64)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, F)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first R channels of x (..., T, D) by angles given as cos, sin (T, R)."""
    R = cos.shape[-1]
    rot, rest = x[..., :R], x[..., R:]
    half = R // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos.to(x.dtype) + rotated * sin.to(x.dtype), rest], dim=-1)


def apply_rope(x: Tensor, positions: Tensor, rope_dim: int, base: float = 10000.0) -> Tensor:
    """Rotate the first rope_dim channels of x (B, H, T, D) by their absolute positions (T,)."""
    if rope_dim == 0:
        return x
    return rotate(x, *rope_angles(positions, rope_dim, base))
