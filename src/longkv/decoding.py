"""Greedy decoding one token at a time from whatever a step function carries: the loop under
`longkv.fold.greedy_decode`, which KV-Fold and every bounded cache (StreamingLLM, SnapKV,
KVM-Fold) generate with."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Step = Callable[[Tensor], Tensor]  # next ids (B, 1) -> logits (B, V) after them


def decode(
    step: Step,
    logits: Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
) -> Tensor:
    """Greedy new tokens (B, n <= max_new_tokens) continuing whatever `step` carries.

    logits: (B, V) after the last token fed. A row that emitted eos_token_id keeps emitting it;
    decoding stops when every row has. The last new token is never fed to `step`.
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
            logits = step(nxt[:, None])
    return torch.stack(tokens, dim=1)
