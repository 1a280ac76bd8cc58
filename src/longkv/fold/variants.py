"""Fold variants: plausible ways an implementation of KV-Fold departs from the exact fold, one
change each, to find where a fold's drift against full attention comes from (docs/kvfold.md,
"Fold variants"). The exact fold stays the default everywhere; a variant is asked for by name.
"""

from __future__ import annotations

import torch
from torch import nn

from longkv.checks import require, require_known
from longkv.fold import compat
from longkv.fold.attention import AttentionHooks

VARIANTS = {
    "exact": "the fold of the spec: one full causal forward computed in pieces",
    "bos": "the model's BOS token re-inserted before every chunk: it enters the cache and takes "
    "a position, so the model reads [BOS, chunk 0, BOS, chunk 1, ...]",
    "restart": "positions restart at 0 in every chunk: token i takes position i mod chunk_size, "
    "so RoPE rotates every chunk as if it were the first",
    "top-left": "the causal mask aligned to the first key when a chunk's queries are fewer than "
    "the keys (scaled_dot_product_attention(is_causal=True) with a cache): query i of a chunk "
    "sees the first i + 1 keys of the cache",
    "bf16-cache": "keys and values stored in bfloat16 while the model computes in its own, "
    "wider dtype: every read of the cache sees them rounded",
    "chunk-excluded": "a chunk's keys join the cache only when the chunk ends: each query sees "
    "the earlier chunks and its own key, not the tokens before it in its chunk",
    "float32-softmax": "the fold's attention computed as an explicit softmax in at least float32 "
    "instead of the model's own kernel (the full forward keeps the model's)",
}
VARIANT_HELP = "how the fold departs from the exact fold: " + "; ".join(
    f"{name}: {what}" for name, what in VARIANTS.items()
)


def require_variants(owner: object, name: str, *variants: str) -> None:
    """Refuse setting `name` of owner unless every one of variants is a variant."""
    require_known(owner, name, variants, list(VARIANTS))


def inserted_positions(variant: str, tokens: int, chunk_size: int) -> int:
    """Positions a variant adds to a fold of `tokens` tokens: one BOS per chunk for 'bos'."""
    return -(-tokens // chunk_size) if variant == "bos" else 0


def check_variant(variant: str, model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Refuse the argument `variant` if it cannot run, or would change nothing, on this model
    computing in dtype (default: its parameters' dtype)."""
    require(variant in VARIANTS, None, "variant", f"{variant!r} is not one of {list(VARIANTS)}")
    require(
        variant != "bos" or getattr(model.config, "bos_token_id", None) is not None,
        None, "variant", "'bos' needs the model's config.bos_token_id, which is None",
    )  # fmt: skip
    require(
        variant_hooks(variant) is None or compat.host(model).keeps_kv,
        None, "variant",
        f"{variant!r} changes transformers' attention, which {type(model).__name__} does not "
        "run (its cache holds KVM states)",
    )  # fmt: skip
    dtype = next(model.parameters()).dtype if dtype is None else dtype
    require(
        variant != "bf16-cache" or dtype.itemsize > torch.bfloat16.itemsize,
        None, "variant",
        "bf16-cache stores a wider model's cache in bfloat16; this model computes in "
        f"{str(dtype).removeprefix('torch.')} already, so nothing would change",
    )  # fmt: skip


def variant_hooks(variant: str) -> AttentionHooks | None:
    """The attention a variant runs (`longkv.fold.attention.hooked`), None for the model's own."""
    if variant == "top-left":
        return AttentionHooks(mask="top-left")
    if variant == "chunk-excluded":
        return AttentionHooks(mask="past-and-self")
    if variant == "bf16-cache":
        return AttentionHooks(store_dtype=torch.bfloat16)
    if variant == "float32-softmax":
        return AttentionHooks()
    return None
