"""A YAML run: its sections, the model it builds, training it, and the finished run it leaves.

A run file has `model` (a preset name and LongKVConfig fields), `data` (DataConfig fields),
`train` (TrainConfig fields) and `out_dir`; dotted `key=value` overrides change any entry
(`train.steps=10`, `model.mixer=full`), values read as YAML. A model section builds its model
as every preset does (`LongKVConfig.tiny` and the paper presets): its fields over the preset's,
a `kvm` mapping merged into the preset's kvm (`kvm: {budget: fixed}` changes only the budget),
the same way under `longkv train`, `longkv study` and `longkv bench train`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from longkv.checks import require, require_known_keys, settings_from_section
from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.models.config import PAPER_MODELS, PAPER_SIZES
from longkv.results import provenance, write_atomic
from longkv.train.checkpoint import describe, differences
from longkv.train.config import MODEL_FIELDS, TrainConfig, run_settings
from longkv.train.data import DataConfig, pack_texts, packed_corpus, split_texts
from longkv.train.loop import train
from longkv.train.report import PROVENANCE, RUN_FILE, record_provenance
from longkv.train.tokenizer import load_tokenizer

# tiny, and the paper's models by size and model: paper_120m_kvm_fixed, paper_350m_full, ...
PRESETS: dict[str, Callable[..., LongKVConfig]] = {
    "tiny": LongKVConfig.tiny,
    **{
        f"paper_{size}_{model}": functools.partial(LongKVConfig.paper, size, model)
        for size in PAPER_SIZES
        for model in PAPER_MODELS
    },
}
SECTIONS = ("model", "data", "train", "out_dir")


def load_run(path: str | Path, overrides: list[str]) -> dict[str, Any]:
    """The run's settings: the YAML file with the dotted key=value overrides applied."""
    run = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        require(bool(sep), None, f"override {item!r}", "write key=value, e.g. train.steps=10")
        *parents, leaf = key.split(".")
        node = run
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    unknown = sorted(set(run) - set(SECTIONS))
    require(not unknown, None, "run", f"unknown sections {unknown}; use {', '.join(SECTIONS)}")
    for section in ("model", "data", "train"):
        require(
            isinstance(run.get(section) or {}, dict),
            None, section, f"must be a mapping of keys to values, got {run.get(section)!r}",
        )  # fmt: skip
    return run


def preset_model(section: dict[str, Any], **fixed: Any) -> LongKVConfig:
    """LongKVConfig from a model section: a preset name (default tiny) and LongKVConfig field
    overrides (a kvm mapping merges into the preset's), over the fields `fixed` (which the
    section may override)."""
    require_known_keys("model", section, ["preset", *MODEL_FIELDS])
    fields = dict(section)
    preset = fields.pop("preset", "tiny")
    require(
        preset in PRESETS,
        None,
        "model.preset",
        f"unknown {preset!r}; choose from {sorted(PRESETS)}",
    )
    return PRESETS[preset](**{**fixed, **fields})


def special_tokens(tokenizer: Any) -> dict[str, int | None]:
    """The tokenizer's vocabulary size and special tokens as LongKVConfig fields (so the saved
    generation_config stops at its eos)."""
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def model_config(section: dict[str, Any], tokenizer: Any) -> LongKVConfig:
    """LongKVConfig from a preset name and field overrides (see preset_model), with the
    tokenizer's vocabulary size and special tokens."""
    return preset_model(section, **special_tokens(tokenizer))


@dataclass(frozen=True)
class RunSections:
    """A run file's sections, validated: the model section as written, data, train, out_dir."""

    model: dict[str, Any]
    data: DataConfig
    train: TrainConfig
    out: Path

    @classmethod
    def of(cls, run: dict[str, Any]) -> RunSections:
        return cls(
            model=run.get("model") or {},
            data=settings_from_section(DataConfig, "data", run.get("data") or {}),
            train=TrainConfig.from_section(run.get("train") or {}),
            out=Path(run.get("out_dir", "runs/longkv")),
        )

    def recorded(self) -> dict[str, Any]:
        """The sections as RUN_FILE records them."""
        return {
            "model": self.model, "data": asdict(self.data), "train": asdict(self.train),
            "out_dir": str(self.out),
        }  # fmt: skip


def train_run(s: RunSections, argv: list[str] | None, rank: int) -> list[dict[str, float]]:
    """Train the run of sections s (resuming from its checkpoint), then, on rank 0, record how
    it finished (PROVENANCE, from argv), save its tokenizer beside the weights and its sections
    as RUN_FILE (what eval-loss and compare-runs read). Returns the metrics of every step."""
    tokenizer = load_tokenizer(s.data.tokenizer)
    config = model_config(s.model, tokenizer)
    text = packed_corpus(tokenizer, s.data)
    metrics = train(config, s.train, text.train, text.held_out, s.out, data=asdict(s.data))
    if rank == 0:
        record_provenance(s.out / PROVENANCE, provenance(argv))
        tokenizer.save_pretrained(s.out / "model")  # generate finds it beside the weights
        write_atomic(s.out / RUN_FILE, yaml.safe_dump(s.recorded(), sort_keys=False))
    return metrics


def describe_model(s: RunSections) -> str:
    """The run's model, built without weights (on the meta device): its preset, layers and
    parameter counts (`LongKVForCausalLM.parameter_counts`), in millions."""
    config = model_config(s.model, load_tokenizer(s.data.tokenizer))
    with torch.device("meta"):
        counts = LongKVForCausalLM(config).parameter_counts()
    sizes = ", ".join(f"{name} {n / 1e6:.1f}M" for name, n in counts.items())
    layers = "/".join(sorted(set(config.mixers)))
    return (
        f"model {s.model.get('preset', 'tiny')}: {config.n_layers} {layers} layers, d_model "
        f"{config.d_model}, vocabulary {config.vocab_size}; parameters: {sizes}"
    )


@dataclass(frozen=True)
class FinishedRun:
    """A finished run with the settings it recorded: its sections and its own tokenizer."""

    sections: RunSections
    tokenizer: Any

    def held_out(self) -> torch.Tensor:
        """The run's held-out rows (N, seq_len), packed by its own tokenizer."""
        data = self.sections.data
        return pack_texts(self.tokenizer, split_texts(data)[1], data.seq_len, data.packing)

    def model(self) -> LongKVForCausalLM:
        """The trained model, in eval mode."""
        return LongKVForCausalLM.from_pretrained(self.sections.out / "model").eval()


def finished_run(config: str, run: dict[str, Any], flag: str) -> FinishedRun:
    """The finished run in run's out_dir with the settings it recorded in RUN_FILE.

    config: the run file run came from, and flag the CLI flag that named it (for the errors). A
    run without RUN_FILE (unfinished), or one whose recorded settings (model, data, train;
    out_dir aside) differ from run's, is refused naming each difference.
    """
    given = RunSections.of(run)
    out = given.out
    path, recorded_path = out / "model", out / RUN_FILE  # written when `longkv train` finishes
    if not (path / "config.json").is_file() or not recorded_path.is_file():
        raise FileNotFoundError(
            f"{flag} {config}: no finished run in {out} (its model/ and {RUN_FILE}); finish "
            f"`longkv train --config {config}` first"
        )
    own = RunSections.of(load_run(recorded_path, []))
    tokenizer = load_tokenizer(path)
    changed = differences(
        run_settings(model_config(own.model, tokenizer), own.train, asdict(own.data)),
        run_settings(model_config(given.model, tokenizer), given.train, asdict(given.data)),
    )
    if changed:
        raise ValueError(
            f"{flag} {config}: not the settings of the run in {out} ({describe(changed)}"
            f"; recorded -> given); use the run's own: {flag} {recorded_path}"
        )
    return FinishedRun(replace(own, out=out), tokenizer)
