"""What a bounded cache needs to know of a frozen model, and which models it can run on: the
sliding window of each layer (`layer_windows`), the RoPE table of each layer's type
(`rope_tables`), and the refusals of a model or budget a bounded cache cannot run
(`check_bounded`, `check_budget`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longkv.checks import refuse, require
from longkv.fold import compat

STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


def check_budget(model: nn.Module, budget: int) -> None:
    """Refuse the argument `budget` unless a cache of budget entries fits the model's positions.

    A bounded cache places its entries and the chunk it reads at positions 0 .. budget - 1,
    never past them, so this is the only position limit it has (it never extrapolates).
    """
    limit = getattr(model.config, "max_position_embeddings", None)
    require(
        limit is None or budget <= limit, None, "budget",
        f"a budget of {budget} cache positions exceeds the model's max_position_embeddings = "
        f"{limit}; use a smaller budget",
    )  # fmt: skip


def layer_windows(model: nn.Module) -> list[int | None]:
    """Per decoder layer, the sliding window its attention keeps (None: it attends every
    token): the layer's own `sliding_window` (Gemma 3, Qwen2), else its layer type's, else the
    config's for every layer (Mistral)."""
    config = model.config
    layers = getattr(getattr(model, "model", None), "layers", None) or ()
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    out: list[int | None] = []
    for i in range(config.num_hidden_layers):
        attn = getattr(layers[i], "self_attn", None) if i < len(layers) else None
        if hasattr(attn, "sliding_window"):
            out.append(attn.sliding_window)
        else:  # the layer type's window; with no types, every layer's (Mistral)
            out.append(window if types is None or types[i] == "sliding_attention" else None)
    return out


def rope_tables(model: nn.Module) -> list[Tensor] | str:
    """Per decoder layer, the RoPE inv_freq (D / 2,) float64 of its layer type (Gemma 3 keeps
    one table per type, `sliding_attention_inv_freq`, `full_attention_inv_freq`), or why a
    cached key of this model cannot be rotated to a new position."""
    config = model.config
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    params = getattr(config, "rope_parameters", None)
    if rotary is None or params is None:
        return "its positions are learned embeddings, not rotary ones, so they cannot be moved"
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    tables: list[Tensor] = []
    for kind in types:
        per_type = params.get(kind) if isinstance(params.get(kind), dict) else None
        rope_type = (per_type or params).get("rope_type", "default")
        if rope_type not in STATIC_ROPE:
            return (
                f"its RoPE ({kind} layers: rope_type {rope_type!r}) changes with the input's "
                f"length, so a cached key cannot be re-rotated (static RoPE types: "
                f"{sorted(STATIC_ROPE)})"
            )
        inv_freq = getattr(rotary, f"{kind}_inv_freq", None) if per_type else rotary.inv_freq
        if not isinstance(inv_freq, Tensor):
            return f"its rotary embedding has no inv_freq table for its {kind} layers"
        tables.append(inv_freq.detach().to(torch.float64))
    return tables


def check_bounded(model: nn.Module, budget: int, method: str) -> list[Tensor]:
    """Refuse the argument `model` (or `budget`) unless a cache of `budget` entries with
    positions inside it (the `method`) can run on the model; return its RoPE inv_freq per
    layer (`rope_tables`). Sliding-window layers keep their own window; the method bounds the
    other layers."""
    if not compat.host(model).keeps_kv:
        refuse(
            None, "model",
            f"{method} evicts and re-rotates per-layer cached keys and values, but "
            f"{type(model).__name__} carries KVM states and window caches instead; run it with "
            "KV-Fold (its own chunked prefill) or full attention",
        )  # fmt: skip
    name = type(model).__name__
    tables = rope_tables(model)
    if isinstance(tables, str):
        refuse(None, "model", f"{method} moves cached keys to new positions, but {name}: {tables}")
    if getattr(model.config, "attn_logit_softcapping", None):
        refuse(
            None, "model",
            f"{method} runs longkv's attention, which does not soft-cap attention logits as "
            f"{name} does (attn_logit_softcapping); read it with the fold or full attention",
        )  # fmt: skip
    windows = layer_windows(model)
    if all(w is not None for w in windows):
        refuse(
            None, "model",
            f"{method} has no layer of {name} to bound: every layer attends a sliding window "
            f"({sorted(set(windows))} tokens), so its cache is bounded already; read it with "
            "the fold",
        )  # fmt: skip
    check_budget(model, budget)
    return tables
