"""What a needle-in-a-haystack grid is and what its result file holds: the settings (grid,
methods and their options), one record per answer, and the scores the file carries with them
(string_match_all per task, method and length; whether the fold answered as full attention).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from longkv.caches.methods import BOUNDED, CACHE_METHODS, BoundedOptions
from longkv.checks import require, require_at_least, require_known, setting, typed
from longkv.evals.niah import TASKS
from longkv.fold.fold import FOLD_CHUNK
from longkv.fold.variants import VARIANT_HELP, VARIANTS, require_variants
from longkv.results import write_atomic

EXACT = {"full", "fold"}  # the methods that keep every token, in time quadratic in the length


def grid_cells(
    tasks: tuple[str, ...], lengths: tuple[int, ...], depths: tuple[float, ...], seed: int,
    samples: int,
) -> list[tuple[str, int, float, int]]:  # fmt: skip
    """Every (task, length, depth, seed) of a needle grid; sample i of a cell has seed + i."""
    return [
        (task, n, d, seed + i)
        for task in tasks
        for n in lengths
        for d in depths
        for i in range(samples)
    ]


@dataclass(frozen=True)
class NiahSettings(BoundedOptions):
    """The grid, the methods and their options."""

    tasks: tuple[str, ...] = setting(("niah_single_2",), "needle tasks", choices=TASKS)
    lengths: tuple[int, ...] = setting(
        (4096,), "context lengths in tokens (prompt and answer budget)"
    )
    depths: tuple[float, ...] = setting((0.1, 0.5, 0.9), "needle depths in [0, 1]")
    methods: tuple[str, ...] = setting(
        ("full", "fold", "streaming"), "methods that answer", choices=CACHE_METHODS
    )
    samples: int = setting(1, "samples per cell (task, length, depth)")
    seed: int = setting(0, "seed of the first sample; sample i uses seed + i")
    chunk_size: int = setting(FOLD_CHUNK, "fold chunk (tokens)")
    variant: str = setting("exact", "method fold: " + VARIANT_HELP, choices=VARIANTS)
    max_new_tokens: int = setting(32, "greedy answer tokens at most")
    exact_up_to: int = setting(
        0,
        "the longest length full attention and the fold answer (and `longkv bounded` measures "
        "their NLL at), whose time grows with the square of the length; the bounded caches "
        "answer at every length (0: no limit)",
    )

    def __post_init__(self) -> None:
        require_known(self, "tasks", self.tasks, TASKS)
        require_known(self, "methods", self.methods, CACHE_METHODS)
        at_least_one = ("lengths", "samples", "chunk_size", "max_new_tokens")
        require_at_least(1, self, *at_least_one)
        require_at_least(0, self, "exact_up_to")
        require(
            not EXACT & set(self.methods) or min(self.lengths) <= self.exact_or_any,
            self, "exact_up_to",
            f"{self.exact_up_to} is below every length {typed(self.lengths)}: full attention "
            "and the fold would answer nothing; raise it or drop them from --methods",
        )  # fmt: skip
        require_variants(self, "variant", self.variant)
        require(
            all(0 <= d <= 1 for d in self.depths),
            self,
            "depths",
            f"must lie in [0, 1], got {typed(self.depths)}",
        )
        self.bounded_configs(self.methods)
        bounded = [m for m in self.methods if m in BOUNDED]
        n = max(self.lengths)
        whole = [b for b in self.budgets if b >= n]
        require(
            not bounded or not whole, self, "budgets",
            f"{typed(whole)} holds every token of the longest samples ({n} tokens): "
            f"{bounded[0] if bounded else ''} would keep them all and answer as the fold does; "
            f"give budgets below {n}",
        )  # fmt: skip

    def whole_budgets(self) -> list[str]:
        """One line per budget that holds every token of some lengths (not all: those are
        refused), whose bounded runs there answer as the fold does."""
        if not set(BOUNDED) & set(self.methods):
            return []
        return [
            f"budget {b} holds every token at lengths {typed(short)}: the bounded runs answer "
            "there as the fold does"
            for b in self.budgets
            if (short := [n for n in self.lengths if n <= b])
        ]

    @property
    def cells(self) -> list[tuple[str, int, float, int]]:
        """Every (task, length, depth, seed) of the grid (`grid_cells`)."""
        return grid_cells(self.tasks, self.lengths, self.depths, self.seed, self.samples)

    @property
    def runs(self) -> list[str]:
        """The label of every method run (`BoundedOptions.labels`)."""
        return self.labels(self.methods)

    @property
    def exact_or_any(self) -> int | float:
        """The longest length full attention and the fold run at (inf: every length)."""
        return self.exact_up_to or float("inf")

    def runs_at(self, n: int) -> list[str]:
        """The runs that answer at length n: every run, full attention and the fold only up to
        `exact_up_to`."""
        return [r for r in self.runs if r not in EXACT or n <= self.exact_or_any]

    @property
    def keys(self) -> list[tuple[str, int, float, int, str]]:
        """Every answer of the grid: (task, length, depth, seed, run)."""
        return [(*c, run) for c in self.cells for run in self.runs_at(c[1])]


@dataclass(frozen=True)
class NiahRecord:
    """One method's answer to one sample."""

    task: str
    context_len: int
    depth: float
    seed: int
    method: str
    answers: list[str]
    prediction: str
    tokens: list[int]
    score: float
    seconds: float
    # kvm-fold: where the tokens spelling the first answer went (`KVMFoldRunner.fates`)
    needle_fate: dict[str, float] | None = None

    @property
    def key(self) -> tuple[str, int, float, int, str]:
        return (self.task, self.context_len, self.depth, self.seed, self.method)


@dataclass
class NiahRun:
    settings: NiahSettings
    records: list[NiahRecord] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        payload = {
            "provenance": self.provenance,
            "settings": asdict(self.settings),
            "records": [asdict(r) for r in self.records],
            "accuracy": accuracy(self.records),
        }
        mismatches = fold_mismatches(self.records)
        if mismatches is not None:  # only where both answered
            payload["fold_equals_full"] = mismatches == []
        write_atomic(path, json.dumps(payload, indent=2) + "\n")


def mean_scores(records: list[NiahRecord], key: Callable[[NiahRecord], Any]) -> dict[Any, float]:
    """string_match_all (0-100) of the records grouped by key(record)."""
    groups: dict[Any, list[float]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r.score)
    return {k: 100 * sum(v) / len(v) for k, v in groups.items()}


def accuracy(records: list[NiahRecord]) -> dict[str, float]:
    """string_match_all (0-100) per "task/method/length", over depths and samples."""
    return dict(
        sorted(mean_scores(records, lambda r: f"{r.task}/{r.method}/{r.context_len}").items())
    )


def fold_mismatches(records: list[NiahRecord]) -> list[tuple[str, int, float, int]] | None:
    """Samples where the fold's answer tokens differ from full attention's, among the samples
    both answered; None if there is no such sample (nothing was compared)."""
    tokens = {r.key: r.tokens for r in records}
    both = [r for r in records if r.method == "fold" and (*r.key[:4], "full") in tokens]
    if not both:
        return None
    return [r.key[:4] for r in both if tokens[(*r.key[:4], "full")] != r.tokens]
