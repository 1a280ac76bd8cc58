"""Retrieval caches of a frozen model: every token kept exact, at the position the model gave
it, and each query attending the sinks, the window and the tokens of the units it opens.

`RetrievalRunner` is the cache the retrieval methods share (two-level KVM-Fold,
`caches.two_level`; Quest, `caches.quest`; InfLLM, `caches.infllm`). It keeps a bounded part
[sinks | middle | window] per layer (the middle: two-level's slot read-outs, empty for the
others), the model's cache until tokens leave the window; the tokens that left it are leaves
of a `LeafStore` per layer, each owned by one unit (a slot, a page, a block). From then on (for
InfLLM from the first chunk, `routes`) each layer's attention is the method's (`attend`,
through `longkv.caches.routed`), which reads the bounded part from the runner (`parts`) while
the model's cache holds the chunk alone, so a decoded token copies the bounded part once per
layer rather than into the model's cache and again into its attention. Unlike the bounded
caches, which re-rotate their entries into positions inside the budget, it keeps the sinks'
and window's keys as the model rotated them (`keep_chunk`), so `build_cache` rotates nothing
and opening every unit is the exact fold; a method that keeps its leaves un-rotated (InfLLM)
undoes the rotation in `absorb`.

Positions (`routed.POSITIONS`, the config's `positions`): exact, as above, refused past the
model's positions; or inside, InfLLM's placement, for inputs past them: the leaves and
read-outs are kept un-rotated and every query meets them rotated on to `window - 1`
(`memory_query`), so each sits at that one distance; the sinks and window are kept un-rotated
and rotated at their cache index (sinks 0, 1, ..., then the window), the chunk's queries taking
the next indices, as the bounded caches place them. No distance a query sees exceeds the
budget, whatever the input's length.

When the window is full, its oldest tokens leave it an eighth of the window at a time (or as
many as a chunk needs, when more): a decoded token then changes no memory until they go, and
its window holds between seven eighths of `window` and `window` tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from longkv.attention.rope import angles_at, rotate
from longkv.caches.bounded import BoundedConfig, BoundedRunner
from longkv.caches.leaves import LeafStore, make_leaves
from longkv.caches.routed import Part, query_units
from longkv.fold.attention import Attend, AttentionHooks
from longkv.fold.fold import check_positions


def places_inside(config: BoundedConfig) -> bool:
    """Whether a retrieval config places its tokens inside the budget (`positions` inside)."""
    return getattr(config, "positions", "exact") == "inside"


def check_exact_positions(config: Any, tokens: int, what: str) -> None:
    """Refuse unless the model of `config` (its `PretrainedConfig`) has positions for `tokens`
    (`what` takes them): a retrieval cache keeps every token at its own position and never
    runs past the model's; the refusal points to the caches that place positions inside their
    budget."""
    check_positions(
        config, tokens, what,
        switch="place its positions inside the budget (--positions inside, positions='inside'), "
        "or read it with a cache that places them so (streaming, snapkv, kvm-fold without "
        "--kvm-open / open=0)",
    )  # fmt: skip


class RetrievalRunner(BoundedRunner):
    """A bounded part [sinks | middle | window] in the model's cache, the leaves in a store per
    layer, each layer's attention the method's (`attend`); subclasses say whose leaves the
    tokens leaving the window become (`absorb`, through `keep_leaves`) and how a layer's queries
    open units (`attend`, which records `last_scores` and `last_opened`)."""

    def __init__(self, model: nn.Module, config: BoundedConfig, **kwargs: bool):
        super().__init__(model, config, **kwargs)
        self.inside = places_inside(config)
        # decoding moves the window's oldest tokens to the memory an eighth of it at a time, so
        # that a decoded token updates no memory (and, for two-level, no state) until they go
        self.leave_at_once = max(1, config.window_len // 8)
        layers = model.config.num_hidden_layers
        self.leaves: list[LeafStore | None] = [None] * layers
        # per layer, of the last query of its last forward: its unit scores (B, H, U) and the
        # units it opened (B, H, U)
        self.last_scores: list[Tensor | None] = [None] * layers
        self.last_opened: list[Tensor | None] = [None] * layers

    @property
    def position(self) -> int:
        """The next token's position: the exact fold's, or inside, its cache index after the
        sinks and the window."""
        if not self.inside:
            return self.seen
        return self.sink_k[self.ref].shape[2] + self.window_count if self.seen else 0

    def unrotated(self, layer: int, keys: Tensor, first: int) -> Tensor:
        """A layer's keys (B, Hkv, m, D) at positions first, first + 1, ... with their rotation
        undone."""
        return self.rotated(layer, keys, first, -1)

    def plain_keys(self, layer: int, keys: Tensor, first: int) -> Tensor:
        """Un-rotated, the keys (B, Hkv, m, D) of the window tokens first, first + 1, ... as
        the runner holds them: rotated at their positions (exact) or not (inside)."""
        return keys if self.inside else self.unrotated(layer, keys, first)

    def memory_query(self, layer: int, q: Tensor) -> Tensor:
        """The forward's queries q (B, H, L, D), rotated by the model at the next L positions,
        rotated on to window - 1, in float64: each meets an un-rotated key at distance
        window - 1 (InfLLM's placement of its memory)."""
        ahead = torch.arange(self.position, self.position + q.shape[2], device=q.device)
        cos, sin = angles_at(self.config.window_len - 1 - ahead, self.inv_freqs[layer])
        return rotate(q.double(), cos, sin)

    def keep_leaves(self, layer: int, keys: Tensor, values: Tensor, owner: Tensor) -> LeafStore:
        """Append keys (B, Hkv, m, D), values owned by units owner (B, Hkv, m) to the layer's
        store (made on first use, of the config's `leaves` kind); returns it."""
        store = self.leaves[layer]
        if store is None:
            config = self.config
            kind, folder = getattr(config, "leaves", "exact"), getattr(config, "leaf_dir", None)
            store = self.leaves[layer] = make_leaves(kind, keys, values, folder)
        store.append(keys, values, owner)
        return store

    def attend(self, layer: int) -> Attend:
        """This layer's attention for the next forward's queries, given the chunk's keys and
        values (the model's cache holds nothing else, `build_cache`)."""
        raise NotImplementedError

    def remember(self, layer: int, rank: Tensor, opened: Tensor, G: int, L: int) -> None:
        """Keep what this layer's forward of L queries scored and opened, rank (B, Hkv, R, U)
        and opened (B, Hkv, R, U) bool with R = G * L or 1 (`routed.query_units`): the last
        query's per query head (`last_scores`, `last_opened`), and the units a watched token's
        query opened (`watched`)."""
        self.last_scores[layer] = query_units(rank, G, L)
        self.last_opened[layer] = query_units(opened, G, L)
        store = self.leaves[layer]
        for token in self.watch & set(range(self.seen, self.seen + L)):
            seen = self.watched[token]
            seen.opened[layer] = query_units(opened, G, L, token - self.seen)
            seen.leaves[layer] = 0 if store is None else len(store)

    def routes(self) -> bool:
        """Whether the next forward runs the method's attention (`attend`): once tokens have left
        the window."""
        return self.leaves[self.ref] is not None

    def parts(self, layer: int) -> tuple[Part, Part, Part]:
        """The layer's bounded part: sinks, middle and window, keys (B, Hkv, n, D) as placed
        (`placed`; the middle's: as the method keeps them)."""
        sink_k, window_k = self.placed(layer, self.sink_k[layer], self.window_k[layer])
        return (
            Part(sink_k, self.sink_v[layer]), Part(*self.middle(layer)),
            Part(window_k, self.window_v[layer]),
        )  # fmt: skip

    def placed(self, layer: int, sink_k: Tensor, window_k: Tensor) -> tuple[Tensor, Tensor]:
        """A layer's sink and window keys at their positions: as held (exact), or rotated at
        their cache index (inside: the window ends just before the next token's)."""
        if not self.inside:
            return sink_k, window_k
        return self.rotated(layer, sink_k, 0), self.rotated(
            layer, window_k, self.position - window_k.shape[2]
        )

    def build_cache(self) -> DynamicCache:
        """Every layer's sinks and window, placed (a sliding layer's: its window; the middle is
        empty until tokens leave, and then the cache routes); while the cache routes, a
        sliding layer's alone: each bounded layer's `attend` reads the part from the runner
        (`parts`), and the model's cache holds the chunk alone."""
        cache = DynamicCache()
        if self.seen == 0:
            return cache
        routes = self.routes()
        for i in range(len(self.sink_k)):
            if routes and self.windows[i] is None:
                continue
            k = torch.cat(self.placed(i, self.sink_k[i], self.window_k[i]), dim=2)
            cache.update(k, torch.cat([self.sink_v[i], self.window_v[i]], dim=2), i)
        return cache

    def keep_chunk(self, cache: DynamicCache, first: int, L: int, to_sinks: int) -> None:
        """The chunk's keys (the last L of each layer's cache) as the model rotated them
        (exact), or un-rotated (inside)."""
        if self.inside:
            super().keep_chunk(cache, first, L, to_sinks)
            return
        for i, layer in enumerate(cache.layers):
            sinks = to_sinks if self.windows[i] is None else 0
            self.keep(i, layer.keys[:, :, -L:], layer.values[:, :, -L:], sinks)

    def hooks(self, chunk: int) -> AttentionHooks | None:
        if not self.routes():
            return None  # plain attention
        attend = [None if w else self.attend(i) for i, w in enumerate(self.windows)]
        return AttentionHooks(attend=attend)

    def count_attended(self, entries: int, L: int) -> None:
        """While the cache routes, each layer's attention counts per query head."""
        if not self.routes():
            super().count_attended(entries, L)

    def needle_route(self, start: int, stop: int) -> dict[str, float]:
        """How the last query read routed to the tokens start .. stop - 1 (a needle's answer),
        over layers, rows and query heads: `left`, the share of them that had left the window;
        of those, `routed`, the share whose unit the head opened, and `slot_rank`, the median
        rank of their units by the head's score (0: its best; the earlier unit first on ties),
        both left out where none had left."""
        ranks: list[Tensor] = []
        routed: list[Tensor] = []
        for scores, opened, leaves in zip(
            self.last_scores, self.last_opened, self.leaves, strict=True
        ):
            if scores is None or opened is None or leaves is None:
                continue
            sinks = self.sink_k[self.ref].shape[2]  # leaf j is token sinks + j
            lo, hi = max(start - sinks, 0), min(stop - sinks, len(leaves))
            if lo >= hi:
                continue
            groups = scores.shape[1] // leaves.owner.tensor.shape[1]
            units = leaves.owner.tensor[:, :, lo:hi, 0].repeat_interleave(groups, dim=1)
            mine = scores.gather(-1, units).unsqueeze(-1)  # (B, H, n, 1)
            index = torch.arange(scores.shape[-1], device=scores.device)
            ahead = (scores.unsqueeze(2) > mine) | (
                (scores.unsqueeze(2) == mine) & (index < units.unsqueeze(-1))
            )  # (B, H, n, U): the units ranked before each token's
            ranks.append(ahead.sum(-1).flatten())
            routed.append(opened.gather(-1, units).flatten())
        if not ranks:
            return {"left": 0.0}
        rank = torch.cat(ranks)
        scores = next(x for x in self.last_scores if x is not None)
        total = (stop - start) * scores.shape[0] * scores.shape[1] * len(self.bounded_layers)
        return {
            "left": rank.numel() / total,
            "routed": float(torch.cat(routed).double().mean()),
            "slot_rank": float(rank.double().median()),
        }

    def exact_tokens(self, token: int) -> list[Tensor | None]:
        """The bounded cache's exact entries (`BoundedRunner.exact_tokens`) and the leaves of the
        units each query head opened (leaf j is token sinks + j)."""
        out = super().exact_tokens(token)
        seen = self.watched[token]
        for mask, opened, store, n in zip(out, seen.opened, self.leaves, seen.leaves, strict=True):
            if mask is None or opened is None or store is None or not n:
                continue
            owner = store.owner.tensor[:, :, :n, 0]  # (B, Hkv, n)
            owner = owner.repeat_interleave(opened.shape[1] // owner.shape[1], dim=1)
            mask[..., seen.sinks : seen.sinks + n] |= opened.gather(-1, owner)
        return out

    def resident_bytes(self) -> dict[str, int]:
        """Bytes held now, over layers: the bounded part, the leaves in memory (with their
        owners) and the leaves in a file."""
        stores = [x for x in self.leaves if x is not None]
        return {
            **super().resident_bytes(),
            "leaves": sum(x.nbytes for x in stores),
            "leaves_file": sum(x.file_bytes for x in stores),
        }

    def check_room(self, tokens: int) -> None:
        """Exact positions: refuse unless the model has positions for the tokens read so far
        and `tokens` more (`check_exact_positions`); inside, every position is in the budget."""
        if not self.inside:
            check_exact_positions(
                self.model.config, self.seen + tokens, "the input read so far and to come"
            )

    def forward(self, ids: Tensor, output: str = "logits") -> Tensor:
        """Logits (B, L, V) of ids (B, L) at the next positions, after making room (or another
        `output`, `compat.OUTPUTS`)."""
        self.check_room(ids.shape[1])
        return super().forward(ids, output)
