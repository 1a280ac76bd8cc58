"""Greedy decoding from a cache: after a fold, the context is never run again."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longkv.fold.fold import FoldRunner, Forward, kv_fold


def greedy_decode(
    forward: Forward, logits: Tensor, max_new_tokens: int, eos_token_id: int | None = None
) -> Tensor:
    """Greedy tokens (B, n <= max_new_tokens) continuing whatever `forward` carries.

    logits: (B, V) after the last token fed; forward: ids (B, 1) -> logits (B, 1, V). A row that
    emitted eos_token_id keeps emitting it; decoding stops when every row has.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    tokens = []
    with torch.inference_mode():
        for i in range(max_new_tokens):
            nxt = logits.argmax(dim=-1)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            tokens.append(nxt)
            if i + 1 == max_new_tokens or bool(done.all()):
                break
            logits = forward(nxt[:, None])[:, -1]
    return torch.stack(tokens, dim=1)


def fold_generate(
    model: nn.Module,
    input_ids: Tensor,
    chunk_size: int,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    prefix_ids: Tensor | None = None,
    allow_extrapolation: bool = False,
    progress: bool = False,
) -> Tensor:
    """Fold a prompt (B, T) (long context, then the question), then greedy-decode (B, n)."""
    fold = kv_fold(
        model,
        input_ids,
        chunk_size,
        prefix_ids=prefix_ids,
        measure_memory=False,
        allow_extrapolation=allow_extrapolation,
        reserve=max_new_tokens - 1,  # the last new token is never fed back
        progress=progress,
    )
    runner = FoldRunner(model, fold.cache, fold.next_position)
    return greedy_decode(runner.forward, fold.last_logits, max_new_tokens, eos_token_id)
