"""Baseline attentions with a carried state: full causal, sliding window, block sliding window.

Each takes q (B, H, T, Dk) and k (B, Hkv, T, Dk), v (B, Hkv, T, Dv) after RoPE, and an optional
`WindowCache` from an earlier call, and returns (out (B, H, T, Dv), cache). Calls over any
segmentation of a sequence give the outputs of one call over all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from longkv.attention.core import (
    Dims,
    attend,
    attention_logits,
    check_qkv,
    group_heads,
    hidden_future,
    hidden_outside_band,
    logit_scale,
    ungroup_heads,
)
from longkv.attention.state import WindowCache

P = TypeVar("P", int, Tensor)


def check_cache(state: WindowCache | None, k: Tensor, v: Tensor, dims: Dims) -> WindowCache:
    """Return `state` after checking it fits k (B, Hkv, T, Dk) and v, or an empty cache."""
    if state is None:
        return WindowCache.empty(k, v)
    if not isinstance(state, WindowCache):
        raise ValueError(
            f"state: expected a WindowCache from an earlier call, got {type(state).__name__}"
        )
    state.check_fits(dims, k)
    return state


def full_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    state: WindowCache | None = None,
    scale: float | None = None,
    donate: bool = False,
) -> tuple[Tensor, WindowCache]:
    """Causal softmax attention over every token so far (torch SDPA); the cache keeps them all.

    donate: the given cache may be changed in place (`WindowCache.extend`).
    """
    dims = check_qkv(q, k, v)
    cache = check_cache(state, k, v, dims).extend(k, v, own=donate)
    n0 = cache.seen - dims.T
    K, V = cache.k, cache.v  # (B, Hkv, n0 + T, D)
    if dims.groups > 1:
        K = K.repeat_interleave(dims.groups, dim=1)
        V = V.repeat_interleave(dims.groups, dim=1)
    if n0 == 0 or dims.T == 1:
        out = F.scaled_dot_product_attention(q, K, V, is_causal=n0 == 0, scale=scale)
    else:
        pos = torch.arange(cache.seen, device=q.device)
        visible = pos[None, :] <= pos[n0:, None]
        out = F.scaled_dot_product_attention(q, K, V, attn_mask=visible, scale=scale)
    return out, cache


def banded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lo: Callable[[P], P],
    block_len: int,
    *,
    state: WindowCache | None = None,
    scale: float | None = None,
    donate: bool = False,
) -> tuple[Tensor, WindowCache]:
    """Causal attention where the query at position p sees keys [max(0, lo(p)), p].

    lo must be non-decreasing and work on ints and integer tensors alike. Queries are processed
    in blocks of `block_len` aligned to absolute positions; the returned cache keeps the tokens
    [lo(seen), seen) that the next query reads; donate: the given cache may be changed in
    place (`WindowCache.extend`).
    """
    dims = check_qkv(q, k, v)
    cache = check_cache(state, k, v, dims)
    n0 = cache.seen
    cache.require_from(max(0, lo(n0)), "the next query")
    cache = cache.extend(k, v, own=donate)
    n1, base = cache.seen, cache.start
    qg, scale = group_heads(q, dims.Hkv), logit_scale(dims, scale)  # (B, Hkv, G, T, Dk)
    pos = torch.arange(n1, device=q.device)
    future = hidden_future(min(block_len, dims.T), q.device)
    out = q.new_empty(dims.B, dims.Hkv, dims.groups, dims.T, dims.Dv)
    a = n0
    while a < n1:
        b = min(n1, (a // block_len + 1) * block_len)
        s = max(0, lo(a))
        window = slice(s - base, b - base)
        logits = attention_logits(qg[:, :, :, a - n0 : b - n0], cache.k[:, :, window], scale)
        if lo(b - 1) <= s:  # keys before the block are seen by all its queries
            hide = future[: b - a, : b - a]
        else:
            hide = hidden_outside_band(pos[a:b], pos[s:b], lo(pos[a:b]))
        out[:, :, :, a - n0 : b - n0] = attend(logits, cache.v[:, :, window], hide)
        a = b
    return ungroup_heads(out), cache.keep_from(max(0, lo(n1)))


def check_window(window: int) -> None:
    """Raise unless window is an int >= 1."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window: must be an int >= 1, got {window!r}")


def check_blocks(chunk_len: int, window_chunks: int) -> None:
    """Raise unless chunk_len and window_chunks are ints >= 1."""
    for name, value in (("chunk_len", chunk_len), ("window_chunks", window_chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be an int >= 1, got {value!r}")


def sliding_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    *,
    state: WindowCache | None = None,
    scale: float | None = None,
    donate: bool = False,
) -> tuple[Tensor, WindowCache]:
    """SWA: the query at p sees the `window` most recent keys [p - window + 1, p]."""
    check_window(window)
    return banded_attention(
        q, k, v, lambda p: p - window + 1, max(window, 64), state=state, scale=scale,
        donate=donate,
    )  # fmt: skip


def block_sliding_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    chunk_len: int,
    window_chunks: int,
    *,
    state: WindowCache | None = None,
    scale: float | None = None,
    donate: bool = False,
) -> tuple[Tensor, WindowCache]:
    """BSWA: the query at p in chunk c = p // C sees keys [(c - N + 1) * C, p]."""
    check_blocks(chunk_len, window_chunks)
    return banded_attention(
        q,
        k,
        v,
        lambda p: (p // chunk_len - window_chunks + 1) * chunk_len,
        chunk_len,
        state=state,
        scale=scale,
        donate=donate,
    )
