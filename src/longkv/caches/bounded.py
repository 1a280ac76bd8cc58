"""Bounded caches for frozen models: sinks, a policy's middle, and an exact recent window.

Per layer and KV head the cache holds at most `budget` entries: the first `sinks` tokens, the
entries a policy keeps for the tokens that left the window (StreamingLLM: none; SnapKV: the ones
recent queries attended to most; KVM-Fold: a state of slots), and the `window` most recent tokens,
the chunk being read included. Positions live inside the cache, as StreamingLLM places them
(spec kvfold.md section 5): keys are stored with their rotation undone and, for every forward,
rotated at their cache index (sinks, then the middle, then the window); the chunk's queries take
the next indices. So a bounded cache never needs positions past `budget`.

A chunk of L tokens first moves the oldest window tokens to the policy, as many as make room for
the chunk's own (`absorb`), then runs the model on the rebuilt cache, then keeps its keys and
values (the first `sinks` tokens of the input become the sinks).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from longkv.attention.rope import angles_at, rotate
from longkv.attention.state import tensor_bytes
from longkv.caches.model import check_bounded, layer_windows
from longkv.checks import require, setting
from longkv.decoding import Pick, greedy
from longkv.fold import compat
from longkv.fold.attention import AttentionHooks, hooked
from longkv.fold.fold import FoldResult, check_input, score_chunks
from longkv.fold.generate import continue_decode

# the chunk read where none is given, at most the window (docs/kvfold.md, "The default chunk")
STREAM_CHUNK = 64


@dataclass(frozen=True)
class BoundedConfig:
    """How a bounded cache splits its budget of entries per layer and KV head."""

    budget: int = setting(1024, "entries per layer and KV head: sinks + middle + window")
    sinks: int = setting(4, "first tokens kept exactly")
    window: int | None = setting(
        None, "most recent tokens kept exactly, the chunk being read included (default: half "
        "the budget)"
    )  # fmt: skip

    def __post_init__(self) -> None:
        require(
            isinstance(self.budget, int) and self.budget >= 1, self, "budget",
            f"must be an int >= 1, got {self.budget!r}",
        )  # fmt: skip
        require(
            isinstance(self.sinks, int) and self.sinks >= 0, self, "sinks",
            f"must be an int >= 0, got {self.sinks!r}",
        )  # fmt: skip
        require(
            self.window is None or (isinstance(self.window, int) and self.window >= 1),
            self,
            "window",
            f"must be None (half the budget) or an int >= 1, got {self.window!r}",
        )
        require(
            self.window_len >= 1,
            self,
            "window",
            f"the window must hold at least one token; the budget {self.budget} is too small",
        )
        require(
            self.middle_len >= 0,
            self,
            "window",
            f"sinks {self.sinks} + window {self.window_len} exceed the budget {self.budget}",
        )

    def require_middle(self) -> None:
        """SettingError unless the budget leaves entries for the tokens that leave the window."""
        require(
            self.middle_len >= 1,
            self,
            "window",
            f"sinks {self.sinks} + window {self.window_len} leave no entries of the budget "
            f"{self.budget} for the tokens that leave the window; lower them or raise the budget",
        )

    def describe(self) -> str:
        """The split of the budget, for result pages."""
        return f"{self.sinks} sinks + {self.middle_len} middle + {self.window_len} recent"

    @property
    def window_len(self) -> int:
        """The recent tokens kept exactly."""
        return self.budget // 2 if self.window is None else self.window

    @property
    def middle_len(self) -> int:
        """The most entries the policy may keep: budget - sinks - window."""
        return self.budget - self.sinks - self.window_len


@dataclass
class Watched:
    """Where the query of one watched input token looked (`BoundedRunner.watch`): the sinks,
    tokens 0 .. sinks - 1, and the window and chunk from token `recent` up to its own; in a
    retrieval cache, per layer, the units each query head opened (B, H, U) among the layer's
    first `leaves` leaves (None: the layer routed nothing)."""

    sinks: int
    recent: int
    opened: list[Tensor | None] = field(default_factory=list)
    leaves: list[int] = field(default_factory=list)


class BoundedRunner:
    """The cache of a bounded policy and the count of tokens read; subclasses say what the
    middle holds (`middle`, `middle_count`: nothing by default), what happens to tokens leaving
    the window (`absorb`) and what they need from attention (`hooks`, `observed`)."""

    method = "a bounded cache"
    # the fields holding keys and values (a subclass adds its own): what a save may keep in a
    # narrower dtype (`longkv.document.save`), unlike sums, counts and positions
    KV_FIELDS: ClassVar[tuple[str, ...]] = ("sink_k", "sink_v", "window_k", "window_v")
    # the fewest window tokens that leave it together: 1, as many as the next chunk needs
    leave_at_once = 1

    def __init__(self, model: nn.Module, config: BoundedConfig):
        self.inv_freqs = check_bounded(model, config.budget, self.method)  # per layer
        self.model, self.config = model, config
        layers = model.config.num_hidden_layers
        # per layer, the sliding window of a layer that keeps its own (None: the method bounds
        # it); a sliding layer holds its last window - 1 tokens in `window_k`, and no sinks
        self.windows = layer_windows(model)
        self.bounded_layers = [i for i, w in enumerate(self.windows) if w is None]
        self.ref = self.bounded_layers[0]  # a layer whose entries every bounded layer shares
        self.sink_k: list[Tensor] = [torch.empty(0)] * layers  # (B, Hkv, <= sinks, D)
        self.sink_v: list[Tensor] = [torch.empty(0)] * layers
        self.window_k: list[Tensor] = [torch.empty(0)] * layers  # (B, Hkv, <= window, D)
        self.window_v: list[Tensor] = [torch.empty(0)] * layers
        self.seen = 0  # input tokens read
        # the entries and chunk of the last forward, rotated (a routing retrieval cache's: the
        # chunk alone)
        self.cache = DynamicCache()
        # per forward (and layer, where heads differ): first position, queries, share sum, max
        self.attended: list[tuple[int, int, float, float]] = []
        # input tokens whose queries' exact entries to keep (`exact_tokens`), and what was kept
        self.watch: set[int] = set()
        self.watched: dict[int, Watched] = {}

    # what a policy provides
    @property
    def middle_count(self) -> int:
        """Entries the middle holds now (the same in every layer); none by default."""
        return 0

    def middle(self, layer: int) -> tuple[Tensor, Tensor]:
        """Un-rotated keys (B, Hkv, M, D) and values (B, Hkv, M, Dv) of the middle; none by
        default."""
        k, v = self.window_k[layer], self.window_v[layer]
        return k[:, :, :0], v[:, :, :0]

    def absorb(self, layer: int, keys: Tensor, values: Tensor, first: int) -> None:
        """Take the tokens first, first + 1, ... (un-rotated keys (B, Hkv, m, D), values)
        that leave the window."""
        raise NotImplementedError

    def check_room(self, tokens: int) -> None:
        """Refuse before reading unless `tokens` more can be read: a bounded cache places them
        inside its budget, so always."""

    def hooks(self, chunk: int) -> AttentionHooks | None:
        """What the next forward of `chunk` tokens needs from attention (None: nothing)."""
        return None

    def observed(self, hooks: AttentionHooks) -> None:
        """Read what the forward left in the hooks."""

    def count_attended(self, entries: int, L: int) -> None:
        """Tally a forward of L queries after `entries` cached entries: query i attends them
        and the chunk up to itself."""
        self.tally(torch.arange(entries + 1, entries + L + 1))

    def tally(self, attended: Tensor) -> None:
        """Keep the entries each query of this forward attends, (..., L) (query heads, rows),
        as a share of full attention's (the tokens up to its own)."""
        L = attended.shape[-1]
        full = torch.arange(self.seen + 1, self.seen + L + 1, device=attended.device)
        share = attended.double() / full
        self.attended.append((self.seen, share.numel(), float(share.sum()), float(share.max())))

    def attention_share(self, since: int = 0) -> dict[str, float]:
        """The mean and the largest share of full attention's entries attended by the queries
        (heads, layers) of the forwards that began at position `since` or later."""
        kept = [a for a in self.attended if a[0] >= since]
        n = sum(a[1] for a in kept)
        if not n:
            raise ValueError(f"since: no forward began at position {since} or later")
        return {"mean": sum(a[2] for a in kept) / n, "max": max(a[3] for a in kept)}

    def resident_bytes(self) -> dict[str, int]:
        """Bytes the cache holds now, over layers: {"bounded": sinks, middle and window}
        (subclasses with more parts add their own keys)."""
        exact = tensor_bytes(*self.sink_k, *self.sink_v, *self.window_k, *self.window_v)
        return {"bounded": exact + self.middle_bytes()}

    def exact_tokens(self, token: int) -> list[Tensor | None]:
        """Per layer, which input tokens 0 .. token the query of a watched token attended as
        they are, (B, H, token + 1) bool (None for a sliding layer, which keeps its own window):
        the sinks, the window and the chunk up to itself (the middle summarises); a retrieval
        cache adds the leaves of the units each query head opened."""
        if token not in self.watched:
            raise ValueError(f"token: {token} was not watched; add it to the runner's watch first")
        seen = self.watched[token]
        heads = self.model.config.num_attention_heads
        out: list[Tensor | None] = []
        for layer, window in enumerate(self.windows):
            if window is not None:
                out.append(None)
                continue
            B, device = self.window_k[layer].shape[0], self.window_k[layer].device
            mask = torch.zeros(B, heads, token + 1, dtype=torch.bool, device=device)
            mask[..., : seen.sinks] = True
            mask[..., seen.recent :] = True
            out.append(mask)
        return out

    def middle_bytes(self) -> int:
        """Bytes of what the middle keeps, over layers."""
        if not self.seen:
            return 0
        return sum(tensor_bytes(*self.middle(i)) for i in self.bounded_layers)

    # the cache
    @property
    def window_count(self) -> int:
        """Tokens in the window now."""
        return self.window_k[self.ref].shape[2] if self.seen else 0

    @property
    def entry_count(self) -> int:
        """Entries per bounded layer now: the next chunk's keys follow them in the cache."""
        if self.seen == 0:
            return 0
        return self.sink_k[self.ref].shape[2] + self.middle_count + self.window_count

    @property
    def position(self) -> int:
        """The position the next token takes: its cache index, since a bounded cache places
        its entries at positions 0 .. entry_count - 1."""
        return self.entry_count

    def make_room(self, chunk: int) -> int:
        """Move the oldest window tokens to the policy so the chunk fits; its tokens that go
        to the sinks."""
        room = self.config.window_len
        if chunk > room:
            raise ValueError(f"chunk of {chunk} tokens does not fit a window of {room}")
        to_sinks = min(max(self.config.sinks - self.seen, 0), chunk)
        excess = self.window_count + chunk - to_sinks - room
        if excess > 0:
            excess = min(max(excess, self.leave_at_once), self.window_count)
            first = self.seen - self.window_count
            for i in self.bounded_layers:
                k, v = self.window_k[i], self.window_v[i]
                self.absorb(i, k[:, :, :excess], v[:, :, :excess], first)
                self.window_k[i], self.window_v[i] = k[:, :, excess:], v[:, :, excess:]
        return to_sinks

    def build_cache(self) -> DynamicCache:
        """The entries of every bounded layer rotated at their cache index; a sliding layer's
        window at the positions just before the chunk's."""
        cache = DynamicCache()
        n = self.entry_count
        if n == 0:
            return cache
        for i, w in enumerate(self.windows):
            mid_k, mid_v = self.middle(i)
            dtype = self.window_k[i].dtype
            k = torch.cat([self.sink_k[i], mid_k.to(dtype), self.window_k[i]], dim=2)
            v = torch.cat([self.sink_v[i], mid_v.to(dtype), self.window_v[i]], dim=2)
            cache.update(self.rotated(i, k, n - k.shape[2] if w else 0), v, i)
        return cache

    def rotated(self, layer: int, keys: Tensor, first: int, sign: int = 1) -> Tensor:
        """A layer's un-rotated keys (B, Hkv, m, D) rotated at positions first, first + 1, ...
        (sign -1: rotated keys at those positions, their rotation undone)."""
        positions = torch.arange(first, first + keys.shape[2], device=keys.device)
        cos, sin = angles_at(sign * positions, self.inv_freqs[layer])
        return rotate(keys.double(), cos, sin).to(keys.dtype)

    def keep_chunk(self, cache: DynamicCache, first: int, L: int, to_sinks: int) -> None:
        """Un-rotate the chunk's keys (the last L of each layer's cache, at positions first,
        first + 1, ...) and keep them."""
        for i, layer in enumerate(cache.layers):
            k = self.rotated(i, layer.keys[:, :, -L:], first, -1)
            self.keep(i, k, layer.values[:, :, -L:], to_sinks if self.windows[i] is None else 0)

    def keep(self, layer: int, k: Tensor, v: Tensor, to_sinks: int) -> None:
        """The chunk's keys k (B, Hkv, L, D) and values: the first to_sinks to the sinks, the
        rest to the window (a sliding layer's: its last window - 1 tokens)."""
        if self.seen == 0:
            self.sink_k[layer], self.sink_v[layer] = k[:, :, :0], v[:, :, :0]
            self.window_k[layer], self.window_v[layer] = k[:, :, :0], v[:, :, :0]
        self.sink_k[layer] = torch.cat([self.sink_k[layer], k[:, :, :to_sinks]], dim=2)
        self.sink_v[layer] = torch.cat([self.sink_v[layer], v[:, :, :to_sinks]], dim=2)
        k = torch.cat([self.window_k[layer], k[:, :, to_sinks:]], dim=2)
        v = torch.cat([self.window_v[layer], v[:, :, to_sinks:]], dim=2)
        w = self.windows[layer]
        if w is not None:  # a sliding layer's next query reaches its last w - 1 tokens
            k, v = k[:, :, max(k.shape[2] - (w - 1), 0) :], v[:, :, max(v.shape[2] - (w - 1), 0) :]
        self.window_k[layer], self.window_v[layer] = k, v

    def forward(self, ids: Tensor, output: str = "logits") -> Tensor:
        """Logits (B, L, V) of ids (B, L) at the next cache indices, after making room (or
        another `output`, `compat.OUTPUTS`)."""
        B, L = ids.shape
        to_sinks = self.make_room(L)
        layers = len(self.windows)
        for token in self.watch & set(range(self.seen, self.seen + L)):
            sinks = self.sink_k[self.ref].shape[2] if self.seen else 0
            recent = self.seen - self.window_count
            self.watched[token] = Watched(sinks, recent, [None] * layers, [0] * layers)
        cache = self.build_cache()
        first = self.position
        pos = torch.arange(first, first + L, device=ids.device).expand(B, L)
        hooks = self.hooks(L)
        if hooks is None and self.bounded_layers != list(range(len(self.windows))):
            hooks = AttentionHooks()  # longkv's attention keeps each sliding layer's window
        self.count_attended(self.entry_count, L)
        with nullcontext() if hooks is None else hooked(self.model, hooks):
            out = compat.forward(self.model, ids, pos, cache, output)
        self.keep_chunk(cache, first, L, to_sinks)
        self.seen += L
        if hooks is not None:
            self.observed(hooks)
        self.cache = cache
        return out


def bounded_fold(
    runner: BoundedRunner,
    input_ids: Tensor,
    chunk_size: int | None = None,
    *,
    return_logits: bool = False,
    score: bool = True,
    progress: bool = False,
    desc: str | None = None,
) -> FoldResult:
    """Feed input_ids (B, T) through a bounded runner in chunks of chunk_size (None:
    STREAM_CHUNK, at most the window; 1: token by token); nll and logits as for `kv_fold` (the
    result's cache: the runner's `cache` after the last forward; score=False: a read to decode
    from, `score_chunks`); desc labels the progress bar (default: the runner's method)."""
    chunk_size = min(STREAM_CHUNK, runner.config.window_len) if chunk_size is None else chunk_size
    check_input(input_ids, chunk_size)
    runner.check_room(input_ids.shape[1])
    if chunk_size > runner.config.window_len:
        raise ValueError(
            f"chunk_size: {chunk_size} exceeds the window {runner.config.window_len}; a chunk "
            "must fit the window it is read in"
        )
    return score_chunks(
        runner, input_ids, chunk_size,
        return_logits=return_logits, score=score, progress=progress, desc=desc or runner.method,
    )  # fmt: skip


def read_prompt(
    runner: BoundedRunner,
    input_ids: Tensor,
    chunk_size: int | None,
    *,
    progress: bool = False,
    desc: str | None = None,
) -> Tensor:
    """Read a prompt (B, T) to answer it: all but its last token in chunks (as `bounded_fold`),
    the last on its own, as the first step of decoding; returns its logits (B, V)."""
    if input_ids.shape[1] > 1:
        bounded_fold(
            runner, input_ids[:, :-1], chunk_size, score=False, progress=progress, desc=desc
        )
    with torch.inference_mode():
        return runner.forward(input_ids[:, -1:], "last")[:, -1]


def bounded_generate(
    runner: BoundedRunner,
    input_ids: Tensor,
    chunk_size: int | None,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    progress: bool = False,
    after_prompt: Callable[[], object] | None = None,
    pick: Pick = greedy,
    on_token: Callable[[Tensor], object] | None = None,
    desc: str | None = None,
) -> Tensor:
    """Read a prompt (B, T) through the runner (chunks and desc as for `bounded_fold`), then
    decode (B, n) from its cache, greedy unless `pick` samples (`continue_decode`); after_prompt
    is called between the two (to look at the runner as the prompt left it).

    The prompt's last token is read on its own, as the first step of decoding: its query,
    which predicts the first new token, attends as a decoded token's does (a retrieval cache
    routes it per query head, where a prefill chunk's queries route together), as InfLLM's
    reference reads it."""
    runner.check_room(input_ids.shape[1] + max_new_tokens - 1)  # the last token is not read
    logits = read_prompt(runner, input_ids, chunk_size, progress=progress, desc=desc)
    if after_prompt is not None:
        after_prompt()
    return continue_decode(
        runner.forward, logits, max_new_tokens, eos_token_id, pick=pick, on_token=on_token
    )
