"""Naive references for the baseline attentions: one query at a time, whole sequence, no state.

Slow and obviously correct; the tests compare the fast paths in `functional.py` against these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def naive_windowed_attention(
    q: Tensor, k: Tensor, v: Tensor, lo: Callable[[int], int], scale: float | None = None
) -> Tensor:
    """Query p of q (B, H, T, Dk) attends keys [max(0, lo(p)), p] of k (B, Hkv, T, Dk), v."""
    G = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(G, dim=1)
    vv = v.repeat_interleave(G, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    for p in range(q.shape[2]):
        s = max(0, lo(p))
        logits = torch.einsum("bhd,bhld->bhl", q[:, :, p], kk[:, :, s : p + 1]) * scale
        out[:, :, p] = torch.einsum("bhl,bhld->bhd", torch.softmax(logits, -1), vv[:, :, s : p + 1])
    return out


def naive_full_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Causal softmax attention, query by query."""
    return naive_windowed_attention(q, k, v, lambda p: 0, scale)


def naive_sliding_window_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None
) -> Tensor:
    """Query p sees keys [p - window + 1, p]."""
    return naive_windowed_attention(q, k, v, lambda p: p - window + 1, scale)


def naive_block_sliding_window_attention(
    q: Tensor, k: Tensor, v: Tensor, chunk_len: int, window_chunks: int, scale: float | None = None
) -> Tensor:
    """Query p in chunk c = p // C sees keys [(c - N + 1) * C, p]."""
    return naive_windowed_attention(
        q, k, v, lambda p: (p // chunk_len - window_chunks + 1) * chunk_len, scale
    )
