"""SnapKV-style eviction for chunked input: keep the sinks, the window and the entries the most
recent queries attend to most.

After each forward, the last `observe` queries' attention probabilities, summed over those
queries and over the query heads that share a KV head, score every kept and window entry
(average-pooled over `pool` neighbouring entries, as SnapKV pools, so a span is kept whole).
Before the next chunk, the tokens leaving the window join the kept entries and the
budget - sinks - window best scored of them stay, in time order; the rest are evicted.
Positions live inside the cache (`longkv.caches.bounded`), where SnapKV keeps its prompt's
positions: a bounded cache must not run past the positions the model was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longkv.caches.bounded import BoundedConfig, BoundedRunner
from longkv.checks import require, setting
from longkv.fold.attention import AttentionHooks


@dataclass(frozen=True)
class SnapKVConfig(BoundedConfig):
    """A bounded cache whose middle holds the best-attended tokens that left the window."""

    observe: int = setting(32, "last queries of each forward whose attention scores the entries")
    pool: int = setting(5, "width of the average pool over neighbouring scores (odd, 1 = none)")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_middle()
        require(
            isinstance(self.observe, int) and self.observe >= 1,
            self,
            "observe",
            f"must be an int >= 1, got {self.observe!r}",
        )
        require(
            isinstance(self.pool, int) and self.pool >= 1 and self.pool % 2 == 1,
            self,
            "pool",
            f"must be an odd int >= 1 (the pool is centred on each entry), got {self.pool!r}",
        )

    def describe(self) -> str:
        return (
            f"{self.sinks} sinks + {self.middle_len} best-attended (last {self.observe} "
            f"queries, pool {self.pool}) + {self.window_len} recent"
        )


def keep_best(scores: Tensor, k: int) -> Tensor:
    """Indices (B, Hkv, min(k, N)) of the k highest scores (B, Hkv, N), in ascending order
    (earlier entries first among equal scores)."""
    k = min(k, scores.shape[-1])
    best = scores.argsort(dim=-1, descending=True, stable=True)[..., :k]
    return best.sort(dim=-1).values


def pooled(scores: Tensor, width: int) -> Tensor:
    """scores (B, Hkv, N) averaged over `width` neighbours (fewer at the ends)."""
    if width == 1 or scores.shape[-1] == 0:
        return scores
    B, Hkv, N = scores.shape
    flat = F.avg_pool1d(
        scores.reshape(B * Hkv, 1, N), width, stride=1, padding=width // 2,
        count_include_pad=False,
    )  # fmt: skip
    return flat.view(B, Hkv, N)


class SnapKVRunner(BoundedRunner):
    """A bounded cache that keeps the best-attended tokens that left the window."""

    method = "SnapKV"
    KV_FIELDS = ("kept_k", "kept_v")
    config: SnapKVConfig

    def __init__(self, model: nn.Module, config: SnapKVConfig):
        super().__init__(model, config)
        layers = model.config.num_hidden_layers
        self.kept_k: list[Tensor | None] = [None] * layers  # (B, Hkv, M, D)
        self.kept_v: list[Tensor | None] = [None] * layers
        self.scores: list[Tensor] = [torch.empty(0)] * layers  # (B, Hkv, M + window)

    @property
    def middle_count(self) -> int:
        kept = self.kept_k[self.ref]
        return 0 if kept is None else kept.shape[2]

    def middle(self, layer: int) -> tuple[Tensor, Tensor]:
        k, v = self.kept_k[layer], self.kept_v[layer]
        if k is None or v is None:
            w_k, w_v = self.window_k[layer], self.window_v[layer]
            return w_k[:, :, :0], w_v[:, :, :0]
        return k, v

    def absorb(self, layer: int, keys: Tensor, values: Tensor, first: int) -> None:
        kept_k, kept_v = self.middle(layer)
        cand_k, cand_v = torch.cat([kept_k, keys], 2), torch.cat([kept_v, values], 2)
        n = cand_k.shape[2]
        scores = self.scores[layer]
        best = keep_best(scores[:, :, :n], self.config.middle_len)
        self.kept_k[layer] = cand_k.gather(2, best.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
        self.kept_v[layer] = cand_v.gather(
            2, best.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1])
        )
        self.scores[layer] = torch.cat([scores.gather(2, best), scores[:, :, n:]], dim=2)

    def hooks(self, chunk: int) -> AttentionHooks:
        return AttentionHooks(observe=min(self.config.observe, chunk))

    def observed(self, hooks: AttentionHooks) -> None:
        for i in self.bounded_layers:
            s = self.sink_k[i].shape[2]
            self.scores[i] = pooled(hooks.seen[i][:, :, s:], self.config.pool)
