"""Decoding one token at a time from whatever a step function carries: the loop under
`longkv.fold.continue_decode`, which KV-Fold and every bounded cache (StreamingLLM, SnapKV,
KVM-Fold) generate with; greedy by default, or sampled (`Sampler`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from longkv.checks import require

Step = Callable[[Tensor], Tensor]  # next ids (B, 1) -> logits (B, V) after them
Pick = Callable[[Tensor], Tensor]  # logits (B, V) -> the next ids (B,)


def greedy(logits: Tensor) -> Tensor:
    """The likeliest token of each row: logits (B, V) -> (B,)."""
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class Sampler:
    """Sampling from logits (B, V): scaled by 1 / temperature, kept to the top_k likeliest
    (None: all) and to the smallest set whose probability reaches top_p (1: all), then drawn
    with `generator`."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        require(self.temperature > 0, self, "temperature", f"must be > 0, got {self.temperature}")
        require(
            self.top_k is None or self.top_k >= 1, self, "top_k",
            f"must be >= 1 (or None: all), got {self.top_k}",
        )  # fmt: skip
        require(0 < self.top_p <= 1, self, "top_p", f"must lie in (0, 1], got {self.top_p}")

    def __call__(self, logits: Tensor) -> Tensor:
        """The next ids (B,), drawn from `probs`."""
        return torch.multinomial(self.probs(logits), 1, generator=self.generator)[:, 0]

    def probs(self, logits: Tensor) -> Tensor:
        """(B, V) the distribution the tokens are drawn from."""
        scores = logits.double() / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1:
            ranked, order = scores.sort(dim=-1, descending=True)
            p = ranked.softmax(-1)
            before = p.cumsum(-1) - p  # the probability of the likelier tokens
            ranked = ranked.masked_fill(before >= self.top_p, float("-inf"))  # keeps the first
            scores = scores.scatter(-1, order, ranked)
        return scores.softmax(dim=-1)


def decode(
    step: Step,
    logits: Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    pick: Pick = greedy,
    on_token: Callable[[Tensor], object] | None = None,
) -> Tensor:
    """New tokens (B, n <= max_new_tokens) continuing whatever `step` carries, each chosen by
    `pick` (greedy, or a `Sampler`); on_token sees each step's tokens (B,) as they come, and
    decoding stops after a step whose on_token returned True.

    logits: (B, V) after the last token fed. A row that emitted eos_token_id keeps emitting it;
    decoding stops when every row has. The last new token is never fed to `step`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    tokens = []
    with torch.inference_mode():
        for i in range(max_new_tokens):
            nxt = pick(logits)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            tokens.append(nxt)
            stop = on_token is not None and on_token(nxt) is True
            if stop or i + 1 == max_new_tokens or bool(done.all()):
                break
            logits = step(nxt[:, None])
    return torch.stack(tokens, dim=1)
