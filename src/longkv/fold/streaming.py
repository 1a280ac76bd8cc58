"""StreamingLLM (Xiao et al.): attention sinks plus a recent window, bounded memory.

Spec kvfold.md section 5. The cache keeps the first `sinks` entries and the most recent ones,
at most `sinks + window` entries per layer. Positions live inside the cache: a token's query
sits at its cache index, and cached keys are rotated at their cache index. Keys are stored
rotated (as transformers stores them); when entries are evicted the ones behind them move
forward by the number evicted, and their keys are rotated back by that shift (in float64), which
equals rotating un-rotated keys at their new index.

Modes: `chunk_size=1` is the original, one token per forward. A larger chunk evicts once per
chunk, before it, so that cache + chunk fits in sinks + window: the chunk's first token then sees
sinks + window - chunk_size + 1 entries (itself included) and its last sees sinks + window, where
token-by-token every token sees sinks + window.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from longkv.attention.rope import rotate
from longkv.fold import compat
from longkv.fold.fold import FoldResult, check_input, score_chunks
from longkv.fold.generate import greedy_decode

STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


def window_refusal(model: nn.Module, sinks: int, window: int) -> str | None:
    """Why a cache of sinks + window entries does not fit the model's positions, or None.

    StreamingLLM places its entries at positions 0 .. sinks + window - 1, never past them, so
    this is the only position limit it has (it never extrapolates).
    """
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None or sinks + window <= limit:
        return None
    return (
        f"sinks + window = {sinks + window} cache positions exceed the model's "
        f"max_position_embeddings = {limit}"
    )


def check_streamable(model: nn.Module, sinks: int, window: int) -> Tensor:
    """Raise ValueError unless StreamingLLM can run on the model; return its RoPE inv_freq."""
    if not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks: must be an int >= 0, got {sinks!r}")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window: must be an int >= 1, got {window!r}")
    if not compat.keeps_keys_and_values(model):
        raise ValueError(
            f"model: StreamingLLM evicts and re-rotates per-layer cached keys and values, but "
            f"{type(model).__name__} carries KVM states and window caches instead; run it with "
            "KV-Fold (its own chunked prefill) or full attention"
        )
    config = model.config
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if inv_freq is None or rope_type not in STATIC_ROPE:
        raise ValueError(
            f"model: StreamingLLM re-rotates cached keys, which needs one static RoPE "
            f"(model.model.rotary_emb.inv_freq, rope_type in {sorted(STATIC_ROPE)}); "
            f"{type(model).__name__} has rope_type {rope_type!r} and "
            f"{'no' if inv_freq is None else 'an'} inv_freq (learned positions cannot be moved)"
        )
    refusal = window_refusal(model, sinks, window)
    if refusal is not None:
        raise ValueError(f"window: {refusal}; use a smaller window")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    sliding = getattr(config, "sliding_window", None)
    if layer_types != {"full_attention"} or (sliding is not None and sinks + window > sliding):
        raise ValueError(
            f"model: has sliding-window layers ({sorted(layer_types)}, sliding_window={sliding}) "
            f"that would cut the sinks + window = {sinks + window} cache; use a model with full "
            "attention layers or a window inside the sliding window"
        )
    return inv_freq.detach().to(torch.float64)


class StreamingRunner:
    """A cache of at most sinks + window entries, with positions inside it."""

    def __init__(self, model: nn.Module, sinks: int = 4, window: int = 1020):
        self.inv_freq = check_streamable(model, sinks, window)
        self.model, self.sinks, self.window = model, sinks, window
        self.cache = DynamicCache()
        self.tokens: list[int] = []  # the input index of the token behind each cache entry

    @property
    def position(self) -> int:
        """Entries per layer now, which is also the position the next token takes."""
        return self.cache.get_seq_length()

    def make_room(self, n: int) -> None:
        """Evict the oldest non-sink entries so that n more fit in sinks + window."""
        if n > self.window:
            raise ValueError(f"chunk of {n} tokens does not fit a window of {self.window}")
        excess = self.position + n - (self.sinks + self.window)
        if excess <= 0:
            return
        angles = -excess * self.inv_freq.to(self.cache.layers[0].keys.device)
        angles = torch.cat([angles, angles])
        cos, sin = angles.cos(), angles.sin()
        s = self.sinks
        del self.tokens[s : s + excess]
        for layer in self.cache.layers:
            moved = rotate(layer.keys[:, :, s + excess :].double(), cos, sin)
            layer.keys = torch.cat([layer.keys[:, :, :s], moved.to(layer.keys.dtype)], dim=2)
            layer.values = torch.cat([layer.values[:, :, :s], layer.values[:, :, s + excess :]], 2)

    def forward(self, ids: Tensor) -> Tensor:
        """Logits (B, L, V) of ids (B, L) at cache positions, after making room for them."""
        B, L = ids.shape
        self.make_room(L)
        pos = torch.arange(self.position, self.position + L, device=ids.device).expand(B, L)
        seen = self.tokens[-1] + 1 if self.tokens else 0
        self.tokens += range(seen, seen + L)
        return compat.forward(self.model, ids, pos, self.cache)


def stream(
    runner: StreamingRunner,
    input_ids: Tensor,
    chunk_size: int = 1,
    *,
    return_logits: bool = False,
    progress: bool = False,
) -> FoldResult:
    """Feed input_ids (B, T) through the runner chunk by chunk; nll and logits as for `kv_fold`."""
    check_input(input_ids, chunk_size)
    if chunk_size > runner.window:
        raise ValueError(f"chunk_size: {chunk_size} exceeds the window {runner.window}")
    return score_chunks(
        runner, input_ids, chunk_size,
        return_logits=return_logits, progress=progress, desc="streaming",
    )  # fmt: skip


def streaming_llm(
    model: nn.Module,
    input_ids: Tensor,
    *,
    sinks: int = 4,
    window: int = 1020,
    chunk_size: int = 1,
    return_logits: bool = False,
    progress: bool = False,
) -> FoldResult:
    """Run input_ids (B, T) through StreamingLLM from an empty cache."""
    runner = StreamingRunner(model, sinks, window)
    return stream(runner, input_ids, chunk_size, return_logits=return_logits, progress=progress)


def streaming_generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    sinks: int = 4,
    window: int = 1020,
    chunk_size: int = 1,
    eos_token_id: int | None = None,
    progress: bool = False,
) -> Tensor:
    """Stream a prompt (B, T), then greedy-decode (B, n), evicting as the cache fills."""
    runner = StreamingRunner(model, sinks, window)
    run = stream(runner, input_ids, chunk_size, progress=progress)
    return greedy_decode(runner.forward, run.last_logits, max_new_tokens, eos_token_id)
