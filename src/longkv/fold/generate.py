"""Decoding from a cache (greedy, or sampled): after a fold, the context is never run again."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from transformers.cache_utils import Cache

from longkv.decoding import Pick, decode, greedy
from longkv.fold.fold import FoldRunner, Forward, kv_fold


def continue_decode(
    forward: Forward,
    logits: Tensor,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    *,
    pick: Pick = greedy,
    on_token: Callable[[Tensor], object] | None = None,
) -> Tensor:
    """Tokens (B, n <= max_new_tokens) continuing whatever `forward` carries, greedy unless
    `pick` samples; on_token sees each step's tokens (B,) as they come (True: stop after them).

    logits: (B, V) after the last token fed; forward: ids (B, 1) -> logits (B, 1, V); eos as in
    `longkv.decoding.decode`.
    """
    return decode(
        lambda ids: forward(ids)[:, -1], logits, max_new_tokens, eos_token_id=eos_token_id,
        pick=pick, on_token=on_token,
    )  # fmt: skip


def fold_generate(
    model: nn.Module,
    input_ids: Tensor,
    chunk_size: int,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    prefix_ids: Tensor | None = None,
    cache: Cache | None = None,
    allow_extrapolation: bool = False,
    variant: str = "exact",
    progress: bool = False,
    pick: Pick = greedy,
    on_token: Callable[[Tensor], object] | None = None,
) -> Tensor:
    """Fold a prompt (B, T) (long context, then the question), then decode (B, n), greedy
    unless `pick` samples (`continue_decode`).

    variant: as for `kv_fold`; decoding runs under it too (no prefix is inserted while
    decoding, 'restart' goes on counting positions mod chunk_size); cache: continue an earlier
    fold, as for `kv_fold`."""
    fold = kv_fold(
        model,
        input_ids,
        chunk_size,
        prefix_ids=prefix_ids,
        cache=cache,
        allow_extrapolation=allow_extrapolation,
        score=False,
        reserve=max_new_tokens - 1,  # the last new token is never fed back
        variant=variant,
        progress=progress,
    )
    runner = FoldRunner(
        model, fold.cache, fold.next_position, variant=variant, chunk_size=chunk_size
    )
    return continue_decode(
        runner.forward, fold.last_logits, max_new_tokens, eos_token_id, pick=pick, on_token=on_token
    )
