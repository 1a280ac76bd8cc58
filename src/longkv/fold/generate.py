"""Greedy decoding from a cache: after a fold, the context is never run again."""

from __future__ import annotations

from torch import Tensor, nn

from longkv.decoding import decode
from longkv.fold.fold import FoldRunner, Forward, kv_fold


def greedy_decode(
    forward: Forward, logits: Tensor, max_new_tokens: int, eos_token_id: int | None = None
) -> Tensor:
    """Greedy tokens (B, n <= max_new_tokens) continuing whatever `forward` carries.

    logits: (B, V) after the last token fed; forward: ids (B, 1) -> logits (B, 1, V); eos as in
    `longkv.decoding.decode`.
    """
    return decode(
        lambda ids: forward(ids)[:, -1], logits, max_new_tokens, eos_token_id=eos_token_id
    )


def fold_generate(
    model: nn.Module,
    input_ids: Tensor,
    chunk_size: int,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    prefix_ids: Tensor | None = None,
    allow_extrapolation: bool = False,
    variant: str = "exact",
    progress: bool = False,
) -> Tensor:
    """Fold a prompt (B, T) (long context, then the question), then greedy-decode (B, n).

    variant: as for `kv_fold`; decoding runs under it too (no prefix is inserted while
    decoding, 'restart' goes on counting positions mod chunk_size)."""
    fold = kv_fold(
        model,
        input_ids,
        chunk_size,
        prefix_ids=prefix_ids,
        allow_extrapolation=allow_extrapolation,
        reserve=max_new_tokens - 1,  # the last new token is never fed back
        variant=variant,
        progress=progress,
    )
    runner = FoldRunner(
        model, fold.cache, fold.next_position, variant=variant, chunk_size=chunk_size
    )
    return greedy_decode(runner.forward, fold.last_logits, max_new_tokens, eos_token_id)
