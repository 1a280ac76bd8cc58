"""Shared pieces of every attention in longkv: input checks, head grouping, one masked softmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Dims:
    """Sizes read off q (B, H, T, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv)."""

    B: int
    H: int
    Hkv: int
    T: int
    Dk: int
    Dv: int

    @property
    def groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.H // self.Hkv


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> Dims:
    """Validate q (B, H, T, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv) and return their sizes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name}: expected 4 dims (batch, heads, tokens, head_dim), got shape "
                f"{tuple(t.shape)}; transpose a (B, T, H, D) tensor with .transpose(1, 2)"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name}: dtype/device {t.dtype}/{t.device} differs from q's {q.dtype}/{q.device}; "
                "cast all inputs with .to(q)"
            )
    B, H, T, Dk = q.shape
    Hkv = k.shape[1]
    if T == 0:
        raise ValueError("q: has no tokens (T = 0); pass at least one token per call")
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != Dk:
        raise ValueError(
            f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)}; expected "
            f"(B={B}, Hkv, T={T}, Dk={Dk})"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v: shape {tuple(v.shape)} does not match k {tuple(k.shape)} in (B, Hkv, T)"
        )
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"k: {Hkv} key/value heads do not divide {H} query heads; use a divisor of {H}"
        )
    return Dims(B=B, H=H, Hkv=Hkv, T=T, Dk=Dk, Dv=v.shape[3])


def check_optional(
    name: str, t: Tensor | None, shape: tuple[int, ...], like: Tensor
) -> Tensor | None:
    """Validate an optional tensor argument's shape, dtype and device against `like`."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.dtype != like.dtype or t.device != like.device:
        raise ValueError(
            f"{name}: dtype/device {t.dtype}/{t.device} differs from q's "
            f"{like.dtype}/{like.device}; cast it with .to(q)"
        )
    return t


def head_scale(dims: Dims, scale: float | None, temp: Tensor | None, like: Tensor) -> Tensor:
    """Per-query-head logit scale `scale * temp` shaped (1, Hkv, G, 1, 1) for grouped queries."""
    base = dims.Dk**-0.5 if scale is None else scale
    t = like.new_ones(dims.H) if temp is None else temp
    return (t * base).view(1, dims.Hkv, dims.groups, 1, 1)


def group_heads(q: Tensor, Hkv: int) -> Tensor:
    """(B, H, T, D) -> (B, Hkv, G, T, D): the G query heads that share each key/value head."""
    B, H, T, D = q.shape
    return q.view(B, Hkv, H // Hkv, T, D)


def ungroup_heads(x: Tensor) -> Tensor:
    """(B, Hkv, G, T, D) -> (B, H, T, D)."""
    B, Hkv, G, T, D = x.shape
    return x.reshape(B, Hkv * G, T, D)


def causal_band_mask(q_pos: Tensor, k_pos: Tensor, lo: Tensor | None = None) -> Tensor:
    """(Lq, Lk) bool, True where key position lies in [lo(query), query]; lo defaults to 0."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if lo is not None:
        mask = mask & (k_pos[None, :] >= lo[:, None])
    return mask


def softmax_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    prefix: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """One softmax over optional prefix keys (seen by every query) and masked keys.

    q: (B, Hkv, G, Lq, Dk), already multiplied by its logit scale; k: (B, Hkv, Lk, Dk);
    v: (B, Hkv, Lk, Dv); mask: (Lq, Lk) bool, True = visible, at least one per row;
    prefix: (q_p (B, Hkv, G, Lq, Dk) scaled queries, k_p (B, Hkv, S, Dk), v_p (B, Hkv, S, Dv)).
    Returns (B, Hkv, G, Lq, Dv).
    """
    B, Hkv, G, Lq, Dk = q.shape
    logits = (q.reshape(B, Hkv, G * Lq, Dk) @ k.transpose(-1, -2)).view(B, Hkv, G, Lq, -1)
    logits = logits.masked_fill(~mask, float("-inf"))
    if prefix is None:
        probs = torch.softmax(logits, dim=-1)
        return (probs.view(B, Hkv, G * Lq, -1) @ v).view(B, Hkv, G, Lq, -1)
    q_p, k_p, v_p = prefix
    S = k_p.shape[2]
    logits_p = (q_p.reshape(B, Hkv, G * Lq, Dk) @ k_p.transpose(-1, -2)).view(B, Hkv, G, Lq, S)
    probs = torch.softmax(torch.cat([logits_p, logits], dim=-1), dim=-1)
    probs = probs.view(B, Hkv, G * Lq, -1)
    out = probs[..., :S] @ v_p + probs[..., S:] @ v
    return out.view(B, Hkv, G, Lq, -1)
