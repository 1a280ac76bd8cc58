"""lm-evaluation-harness on longkv models and any causal LM (`longkv eval`).

`HarnessLM` is lm-eval's Hugging Face backend (`HFLM`) declared causal, with one change:
generate_until batches, which HFLM left-pads, are split into groups of prompts of equal length,
each generated unpadded, and put back in HFLM's layout. longkv models take no padding (it would
enter their states), and every model answers a batch as it answers each prompt alone.
Loglikelihood batches need no change: HFLM pads them on the right, after every token it scores,
and a causal model's logits do not see later tokens.

Needs the `lm-eval` package (`pip install 'longkv[eval]'`); this module imports it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import lm_eval
import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from torch import Tensor

import longkv.models  # noqa: F401  (registers the longkv model type with transformers)


class HarnessLM(HFLM):
    """lm-eval's HFLM for a causal LM folder or hub id, generating by groups of equal length."""

    def __init__(self, model: str, batch_size: int, max_length: int, device: str, dtype: str):
        super().__init__(
            pretrained=model, backend="causal", batch_size=batch_size, max_length=max_length,
            device=device, dtype=dtype,
        )  # fmt: skip

    def _model_generate(
        self,
        context: Tensor,
        max_length: int,
        stop: list[str],
        attention_mask: Tensor | None = None,
        **generation_kwargs: Any,
    ) -> Tensor:
        """context (B, L) left-padded (attention_mask (B, L) marks the tokens) -> (B, L + n):
        each row its padded context, then its own generated tokens, then padding. Rows of equal
        length generate together, unpadded, up to max_length - L new tokens."""
        mask = torch.ones_like(context) if attention_mask is None else attention_mask
        lengths = mask.sum(1).tolist()
        groups: dict[int, list[int]] = defaultdict(list)
        for row, n in enumerate(lengths):
            groups[n].append(row)
        new: dict[int, Tensor] = {}
        L = context.shape[1]
        for n, rows in groups.items():
            ids = context[rows, L - n :]  # left padding: the last n tokens
            out = super()._model_generate(
                context=ids, max_length=max_length - (L - n), stop=stop, **generation_kwargs
            )
            new.update(zip(rows, out[:, n:], strict=True))
        width = max(t.shape[0] for t in new.values())
        pad = self.tokenizer.pad_token_id
        pad = self.eot_token_id if pad is None else pad
        out = context.new_full((context.shape[0], L + width), pad)
        out[:, :L] = context
        for row, tokens in new.items():
            out[row, L : L + tokens.shape[0]] = tokens
        return out


def run_harness(
    model: str,
    tasks: list[str],
    *,
    include_path: str | None = None,
    batch_size: int = 1,
    max_length: int = 2048,
    limit: float | None = None,
    num_fewshot: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `tasks` (names lm-eval knows, or task files under
    include_path) on the model folder or hub id, through `HarnessLM`: its results dict
    (`results` per task; `samples` per task with log_samples)."""
    lm = HarnessLM(model, batch_size, max_length, device, dtype)
    manager = TaskManager(include_path=str(Path(include_path)) if include_path else None)
    return lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
        log_samples=log_samples,
    )  # fmt: skip
