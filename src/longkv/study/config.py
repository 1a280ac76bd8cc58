"""A study's settings: the YAML file `longkv study --config` reads (docs/study.md), checked
when built.

A study trains every variant (model settings over a shared model section) once per seed on the
same rows, then evaluates each: MQAR accuracy on a grid of points (task "mqar") or held-out loss
by position (task "lm"). Every bad value is a ValueError naming its key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import yaml

from longkv.checks import (
    refuse,
    require,
    require_at_least,
    require_known_keys,
    settings_from_section,
)
from longkv.evals.position_loss import check_edges, doubling_edges
from longkv.models import LongKVConfig
from longkv.study.mqar_config import MQAREval, MQARStudy, MQARTrainData, as_tuples
from longkv.train.config import MODEL_FIELDS, TrainConfig
from longkv.train.data import DataConfig
from longkv.train.run import preset_model

STUDY_TASKS = ("mqar", "lm")
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a folder name


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """base with over's entries; where both hold a mapping, those are merged the same way."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(out.get(key), Mapping) and isinstance(value, Mapping)
        out[key] = deep_merge(out[key], value) if both else value
    return out


@dataclass(frozen=True)
class LMEval:
    """Held-out loss by position: `rows` held-out rows of `length` tokens (one forward each,
    batch_size rows at a time); edges: position buckets (default 0, 1, 2, 4, ... length)."""

    SECTION: ClassVar[str | None] = "lm.eval"  # where its fields are in a study file

    length: int
    rows: int = 8
    batch_size: int = 1
    edges: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        as_tuples(self, "edges")
        require_at_least(1, self, "length", "rows", "batch_size")
        if self.edges is None:
            object.__setattr__(self, "edges", tuple(doubling_edges(self.length)))
        check_edges(self.edges, self.length, self, "edges")  # type: ignore[arg-type]


@dataclass(frozen=True)
class LMStudy:
    """Task "lm": training text exactly as `longkv train` reads it, and the held-out eval."""

    data: DataConfig
    eval: LMEval


@dataclass(frozen=True)
class StudyConfig:
    """A grid of variants x seeds trained on the same rows and evaluated the same way.

    model: the shared model section (a preset and LongKVConfig fields); variants: name ->
    overrides deep-merged into model (see `model_config`); train: TrainConfig, its seed set
    from each of `seeds`; mqar or lm: the task's section (the one `task` names).
    """

    SECTION: ClassVar[str | None] = None  # where its fields are in a study file

    name: str
    task: str
    seeds: tuple[int, ...]
    model: dict[str, Any]
    variants: dict[str, dict[str, Any]]
    train: TrainConfig
    mqar: MQARStudy | None = None
    lm: LMStudy | None = None

    def __post_init__(self) -> None:
        as_tuples(self, "seeds")
        require(
            isinstance(self.name, str) and SAFE_NAME.fullmatch(self.name) is not None,
            self,
            "name",
            f"must be a folder name (letters, digits, _ . -), got {self.name!r}",
        )
        require(
            self.task in STUDY_TASKS,
            self,
            "task",
            f"must be one of {STUDY_TASKS}, got {self.task!r}",
        )
        require(
            getattr(self, self.task) is not None,
            self,
            self.task,
            f"task {self.task!r} needs a {self.task} section",
        )
        other = next(t for t in STUDY_TASKS if t != self.task)
        require(
            getattr(self, other) is None, self, other, f"not used by task {self.task!r}; remove it"
        )
        require(
            isinstance(self.seeds, tuple)
            and len(self.seeds) > 0
            and all(isinstance(s, int) for s in self.seeds)
            and len(set(self.seeds)) == len(self.seeds),
            self,
            "seeds",
            f"must be a non-empty list of distinct ints, got {self.seeds!r}",
        )
        require(
            isinstance(self.variants, dict) and len(self.variants) > 0,
            self,
            "variants",
            f"must map at least one variant name to its model overrides, got {self.variants!r}",
        )
        require_known_keys("model", self.model, ["preset", *MODEL_FIELDS])
        for name, overrides in self.variants.items():
            require(
                isinstance(name, str) and SAFE_NAME.fullmatch(name) is not None,
                self,
                "variants",
                f"a variant name must be a folder name (letters, digits, _ . -), got {name!r}",
            )
            require(
                isinstance(overrides, dict),
                None,
                f"variants.{name}",
                f"must be a mapping of model keys to values ({{}} for the shared model), got "
                f"{overrides!r}",
            )
            require_known_keys(f"variants.{name}", overrides, ["preset", *MODEL_FIELDS])
            if self.task == "mqar":
                for section in ("model", f"variants.{name}"):
                    values = self.model if section == "model" else overrides
                    require(
                        "vocab_size" not in values,
                        None,
                        f"{section}.vocab_size",
                        "set by mqar.train.vocab_size; remove it",
                    )
            self.model_config(name)  # every variant's model is valid
        if self.mqar is not None:
            self.mqar.eval.points(self.mqar.train)  # every point fits the vocabulary
            require(
                self.mqar.train.held_out_rows >= self.train.batch_size,
                self.mqar.train,
                "held_out_rows",
                f"must fill one batch of train.batch_size={self.train.batch_size}, got "
                f"{self.mqar.train.held_out_rows}",
            )

    def model_config(self, variant: str, **tokens: Any) -> LongKVConfig:
        """The variant's LongKVConfig: its overrides deep-merged into the shared model section,
        built like every run's model (`preset_model`: a `kvm` mapping merges into the preset's),
        over `tokens` (an lm study's tokenizer fields; an mqar study's
        vocab_size is mqar.train.vocab_size)."""
        section = deep_merge(self.model, self.variants[variant])
        if self.mqar is not None:
            tokens = {"vocab_size": self.mqar.train.vocab_size, **tokens}
        try:
            return preset_model(section, **tokens)
        except ValueError as err:
            raise ValueError(f"variant {variant}: {err}") from err

    def train_config(self, seed: int) -> TrainConfig:
        """The train section with this run's seed."""
        return replace(self.train, seed=seed)

    def data_settings(self) -> dict[str, Any]:
        """What makes the training rows (recorded in each checkpoint and eval.json)."""
        if self.mqar is not None:
            return {"task": "mqar", **asdict(self.mqar.train)}
        assert self.lm is not None
        return {"task": "lm", **asdict(self.lm.data)}

    def eval_settings(self) -> dict[str, Any]:
        """What the evaluation of a run is made of."""
        section = self.mqar if self.mqar is not None else self.lm
        assert section is not None
        return asdict(section.eval)

    def as_dict(self) -> dict[str, Any]:
        """The study as the report records it (train without the seed each run sets)."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        del out["train"]["seed"]
        return out


def study_from_mapping(raw: Any) -> StudyConfig:
    """StudyConfig from the parsed YAML (see the module doc and docs/study.md)."""
    if not isinstance(raw, dict):
        refuse(None, "study", f"must be a mapping of sections, got {raw!r}")
    top = ["name", "task", "seeds", "model", "variants", "train", *STUDY_TASKS]
    require_known_keys("study", raw, top)
    for key in ("name", "task", "seeds", "variants", "train"):
        require(key in raw, None, key, "missing; see docs/study.md for a complete study")
    for key in ("model", "variants", "train", *STUDY_TASKS):
        require(
            isinstance(raw.get(key) or {}, dict),
            None,
            key,
            f"must be a mapping of keys to values, got {raw.get(key)!r}",
        )
    variants = raw["variants"] or {}  # a variant with no overrides may be left empty
    variants = {k: {} if v is None else v for k, v in variants.items()}
    train = dict(raw["train"] or {})
    require("seed" not in train, None, "train.seed", "set from each of seeds; remove it")
    sections: dict[str, Any] = {}
    if raw.get("mqar") is not None:
        mqar = raw["mqar"]
        require_known_keys("mqar", mqar, ["train", "eval"])
        for key in ("train", "eval"):
            require(isinstance(mqar.get(key), dict), None, f"mqar.{key}", "needs a mapping")
        sections["mqar"] = MQARStudy(
            settings_from_section(MQARTrainData, "mqar.train", mqar["train"]),
            settings_from_section(MQAREval, "mqar.eval", mqar["eval"]),
        )
    if raw.get("lm") is not None:
        lm = raw["lm"]
        require_known_keys("lm", lm, ["data", "eval"])
        for key in ("data", "eval"):
            require(isinstance(lm.get(key), dict), None, f"lm.{key}", "needs a mapping")
        sections["lm"] = LMStudy(
            settings_from_section(DataConfig, "lm.data", lm["data"]),
            settings_from_section(LMEval, "lm.eval", lm["eval"]),
        )
    return StudyConfig(
        name=raw["name"],
        task=raw["task"],
        seeds=raw["seeds"],
        model=dict(raw.get("model") or {}),
        variants=variants,
        train=TrainConfig.from_section(train),
        **sections,
    )


def load_study(path: str | Path) -> StudyConfig:
    """The study in a YAML file."""
    return study_from_mapping(yaml.safe_load(Path(path).read_text()))
