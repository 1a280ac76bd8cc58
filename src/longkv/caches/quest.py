"""Quest (Tang et al. 2024, arXiv 2406.10774): pages of contiguous tokens, each summarised by
the per-channel minimum and maximum of its keys; a query scores a page by the upper bound of
its logit over the page, sum over channels of max(q_c * max_c, q_c * min_c), and attends the
tokens of its best pages.

In longkv Quest is a retrieval cache (`longkv.caches.retrieval`): its units are pages of `page`
tokens among those that left the window (aligned from the first of them; the newest page may
be partial, its bounds over the tokens it has), with the same sinks and exact window as
two-level KVM-Fold, keys at the positions the model gave them (Quest keeps the model's RoPE; or
with `positions="inside"`, un-rotated and met at one distance, `longkv.caches.retrieval`) and
no read-out of a closed page. Each query head opens its `open` best pages (`routed.top_units`)
when decoding, as Quest does; the queries of a prefill chunk open pages together within
`leaf_budget` leaves (`routed.block_units`, as two-level's slots) where Quest's reference
prefills with full attention, so that the two are compared at the same entries attended;
`routing="token"` opens per query head and query in prefill too. The first `dense_layers`
layers open every page (Quest: 2).
Departures from the reference (mit-han-lab/Quest, `evaluation/quest_attention.py`): sinks and
a window beside the pages (Quest has neither; its newest page is scored like the others), and no
floor of 3 pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from longkv.attention.state import tensor_bytes
from longkv.caches.bounded import BoundedConfig
from longkv.caches.retrieval import RetrievalRunner
from longkv.caches.routed import (
    POSITIONS,
    ROUTINGS,
    Part,
    attended_entries,
    block_units,
    bound_scores,
    grouped,
    routed_attention,
    top_units,
    widen_bounds,
)
from longkv.checks import require, require_at_least, setting
from longkv.fold.attention import Attend


@dataclass(frozen=True)
class QuestConfig(BoundedConfig):
    """Sinks, an exact window and pages of the tokens that left it, opened by their key bounds."""

    page: int = setting(16, "tokens per page (Quest: 16)")
    open: int = setting(64, "pages each query head opens (64 pages of 16: 1024 tokens)")
    routing: str = setting(
        "block",
        "who opens pages in a prefill chunk: block (its queries together, those they give the "
        "largest shares of attention, within leaf_budget) or token (each query head and query "
        "its own `open` best); a decoded token's query heads open their own either way",
        choices=ROUTINGS,
    )
    leaf_budget: int | None = setting(
        1024,
        "block routing: the most leaves per KV head a prefill chunk's queries open together "
        "(None: every page)",
    )
    dense_layers: int = setting(2, "the first layers, which open every page (Quest: 2)")
    positions: str = setting(
        "exact",
        "where the pages' tokens, sinks and window are placed: exact (each at the position the "
        "model gave it; refused past the model's positions) or inside (the pages' tokens "
        "un-rotated and met at one distance, window - 1; the sinks and window at their cache "
        "index: no distance past the budget, at any length)",
        choices=POSITIONS,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(1, self, "page", "open")
        require_at_least(0, self, "dense_layers")
        require(self.routing in ROUTINGS, self, "routing", f"must be one of {ROUTINGS}")
        require(self.positions in POSITIONS, self, "positions", f"must be one of {POSITIONS}")
        if self.leaf_budget is not None:
            require_at_least(1, self, "leaf_budget")

    def describe(self) -> str:
        routing = (
            f"a prefill chunk's queries together within {self.leaf_budget} leaves"
            if self.routing == "block" and self.leaf_budget is not None
            else self.routing
        )
        return (
            f"{self.sinks} sinks + {self.window_len} recent + pages of {self.page} tokens, "
            f"{self.open} opened per query head ({routing}; the first {self.dense_layers} "
            "layers open all)"
            + (
                f"; pages met at distance {self.window_len - 1}"
                if self.positions == "inside"
                else ""
            )
        )


class QuestRunner(RetrievalRunner):
    """Quest's pages over the tokens that left the window, per layer their keys' bounds."""

    method = "Quest"
    KV_FIELDS = ("bounds",)
    config: QuestConfig

    def __init__(self, model: nn.Module, config: QuestConfig):
        super().__init__(model, config)
        # per layer: the pages' per-channel max and min keys (B, Hkv, P, D)
        self.bounds: list[tuple[Tensor, Tensor] | None] = [None] * model.config.num_hidden_layers

    def absorb(self, layer: int, keys: Tensor, values: Tensor, first: int) -> None:
        """The tokens (keys as the runner holds them: as the model rotated them, or un-rotated
        with positions inside) join the newest page, then new ones."""
        B, Hkv, m, _ = keys.shape
        store = self.leaves[layer]
        n = 0 if store is None else len(store)
        page = torch.arange(n, n + m, device=keys.device) // self.config.page
        unit = page.expand(B, Hkv, m)
        self.keep_leaves(layer, keys, values, unit)
        self.bounds[layer] = widen_bounds(self.bounds[layer], keys, unit, int(page[-1]) + 1)

    def page_counts(self, layer: int) -> Tensor:
        """(B, Hkv, P): the tokens of each page (the newest may have fewer)."""
        store, bounds = self.leaves[layer], self.bounds[layer]
        assert store is not None and bounds is not None
        B, Hkv, P, _ = bounds[0].shape
        start = torch.arange(P, device=bounds[0].device) * self.config.page
        count = (len(store) - start).clamp_max(self.config.page)
        return count.to(bounds[0].dtype).expand(B, Hkv, P)

    def attend(self, layer: int) -> Attend:
        """This layer's attention (`routed_attention`, no read-outs): the queries score the
        pages by their bounds (`bound_scores`) and open their best (per block in a prefill chunk
        by `config.routing`, per query head otherwise), or every page in a dense layer."""
        store, bounds, config = self.leaves[layer], self.bounds[layer], self.config
        assert store is not None and bounds is not None
        count = self.page_counts(layer)
        sinks, _, recent = self.parts(layer)

        def attend(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
            L, Hkv = q.shape[2], keys.shape[1]
            G = q.shape[1] // Hkv
            high = torch.promote_types(q.dtype, torch.float32)
            key_max, key_min = bounds[0].to(high), bounds[1].to(high)
            q_mem = self.memory_query(layer, q).to(high) if self.inside else None
            rows = grouped(q.to(high) if q_mem is None else q_mem, Hkv)
            rank = bound_scores(rows, key_max, key_min, scale)
            if layer < config.dense_layers:
                opened = torch.ones_like(rank[:, :, :1], dtype=torch.bool)
            elif L > 1 and config.routing == "block":
                opened = block_units(rank, count.to(high), config.leaf_budget)
            else:
                opened = top_units(rank, config.open)
            self.remember(layer, rank, opened, G, L)
            window = recent.keys.shape[2]
            self.tally(attended_entries(opened, count, sinks.keys.shape[2], window, L, False))
            got = store.gather(opened.any(2), high)
            chunk = Part(keys, values)
            return routed_attention(q, sinks, None, recent, chunk, None, opened, got, scale, q_mem)

        return attend

    def middle_bytes(self) -> int:
        """The pages' key bounds."""
        return tensor_bytes(*(t for bounds in self.bounds if bounds for t in bounds))
