"""KVM configuration and the state budget (spec: docs/kvm.md, sections 1 and 6)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from longkv.checks import refused_as, require

Budget = Literal["fixed", "power_law", "saturation"]
BUDGETS: tuple[str, ...] = ("fixed", "power_law", "saturation")


@dataclass(frozen=True)
class BudgetRule:
    """How many slots a KVM state may hold (spec section 6, `desired_state_len`).

    budget: fixed (state_min_len slots), power_law (growth_factor * ctx ** growth_exponent) or
    saturation (saturation_n * ctx / (saturation_n + ctx)), the latter two rounded down to a
    multiple of round_down and at least state_min_len; cap: the most slots (None: no cap).
    A config that makes a rule reports the rule's refusals as its own fields of the same names
    (`refused_as`).
    """

    budget: Budget
    state_min_len: int
    growth_factor: float
    saturation_n: int
    growth_exponent: float = 0.5
    round_down: int = 1
    cap: int | None = None

    def __post_init__(self) -> None:
        require(
            self.budget in BUDGETS,
            self,
            "budget",
            f"must be one of {BUDGETS}, got {self.budget!r}",
        )
        require(
            isinstance(self.state_min_len, int) and self.state_min_len >= 1,
            self,
            "state_min_len",
            f"must be an int >= 1, got {self.state_min_len!r}",
        )
        require(
            math.isfinite(self.growth_factor) and self.growth_factor > 0,
            self,
            "growth_factor",
            f"must be a finite number > 0, got {self.growth_factor!r}; the paper uses 16",
        )
        require(
            0 < self.growth_exponent <= 1,
            self,
            "growth_exponent",
            f"must lie in (0, 1], got {self.growth_exponent!r}; 0.5 gives a sqrt budget",
        )
        require(
            isinstance(self.saturation_n, int) and self.saturation_n >= 1,
            self,
            "saturation_n",
            f"must be an int >= 1, got {self.saturation_n!r}; the paper uses 1024",
        )
        require(
            isinstance(self.round_down, int) and self.round_down >= 1,
            self,
            "round_down",
            f"must be an int >= 1 (1 = no rounding), got {self.round_down!r}",
        )
        require(
            self.cap is None or (isinstance(self.cap, int) and self.cap >= 1),
            self,
            "cap",
            f"must be None (no cap) or an int >= 1, got {self.cap!r}",
        )


@dataclass(frozen=True)
class KVMConfig:
    """Hyper-parameters of one Key-Value Means layer.

    chunk_len (C) and window_chunks (N) make the block sliding window of W = N*C tokens;
    sink_len protected slots; budget chooses how many slots the state may hold
    (see `desired_state_len`); rope_dim (P) leading channels of each head carry RoPE and are
    zeroed before keys enter the state; use_vlens reads slot values as direction times the
    founder's norm (else sum / count); gate_appends stores appended slots gated.
    """

    chunk_len: int = 256
    window_chunks: int = 2
    sink_len: int = 1
    budget: Budget = "fixed"
    state_min_len: int = 256
    growth_factor: float = 16.0
    growth_exponent: float = 0.5
    saturation_n: int = 1024
    max_state_chunks: int | None = 1
    round_down: int = 1
    rope_dim: int = 0
    use_vlens: bool = True
    gate_appends: bool = True

    def __post_init__(self) -> None:
        require(
            isinstance(self.chunk_len, int) and self.chunk_len > 0,
            self,
            "chunk_len",
            f"must be a positive int, got {self.chunk_len!r}; use e.g. 256",
        )
        require(
            isinstance(self.window_chunks, int) and self.window_chunks >= 1,
            self,
            "window_chunks",
            f"must be an int >= 1, got {self.window_chunks!r}; use e.g. 2",
        )
        require(
            isinstance(self.sink_len, int) and 0 <= self.sink_len < self.chunk_len,
            self,
            "sink_len",
            f"must be an int in [0, chunk_len - 1] = [0, {self.chunk_len - 1}] so that the "
            f"first chunk leaves a non-sink slot to merge into, got {self.sink_len!r}",
        )
        require(
            self.max_state_chunks is None
            or (isinstance(self.max_state_chunks, int) and self.max_state_chunks >= 1),
            self,
            "max_state_chunks",
            f"must be None (no cap) or an int >= 1, got {self.max_state_chunks!r}",
        )
        require(
            isinstance(self.rope_dim, int) and self.rope_dim >= 0 and self.rope_dim % 2 == 0,
            self,
            "rope_dim",
            f"must be an even int >= 0 (rotary channels come in pairs), got {self.rope_dim!r}",
        )
        require(isinstance(self.use_vlens, bool), self, "use_vlens", "must be a bool")
        require(isinstance(self.gate_appends, bool), self, "gate_appends", "must be a bool")
        with refused_as(self):  # the budget's fields are checked by its rule
            self.budget_rule  # noqa: B018

    @property
    def budget_rule(self) -> BudgetRule:
        """The state budget: this config's rule, at most chunk_len * max_state_chunks slots."""
        chunks = self.max_state_chunks
        return BudgetRule(
            budget=self.budget, state_min_len=self.state_min_len,
            growth_factor=self.growth_factor, growth_exponent=self.growth_exponent,
            saturation_n=self.saturation_n, round_down=self.round_down,
            cap=None if chunks is None else self.chunk_len * chunks,
        )  # fmt: skip

    @property
    def window_len(self) -> int:
        """W = window_chunks * chunk_len, the block sliding window span."""
        return self.window_chunks * self.chunk_len

    def check_head_dim(self, head_dim: int) -> None:
        """Reject a rope_dim that leaves no non-rotary key channel (spec section 9.5)."""
        require(
            self.rope_dim < head_dim,
            self, "rope_dim",
            f"{self.rope_dim} >= key head dim {head_dim} would zero every state key channel and "
            f"make all state keys identical; use rope_dim < {head_dim} (the paper rotates half "
            "of a head)",
        )  # fmt: skip

    @classmethod
    def paper_fixed(cls, **overrides: object) -> KVMConfig:
        """'KVM fixed': C=256, N=2, one sink, 256 slots (rope_dim 64 of a 128-dim head)."""
        budget = dict(budget="fixed", state_min_len=256, max_state_chunks=1)
        return cls(**{**_PAPER_LAYER, **budget, **overrides})  # type: ignore[arg-type]

    @classmethod
    def paper_sqrt(cls, **overrides: object) -> KVMConfig:
        """'KVM sqrt': power law 16 * ctx**0.5 slots, at least 256, no cap."""
        budget = dict(
            budget="power_law",
            state_min_len=256,
            growth_factor=16.0,
            growth_exponent=0.5,
            max_state_chunks=None,
        )
        return cls(**{**_PAPER_LAYER, **budget, **overrides})  # type: ignore[arg-type]

    @classmethod
    def paper_saturation(cls, **overrides: object) -> KVMConfig:
        """'KVM saturation': 1024 * ctx / (1024 + ctx) slots, at least 1, no cap."""
        budget = dict(
            budget="saturation", state_min_len=1, saturation_n=1024, max_state_chunks=None
        )
        return cls(**{**_PAPER_LAYER, **budget, **overrides})  # type: ignore[arg-type]


# Shared by the paper's configurations: C = 256, N = 2, one sink, RoPE on 64 of 128 channels.
_PAPER_LAYER: dict[str, object] = dict(chunk_len=256, window_chunks=2, sink_len=1, rope_dim=64)


def desired_state_len(rule: BudgetRule | KVMConfig, ctx: int, avail: int, cur: int) -> int:
    """Slots the state should hold after an update (spec section 6).

    rule: the budget (a KVMConfig stands for its `budget_rule`); ctx: context length the
    budget is a function of (W + tokens already covered); avail: tokens the state will
    summarise after the update (an upper bound on slots); cur: current slots (the state never
    shrinks).
    """
    if isinstance(rule, KVMConfig):
        rule = rule.budget_rule
    if rule.budget == "fixed":
        t = rule.state_min_len
    else:
        if rule.budget == "power_law":
            t = math.floor(rule.growth_factor * ctx**rule.growth_exponent)
        else:
            t = rule.saturation_n * ctx // (rule.saturation_n + ctx)
        t = max(t // rule.round_down * rule.round_down, rule.state_min_len)
    t = min(t, avail)
    if rule.cap is not None:
        t = min(t, rule.cap)
    return max(t, cur)
