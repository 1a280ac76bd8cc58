"""StreamingLLM (Xiao et al.): attention sinks plus a recent window, bounded memory.

Spec kvfold.md section 5: a bounded cache (`longkv.caches.bounded`) with nothing in the middle.
It keeps the first `sinks` entries and the most recent ones, at most `sinks + window` entries
per layer, with positions inside the cache: a token's query sits at its cache index, and cached
keys are rotated at their cache index.

Modes: `chunk_size=1` is the original, one token per forward. A larger chunk evicts once per
chunk, before it, so that cache + chunk fits in sinks + window: the chunk's first token then sees
sinks + window - chunk_size + 1 entries (itself included) and its last sees sinks + window, where
token-by-token every token sees sinks + window. The functions read in chunks of STREAM_CHUNK
tokens (at most the window) unless told otherwise: token by token is the paper's reference and
slow (see `longkv.caches.bounded.STREAM_CHUNK`).
"""

from __future__ import annotations

from torch import Tensor, nn

from longkv.caches.bounded import BoundedConfig, BoundedRunner, bounded_fold, bounded_generate
from longkv.fold.fold import FoldResult


class StreamingRunner(BoundedRunner):
    """A cache of at most sinks + window entries, with positions inside it: a bounded cache
    with a budget of sinks + window and nothing in the middle."""

    method = "StreamingLLM"

    def __init__(self, model: nn.Module, sinks: int = 4, window: int = 1020):
        super().__init__(model, BoundedConfig(budget=sinks + window, sinks=sinks, window=window))

    def absorb(self, layer: int, keys: Tensor, values: Tensor, first: int) -> None:
        """Tokens that leave the window are evicted."""

    @property
    def tokens(self) -> list[int]:
        """The input index of the token behind each entry."""
        sinks = self.sink_k[0].shape[2] if self.seen else 0
        return [*range(sinks), *range(self.seen - self.window_count, self.seen)]


def stream(
    runner: StreamingRunner,
    input_ids: Tensor,
    chunk_size: int | None = None,
    *,
    return_logits: bool = False,
    progress: bool = False,
) -> FoldResult:
    """Feed input_ids (B, T) through the runner chunk by chunk (None: STREAM_CHUNK tokens, at most
    the window; 1: token by token, the paper's reference); nll and logits as for `kv_fold`."""
    return bounded_fold(
        runner, input_ids, chunk_size, return_logits=return_logits, progress=progress
    )


def streaming_llm(
    model: nn.Module,
    input_ids: Tensor,
    *,
    sinks: int = 4,
    window: int = 1020,
    chunk_size: int | None = None,
    return_logits: bool = False,
    progress: bool = False,
) -> FoldResult:
    """Run input_ids (B, T) through StreamingLLM from an empty cache, in chunks of chunk_size
    (None: STREAM_CHUNK tokens, at most the window; 1: token by token, the paper's
    reference)."""
    runner = StreamingRunner(model, sinks, window)
    return stream(runner, input_ids, chunk_size, return_logits=return_logits, progress=progress)


def streaming_generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    sinks: int = 4,
    window: int = 1020,
    chunk_size: int | None = None,
    eos_token_id: int | None = None,
    progress: bool = False,
) -> Tensor:
    """Stream a prompt (B, T) in chunks of chunk_size (as `streaming_llm`), then greedy-decode
    (B, n), evicting as the cache fills."""
    runner = StreamingRunner(model, sinks, window)
    return bounded_generate(
        runner, input_ids, chunk_size, max_new_tokens,
        eos_token_id=eos_token_id, progress=progress,
    )  # fmt: skip
