"""KVM-Fold: a frozen model over a long input in bounded memory, with a KVM state of what left
the window.

Per layer and KV head the cache is sinks | slots | window (`longkv.caches.bounded`). Tokens that
leave the window update the slots by the rules of `longkv.caches.kvm_state`: the most novel
become new slots while the state's budget grows, the others merge into their most similar slot.
The budget of slots follows spec kvm.md section 6 (`desired_state_len`), capped at the entries
the cache leaves for the middle (budget - sinks - window).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from longkv.attention.state import tensor_bytes
from longkv.caches.bounded import BoundedConfig, BoundedRunner
from longkv.caches.kvm_state import (
    DROPPED,
    READOUTS,
    FoldState,
    empty_state,
    read_slots,
    update_state,
)
from longkv.caches.leaves import LEAF_STORES
from longkv.caches.routed import POSITIONS, ROUTINGS
from longkv.checks import refused_as, require, require_at_least, setting
from longkv.fold.attention import AttentionHooks
from longkv.kvm.config import BudgetRule, desired_state_len

STATES = ("fixed", "sqrt", "saturation", "lod")
SLOT_KEYS = ("rotated", "centred")
SLOT_SCORES = ("mean", "box")


@dataclass(frozen=True)
class KVMFoldConfig(BoundedConfig):
    """A bounded cache whose middle is a KVM state of slots."""

    state: str = setting(
        "fixed",
        "slots the state may hold: fixed (all of the middle from the start), sqrt "
        "(growth_factor * sqrt(tokens read)), saturation (n * tokens / (n + tokens)) or lod "
        "(max(lod_factor * sqrt(tokens read), lod_floor), the rule of the KVM authors' LOD "
        "attention), each capped at the middle",
        choices=STATES,
    )
    growth_factor: float = setting(4.0, "sqrt: slots per sqrt(token read)")
    saturation_n: int = setting(1024, "saturation: the n of n * tokens / (n + tokens)")
    lod_factor: float = setting(16.0, "lod: slots per sqrt(token read) (LOD: 16)")
    lod_floor: int = setting(256, "lod: the fewest slots the state may hold (LOD: 256)")
    readout: str = setting(
        "mean",
        "how a slot is read: mean (the mean key and value of its tokens) or founder (their unit "
        "mean scaled to the founding token's norms)",
        choices=READOUTS,
    )
    count_bias: bool = setting(
        False, "add log(count) to a slot's logits, so a slot of n tokens weighs like n of them"
    )
    merge_threshold: float | None = setting(
        None,
        "cosine similarity below which a leaving token is dropped instead of merged into its "
        "most similar slot (default: every token merges)",
    )
    slot_cap: float | None = setting(
        None,
        "a slot whose count exceeds this many times the mean count of the slots, as a block "
        "leaves the window, takes none of its tokens; they join their most similar open slot "
        "(>= 1; default: no bound, every token joins its most similar slot)",
    )
    open: int = setting(
        0,
        "two-level KVM-Fold: slots each query head opens to the exact tokens they own, ranked "
        "by its logit against their mean key + log(count) (0: the coarse state alone)",
    )
    leaves: str = setting(
        "exact",
        "two-level KVM-Fold: how the tokens that left the window are kept: exact (the model's "
        "dtype, in memory), int8 (in memory, a code per channel, a scale per token and head) or "
        "file (the model's dtype, in a file per layer, read and written with plain file I/O)",
        choices=LEAF_STORES,
    )
    slot_key: str = setting(
        "rotated",
        "two-level KVM-Fold: the key a slot is ranked and read by: rotated (the mean of its "
        "tokens' keys as rotated at their positions) or centred (the mean of their un-rotated "
        "keys, rotated at their mean position)",
        choices=SLOT_KEYS,
    )
    slot_score: str = setting(
        "mean",
        "two-level KVM-Fold: how a query ranks the slots it may open: mean (its logit against "
        "the slot's read-out key + log(count)) or box (the largest logit any key within the "
        "per-channel bounds of the slot's rotated keys can give, as Quest scores pages)",
        choices=SLOT_SCORES,
    )
    slot_variance: float = setting(
        0.0,
        "two-level KVM-Fold, slot score mean: the weight of the variance term added to a "
        "slot's score, 1/2 scale^2 |q|^2 (mean |k|^2 - |mean k|^2) / head_dim (a Gaussian "
        "estimate of how far the slot's mass exceeds its mean key's; 0: none)",
    )
    readouts: bool = setting(
        True,
        "two-level KVM-Fold: a query attends the read-out of each slot it leaves closed, "
        "weighted as its count (off: the slots only route, and a query attends the sinks, the "
        "window and the leaves it opens, as Quest and InfLLM do)",
    )
    rerank: int = setting(
        0,
        "two-level KVM-Fold: the query heads that open slots on their own (a decoded token's; "
        "every query's with routing token) take their best slots by score within this many "
        "leaves as candidates and open those of largest exact mass (the log-sum-exp of their "
        "leaves' logits) within leaf_budget (0: open by score alone)",
    )
    routing: str = setting(
        "block",
        "two-level KVM-Fold: who opens slots in a prefill chunk: block (its queries together, the "
        "slots they give the largest shares of attention, within leaf_budget) or token (each "
        "query head and query its own `open` best); a decoded token's query heads open their "
        "own either way",
        choices=ROUTINGS,
    )
    leaf_budget: int | None = setting(
        1024,
        "two-level KVM-Fold, block routing: the most leaves per KV head a prefill chunk's "
        "queries open together (None: every slot)",
    )
    leaf_dir: str | None = setting(
        None,
        "two-level KVM-Fold, file leaves: the folder their files go to (default: the system's "
        "temporary folder); the files are removed with the cache",
    )
    positions: str = setting(
        "exact",
        "two-level KVM-Fold: where it places the tokens: exact (each at the position the model "
        "gave it; refused past the model's positions) or inside (the leaves and read-outs "
        "un-rotated and met at one distance, window - 1; the sinks and window at their cache "
        "index: no distance past the budget, at any length)",
        choices=POSITIONS,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_middle()
        require(self.state in STATES, self, "state", f"must be one of {STATES}")
        require(self.readout in READOUTS, self, "readout", f"must be one of {READOUTS}")
        require(
            self.merge_threshold is None or -1 <= self.merge_threshold <= 1,
            self,
            "merge_threshold",
            f"a cosine similarity lies in [-1, 1], got {self.merge_threshold!r}",
        )
        require_at_least(1, self, "lod_floor")
        require(
            self.slot_cap is None or self.slot_cap >= 1, self, "slot_cap",
            f"a bound below the mean count closes every slot; pass >= 1, got {self.slot_cap!r}",
        )  # fmt: skip
        with refused_as(self):  # growth_factor and saturation_n are checked by the rule
            self.budget_rule  # noqa: B018
        require_at_least(0, self, "open")
        require(self.leaves in LEAF_STORES, self, "leaves", f"must be one of {LEAF_STORES}")
        require(self.slot_key in SLOT_KEYS, self, "slot_key", f"must be one of {SLOT_KEYS}")
        require(self.slot_score in SLOT_SCORES, self, "slot_score", f"must be one of {SLOT_SCORES}")
        require_at_least(0, self, "slot_variance", "rerank")
        require(
            self.open or self.readouts, self, "readouts",
            "only two-level KVM-Fold (open > 0) leaves slots closed; the coarse state reads "
            "every slot",
        )  # fmt: skip
        require(
            self.open or not self.rerank, self, "rerank",
            "only two-level KVM-Fold (open > 0) opens slots to rank them by their leaves",
        )  # fmt: skip
        require(
            not self.slot_variance or (self.open and self.slot_score == "mean"), self,
            "slot_variance", "only two-level KVM-Fold (open > 0) ranking slots by their mean "
            "(slot_score mean) adds the variance term",
        )  # fmt: skip
        require(self.routing in ROUTINGS, self, "routing", f"must be one of {ROUTINGS}")
        if self.leaf_budget is not None:
            require_at_least(1, self, "leaf_budget")
        require(
            self.open or self.slot_key == "rotated", self, "slot_key",
            "only two-level KVM-Fold (open > 0) reads its slots by another key",
        )  # fmt: skip
        require(
            self.open or self.slot_score == "mean", self, "slot_score",
            "only two-level KVM-Fold (open > 0) ranks slots to open them",
        )  # fmt: skip
        require(self.positions in POSITIONS, self, "positions", f"must be one of {POSITIONS}")
        require(
            self.open or self.positions == "exact", self, "positions",
            "coarse KVM-Fold places every entry inside its budget already; only two-level "
            "KVM-Fold (open > 0) places its tokens by this setting",
        )  # fmt: skip
        require(
            self.positions == "exact" or self.slot_key == "rotated", self, "slot_key",
            "with positions inside a slot's key is the mean of its un-rotated keys, met at one "
            "distance; leave slot_key rotated",
        )  # fmt: skip
        require(
            self.leaf_dir is None or os.path.isdir(self.leaf_dir), self, "leaf_dir",
            f"{self.leaf_dir!r} is not a folder; create it or leave it unset",
        )  # fmt: skip
        if self.open:  # every token that leaves the window must stay a leaf of its mean
            require(
                self.merge_threshold is None, self, "merge_threshold",
                "two-level KVM-Fold keeps every token that leaves the window; drop no token",
            )  # fmt: skip
            require(
                self.readout == "mean", self, "readout",
                "two-level KVM-Fold routes on each slot's mean key; use the mean read-out",
            )  # fmt: skip

    def describe(self) -> str:
        growth = {
            "fixed": "fixed",
            "sqrt": f"sqrt, {self.growth_factor:g} per sqrt(token)",
            "saturation": f"saturation n={self.saturation_n}",
            "lod": f"lod, max({self.lod_factor:g} sqrt(tokens), {self.lod_floor})",
        }[self.state]
        options = [f"{self.readout} read-out"]
        if self.count_bias:
            options.append("log(count) bias")
        if self.merge_threshold is not None:
            options.append(f"merges above cosine {self.merge_threshold:g}")
        if self.slot_cap is not None:
            options.append(f"slots of at most {self.slot_cap:g}x the mean count take tokens")
        if self.open:
            ranked = " (ranked by their key bounds)" if self.slot_score == "box" else ""
            if self.slot_variance:
                ranked = f" (ranked with the variance term x {self.slot_variance:g})"
            if self.rerank:
                ranked += f" (reranked by exact mass among {self.rerank} leaves)"
            if not self.readouts:
                ranked += ", no read-out of a closed slot"
            opens = f"each query head opens {self.open}{ranked} to their {self.leaves} tokens"
            options.append(opens)
            if self.routing == "block":
                bound = "" if self.leaf_budget is None else f" within {self.leaf_budget} leaves"
                options.append(f"a prefill chunk's queries together{bound}")
            if self.positions == "inside":
                options.append(f"leaves and read-outs met at distance {self.window_len - 1}")
        return (
            f"{self.sinks} sinks + up to {self.middle_len} slots ({growth}; "
            f"{', '.join(options)}) + {self.window_len} recent"
        )

    @functools.cached_property
    def budget_rule(self) -> BudgetRule:
        """The state budget (`desired_state_len`, with the tokens read as the context): `state`
        as a rule of spec section 6 (sqrt is its power law of exponent 0.5), capped at the
        middle."""
        fixed, lod = self.state == "fixed", self.state == "lod"
        floor = self.middle_len if fixed else self.lod_floor if lod else 1
        return BudgetRule(
            budget="power_law" if self.state in ("sqrt", "lod") else self.state,  # type: ignore[arg-type]
            state_min_len=floor, growth_factor=self.lod_factor if lod else self.growth_factor,
            saturation_n=self.saturation_n, cap=self.middle_len,
        )  # fmt: skip


# Two-level KVM-Fold as `longkv.read(method="two-level")` reads (docs/kvfold.md, The default
# two-level setting): 2048 entries per layer and KV head = 4 sinks + 1024 slots + 1020 recent
# tokens, slots of at most the mean count taking tokens, every query head and query opening up
# to 1024 leaves of its own, by the exact mass of its best slots within 4096 leaves.
TWO_LEVEL = KVMFoldConfig(
    budget=2048, window=1020, open=1024, rerank=4096, slot_cap=1.0, routing="token"
)


class KVMFoldRunner(BoundedRunner):
    """A bounded cache with a KVM state per layer; `track` keeps where each leaving token went
    (`destinations`)."""

    method = "KVM-Fold"
    config: KVMFoldConfig

    def __init__(self, model: nn.Module, config: KVMFoldConfig, track: bool = False):
        super().__init__(model, config)
        layers = model.config.num_hidden_layers
        self.states: list[FoldState | None] = [None] * layers
        self.track = track
        # per layer: (first token, dest (B, Hkv, m)) of every update, when tracked
        self.destinations: list[list[tuple[int, Tensor]]] = [[] for _ in range(layers)]

    @property
    def middle_count(self) -> int:
        state = self.states[self.ref]
        return 0 if state is None else state.num_slots

    def middle(self, layer: int) -> tuple[Tensor, Tensor]:
        state = self.states[layer]
        if state is None:
            k, v = self.window_k[layer], self.window_v[layer]
            return k[:, :, :0], v[:, :, :0]
        return read_slots(state, self.config.readout)

    def middle_bytes(self) -> int:
        """Bytes of the states: slot sums and counts, founders' norms and indices."""
        return sum(
            tensor_bytes(s.slots.tensor, s.key_norm, s.value_norm, s.founder)
            for s in self.states
            if s is not None
        )

    def absorb(self, layer: int, keys: Tensor, values: Tensor, first: int) -> None:
        self.fold_in(layer, keys, values, first, self.sink_k[layer])

    def fold_in(
        self, layer: int, keys: Tensor, values: Tensor, first: int, sinks: Tensor
    ) -> Tensor:
        """Update the layer's state with the tokens first, first + 1, ... (un-rotated keys
        (B, Hkv, m, D), values), sinks (B, Hkv, s, D) un-rotated; returns their dest."""
        state = self.states[layer]
        state = empty_state(keys, values) if state is None else state
        m = keys.shape[2]
        avail = first + m - sinks.shape[2]  # the tokens the slots summarise after the update
        target = desired_state_len(self.config.budget_rule, self.seen, avail, state.num_slots)
        state, dest = update_state(  # the runner keeps only the newest state of a layer
            state, keys, values, first, target, sinks, self.config.merge_threshold,
            donate=True, cap=self.config.slot_cap,
        )  # fmt: skip
        self.states[layer] = state
        if self.track:
            self.destinations[layer].append((first, dest))
        return dest

    def fates(self, start: int, stop: int) -> dict[str, float]:
        """Where the input tokens start .. stop - 1 went, over layers, rows and KV heads (needs
        `track`): fractions `exact` (still a sink or in the window), `founded` (a slot of their
        own), `merged` (into another token's slot), `dropped` (below the merge threshold); and
        `founded_slot_tokens`, the mean count of the slots they founded (0 if none)."""
        if not self.track:
            raise ValueError("fates: the runner was built without track=True")
        tally = dict.fromkeys(("exact", "founded", "merged", "dropped"), 0)
        counts: list[Tensor] = []
        for i in self.bounded_layers:
            state, log = self.states[i], self.destinations[i]
            absorbed = 0
            for first, dest in log:
                lo, hi = max(start, first), min(stop, first + dest.shape[2])
                if state is None or lo >= hi:
                    continue
                d = dest[:, :, lo - first : hi - first]  # (B, Hkv, n)
                tokens = torch.arange(lo, hi, device=d.device)
                slot = d.clamp_min(0)
                dropped = d == DROPPED
                founded = ~dropped & (state.founder.gather(2, slot) == tokens)
                tally["dropped"] += int(dropped.sum())
                tally["founded"] += int(founded.sum())
                tally["merged"] += int((~dropped & ~founded).sum())
                counts.append(state.count.gather(2, slot)[founded])
                absorbed += d.numel()
            B, Hkv = self.window_k[i].shape[:2]
            tally["exact"] += B * Hkv * (stop - start) - absorbed
        total = sum(tally.values())
        founded_counts = torch.cat(counts) if counts else torch.zeros(0)
        return {
            **{name: n / total for name, n in tally.items()},
            "founded_slot_tokens": float(founded_counts.mean()) if founded_counts.numel() else 0.0,
        }

    def hooks(self, chunk: int) -> AttentionHooks | None:
        if not self.config.count_bias or self.middle_count == 0:
            return None
        bias: list[Tensor | None] = []
        for i, state in enumerate(self.states):
            if state is None:  # a sliding layer, which keeps its own window
                bias.append(None)
                continue
            zeros = state.count.new_zeros
            B, Hkv = state.count.shape[:2]
            tail = self.window_count + chunk
            s = self.sink_k[i].shape[2]
            bias.append(torch.cat([zeros(B, Hkv, s), state.count.log(), zeros(B, Hkv, tail)], 2))
        return AttentionHooks(bias=bias)
