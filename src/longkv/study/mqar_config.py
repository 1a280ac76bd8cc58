"""The sections of a study file for task "mqar" (`StudyConfig.mqar`): the training rows and the
evaluation grid, the seed streams their rows come from, and the checks the study file's
sections share.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from longkv.checks import require, require_at_least
from longkv.evals.synthetic import FILLERS, LEAD_KINDS, MQARConfig

TRAIN, HELD_OUT, EVAL, SHUFFLE = range(4)  # the seed streams of the MQAR rows
DISTANCE_EDGES = (0, 64, 256, 1024, 4096, 16384, 65536)


def derived_seed(*parts: int) -> int:
    """A seed in [0, 2**31) mixed from the integers parts (numpy's SeedSequence), so that
    different parts give unrelated row streams."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0] >> 1)


def as_tuples(obj: object, *names: str) -> None:
    """Lists read from YAML become tuples (the dataclass is frozen and compared by value)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, list):
            object.__setattr__(obj, name, tuple(value))


def require_ints(owner: object, name: str, low: int) -> None:
    """Raise unless owner.name is a non-empty tuple of ints >= low."""
    values = getattr(owner, name)
    require(
        isinstance(values, tuple)
        and len(values) > 0
        and all(isinstance(v, int) and v >= low for v in values),
        owner,
        name,
        f"must be a non-empty list of ints >= {low}, got {values!r}",
    )


def require_kinds(owner: object, name: str, kinds: tuple[str, ...]) -> None:
    """Raise unless owner.name is a non-empty tuple of names among kinds."""
    values = getattr(owner, name)
    require(
        isinstance(values, tuple) and len(values) > 0 and set(values) <= set(kinds),
        owner,
        name,
        f"must be a non-empty list of {kinds}, got {values!r}",
    )


@dataclass(frozen=True)
class MQARTrainData:
    """The MQAR training rows: every combination of num_pairs x fillers x value_lens (x gaps),
    with rows / combinations rows each, all exactly seq_len tokens, queries = num_pairs.
    gaps None: the gap fills the rest of the row (gap = seq_len - 2 * num_pairs * (1 +
    value_len)); a list: each gap in turn, capped at that rest, and filler before the pairs (the
    MQAR lead) fills what is left, so one length holds rows recalling at every distance.
    held_out_rows likewise from other seeds. seed: the data seed, the same rows for every
    variant and seed of the study. lead_kind: what the lead is made of ("filler", or a novel or
    repeated lead of its own lead_vocab ids: `MQARConfig`); lead_vocab ids are reserved even
    with a filler lead, so that a model trained without them can be scored on them."""

    SECTION: ClassVar[str | None] = "mqar.train"  # where its fields are in a study file

    seq_len: int
    num_pairs: tuple[int, ...]
    fillers: tuple[str, ...] = ("random",)
    value_lens: tuple[int, ...] = (1,)
    gaps: tuple[int, ...] | None = None
    rows: int = 4096
    held_out_rows: int = 256
    vocab_size: int = 8192
    filler_vocab: int = 16
    seed: int = 0
    lead_kind: str = "filler"
    lead_vocab: int = 0

    def __post_init__(self) -> None:
        as_tuples(self, "num_pairs", "fillers", "value_lens", "gaps")
        require_ints(self, "num_pairs", 1)
        require_ints(self, "value_lens", 1)
        if self.gaps is not None:
            require_ints(self, "gaps", 0)
        require_kinds(self, "fillers", FILLERS)
        require_at_least(1, self, "seq_len", "rows", "held_out_rows")
        n = len(self.num_pairs) * len(self.fillers) * len(self.value_lens) * len(self.gaps or (0,))
        for name in ("rows", "held_out_rows"):
            require(
                getattr(self, name) % n == 0,
                self,
                name,
                f"must be a multiple of the {n} (num_pairs, filler, value_len, gap) "
                f"combinations (equal rows each), got {getattr(self, name)}",
            )
        for p, length in itertools.product(self.num_pairs, self.value_lens):
            need = 2 * p * (1 + length)
            require(
                need <= self.seq_len,
                self,
                "seq_len",
                f"{self.seq_len} cannot hold num_pairs={p} pairs and their queries of "
                f"value_len={length} ({need} tokens); raise seq_len or drop the combination",
            )
        try:
            self.configs(TRAIN)
        except ValueError as err:
            raise ValueError(f"mqar.train: {err}") from err

    def configs(self, stream: int) -> list[MQARConfig]:
        """One MQARConfig per combination, seeded for `stream` (TRAIN or HELD_OUT)."""
        out = []
        for p, filler, length, gap in itertools.product(
            self.num_pairs, self.fillers, self.value_lens, self.gaps or (None,)
        ):
            rest = self.seq_len - 2 * p * (1 + length)
            gap = rest if gap is None else min(gap, rest)
            out.append(
                MQARConfig(
                    num_pairs=p,
                    num_queries=p,
                    gap=gap,
                    lead=rest - gap,
                    filler=filler,
                    value_len=length,
                    vocab_size=self.vocab_size,
                    filler_vocab=self.filler_vocab,
                    seed=derived_seed(self.seed, stream, p, FILLERS.index(filler), length, gap),
                    lead_kind=self.lead_kind,
                    lead_vocab=self.lead_vocab,
                )
            )
        return out


@dataclass(frozen=True)
class MQAREval:
    """The evaluation grid: a point per num_pairs x gaps x fillers x value_lens x leads x
    lead_kinds, each a batch of `rows` rows (queries = num_pairs) in the training vocabulary,
    scored `batch_size` rows per forward; leads: tokens before the pairs, of each lead kind
    (`MQARConfig.lead_kind`; novel and repeated need the training data's lead_vocab);
    distance_edges: the key-to-query distance buckets; max_len: points longer than this are
    refused (None: no limit)."""

    SECTION: ClassVar[str | None] = "mqar.eval"  # where its fields are in a study file

    num_pairs: tuple[int, ...]
    gaps: tuple[int, ...]
    fillers: tuple[str, ...] = ("random",)
    value_lens: tuple[int, ...] = (1,)
    rows: int = 64
    batch_size: int = 16
    distance_edges: tuple[int, ...] = DISTANCE_EDGES
    max_len: int | None = None
    leads: tuple[int, ...] = (0,)
    lead_kinds: tuple[str, ...] = ("filler",)

    def __post_init__(self) -> None:
        as_tuples(
            self, "num_pairs", "gaps", "fillers", "value_lens", "distance_edges", "leads",
            "lead_kinds",
        )  # fmt: skip
        require_ints(self, "num_pairs", 1)
        require_ints(self, "gaps", 0)
        require_ints(self, "value_lens", 1)
        require_ints(self, "leads", 0)
        require_kinds(self, "fillers", FILLERS)
        require_kinds(self, "lead_kinds", LEAD_KINDS)
        require_at_least(1, self, "rows", "batch_size")
        edges = list(self.distance_edges)
        require(
            len(edges) >= 2 and all(a < b for a, b in itertools.pairwise(edges)),
            self,
            "distance_edges",
            f"must be at least two strictly increasing distances, got {edges}",
        )
        require(
            self.max_len is None or (isinstance(self.max_len, int) and self.max_len >= 1),
            self,
            "max_len",
            f"must be None or an int >= 1, got {self.max_len!r}",
        )

    def points(self, data: MQARTrainData) -> list[MQARConfig]:
        """One MQARConfig per grid point, in data's vocabulary, seeded by its own settings (a
        point's rows do not depend on the rest of the grid)."""
        out = []
        for p, gap, filler, length, lead, kind in itertools.product(
            self.num_pairs, self.gaps, self.fillers, self.value_lens, self.leads, self.lead_kinds
        ):
            parts = (p, gap, FILLERS.index(filler), length)
            if (lead, kind) != (0, "filler"):  # the points without a lead keep their rows
                parts += (lead, LEAD_KINDS.index(kind))
            try:
                point = MQARConfig(
                    num_pairs=p, num_queries=p, gap=gap, filler=filler, value_len=length,
                    vocab_size=data.vocab_size, filler_vocab=data.filler_vocab,
                    seed=derived_seed(data.seed, EVAL, *parts), lead=lead, lead_kind=kind,
                    lead_vocab=data.lead_vocab,
                )  # fmt: skip
            except ValueError as err:
                raise ValueError(f"mqar.eval: {err}") from err
            require(
                self.max_len is None or point.seq_len <= self.max_len,
                self,
                "max_len",
                f"the point num_pairs={p}, gap={gap}, value_len={length}, lead={lead} is "
                f"{point.seq_len} tokens, over max_len={self.max_len}; drop it or raise max_len",
            )
            out.append(point)
        return out


@dataclass(frozen=True)
class MQARStudy:
    """Task "mqar": training rows and the evaluation grid."""

    train: MQARTrainData
    eval: MQAREval
