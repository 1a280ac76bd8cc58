"""Attention for bounded caches and fold variants: the model's own softmax attention plus what
a cache policy needs (an additive bias per cached entry, the probability mass the last queries
give each entry) or what a fold variant changes (the mask, the cache's storage dtype), through
transformers' AttentionInterface.

`hooked(model, hooks)` runs the model's attention layers with `bounded_attention` for the
duration of a forward: softmax attention under `hooks.mask` (by default causal, bottom-right
aligned: query i of L sees the keys up to Lk - L + i), computed in at least float32, on keys
and values rounded to `hooks.store_dtype` if given, with `hooks.bias[layer]` added to the
logits of every query and, when `hooks.observe > 0`, the probabilities of the last `observe`
queries summed over them and over the query heads that share each KV head; or, for a layer with
`hooks.attend[layer]`, that function's attention (a retrieval cache's, `longkv.caches.routed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

NAME = "longkv_bounded"
Attend = Callable[[Tensor, Tensor, Tensor, float], Tensor]  # (queries, keys, values, scale) -> out


@dataclass
class AttentionHooks:
    """What one forward adds to attention and reads back from it.

    bias: per layer, None or (B, Hkv, Lk) added to every query's logits on those keys;
    attend: per layer, None or a function of the rotated queries (B, H, L, D), the cached keys
    (B, Hkv, Lk, D) and values (the queries' own the last L) and the logit scale that computes
    the layer's attention itself, (B, H, L, Dv) (not with `bias`);
    observe: how many of the last queries to sum probabilities over (0: none);
    seen: filled per layer with (B, Hkv, Lk) float32 probability mass of the observed queries;
    mask: which keys query i of L sees among Lk (`MASKS`);
    store_dtype: the dtype the cache keeps keys and values in (every read sees them rounded to
    it), None for the model's own.
    """

    bias: list[Tensor | None] | None = None
    attend: list[Attend | None] | None = None
    observe: int = 0
    seen: dict[int, Tensor] = field(default_factory=dict)
    mask: str = "causal"
    store_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.mask not in MASKS:
            raise ValueError(f"mask: {self.mask!r} is not one of {list(MASKS)}")
        if self.bias is not None and self.attend is not None:
            raise ValueError(
                "bias: a per-key bias and an attention of its own exclude each other; give one"
            )


# which keys j of Lk query i of L sees (the L queries are the last L positions of the keys)
MASKS = {
    "causal": "j <= Lk - L + i (bottom-right aligned: the keys up to the query's own)",
    "top-left": "j <= i (aligned to the first key, as is_causal=True aligns it when L < Lk)",
    "past-and-self": "j < Lk - L or j == Lk - L + i (earlier chunks and the query's own key)",
}


def visible_keys(mask: str, L: int, Lk: int, device: torch.device | None = None) -> Tensor:
    """(L, Lk) bool: which keys each of the L queries sees under `mask` (`MASKS`)."""
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(Lk, device=device)[None, :]
    if mask == "causal":
        return j <= Lk - L + i
    if mask == "top-left":
        return j <= i
    return (j < Lk - L) | (j == Lk - L + i)


def within_window(L: int, Lk: int, window: int, device: torch.device | None = None) -> Tensor:
    """(L, Lk) bool: the keys fewer than `window` positions before each of the L queries (the
    last L of the Lk keys), as a sliding-window layer sees them."""
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(Lk, device=device)[None, :]
    return j > Lk - L + i - window


_ACTIVE: ContextVar[AttentionHooks | None] = ContextVar("longkv_attention_hooks", default=None)
UNSUPPORTED = ("softcap", "s_aux")


def bounded_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """Attention of query (B, H, L, D) on key, value (B, Hkv, Lk, D): output (B, L, H, Dv).

    attention_mask is ignored: no mask is built for this implementation, and the fold's rows
    carry no padding. A sliding-window layer (`sliding_window` W) also hides the keys W or more
    positions before the query's own (the last L keys are the queries' own).
    """
    hooks = _ACTIVE.get()
    if hooks is None:
        raise RuntimeError(f"attention {NAME!r} runs only inside longkv.fold.attention.hooked")
    used = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if used:
        raise ValueError(
            f"model: its attention uses {used}, which longkv's attention (bounded caches, fold "
            "variants) does not support"
        )
    out_dtype = value.dtype
    if hooks.store_dtype is not None:
        key, value = key.to(hooks.store_dtype), value.to(hooks.store_dtype)
    high = torch.promote_types(query.dtype, torch.float32)
    B, H, L, D = query.shape
    scale = D**-0.5 if scaling is None else scaling
    layer = getattr(module, "layer_idx", 0)
    attend = None if hooks.attend is None else hooks.attend[layer]
    if attend is not None:
        out = attend(query, key, value, scale)  # (B, H, L, Dv)
        return out.to(out_dtype).transpose(1, 2).contiguous(), None
    Hkv, Lk = key.shape[1], key.shape[2]
    G = H // Hkv
    q = query.to(high).view(B, Hkv, G, L, D)
    scores = q @ key.to(high).unsqueeze(2).transpose(-1, -2) * scale  # (B, Hkv, G, L, Lk)
    visible = visible_keys(hooks.mask, L, Lk, query.device)
    window = kwargs.get("sliding_window")
    if isinstance(window, int):
        visible = visible & within_window(L, Lk, window, query.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    bias = None if hooks.bias is None else hooks.bias[layer]
    if bias is not None:
        scores = scores + bias.to(high)[:, :, None, None, :]
    probs = scores.softmax(dim=-1)
    if hooks.observe:
        hooks.seen[layer] = probs[..., -hooks.observe :, :].sum(dim=(2, 3)).float()
    out = probs @ value.to(high).unsqueeze(2)  # (B, Hkv, G, L, Dv)
    return out.to(out_dtype).reshape(B, H, L, -1).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, bounded_attention)


@contextmanager
def hooked(model: nn.Module, hooks: AttentionHooks) -> Iterator[AttentionHooks]:
    """Run the model's attention as `bounded_attention` with these hooks, then restore it."""
    before = model.config._attn_implementation
    token = _ACTIVE.set(hooks)
    model.set_attn_implementation(NAME)
    try:
        yield hooks
    finally:
        model.set_attn_implementation(before)
        _ACTIVE.reset(token)
