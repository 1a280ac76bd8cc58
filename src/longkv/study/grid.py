"""Run a study: train each (variant, seed) that is not finished, evaluate it, record eval.json.

A run lives in `<runs_dir>/<study name>/<variant>/seed<k>`: the trainer's checkpoint, metrics
and model, and `eval.json`, written (atomically) once the run is trained and evaluated. The
eval.json records the run's settings (model, data, train, eval); a run whose eval.json holds
the current settings is skipped. Otherwise the trainer resumes from its checkpoint (exactly, or
refusing other settings) and the run is evaluated again. An eval.json written with other
settings is refused naming them, unless only the evaluation or what the trainer may change on
resume (train.steps, bookkeeping) differ: then the run is extended and evaluated anew.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from longkv.checks import require
from longkv.evals.position_loss import bucket_loss, held_out_position_nll
from longkv.evals.synthetic import (
    MQARConfig,
    accuracy,
    accuracy_by_distance,
    make_mqar,
    predictions,
)
from longkv.kvm import KVMState
from longkv.kvm.layer import KVMAttention
from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.models.modeling import LongKVCache
from longkv.results import write_atomic
from longkv.study.config import LMEval, StudyConfig
from longkv.study.mqar_config import (
    HELD_OUT,
    SHUFFLE,
    TRAIN,
    MQARStudy,
    MQARTrainData,
    derived_seed,
)
from longkv.train.checkpoint import RESUMABLE, describe, differences
from longkv.train.config import run_settings
from longkv.train.data import pack_texts, packed_corpus, split_texts
from longkv.train.loop import train, train_device
from longkv.train.rows import LabelledRows, TrainingRows, world
from longkv.train.run import special_tokens
from longkv.train.tokenizer import load_tokenizer

EVAL_FILE = "eval.json"
RUNS_DIR = "runs/study"  # default parent of the study folders


def run_dir(runs_dir: str | Path, study: StudyConfig, variant: str, seed: int) -> Path:
    """The folder of one (variant, seed) run."""
    return Path(runs_dir) / study.name / variant / f"seed{seed}"


def mqar_rows(spec: MQARTrainData) -> tuple[LabelledRows, LabelledRows]:
    """(training, held-out) rows (N, seq_len) of every combination, equal rows each; the
    held-out rows shuffled once so that the trainer's first eval batches mix combinations."""

    def rows(stream: int, total: int) -> LabelledRows:
        configs = spec.configs(stream)
        batches = [make_mqar(c, total // len(configs)) for c in configs]
        return LabelledRows(
            torch.cat([b.input_ids for b in batches]), torch.cat([b.labels for b in batches])
        )

    held = rows(HELD_OUT, spec.held_out_rows)
    shuffle = torch.Generator().manual_seed(derived_seed(spec.seed, SHUFFLE))
    return rows(TRAIN, spec.rows), held[torch.randperm(len(held), generator=shuffle)]


class StudyData:
    """What every run of a study shares, made once on first use: the tokenizer fields of the
    models, the training and held-out rows, and the lm task's long held-out rows."""

    def __init__(self, study: StudyConfig) -> None:
        self.study = study

    @cached_property
    def tokenizer(self) -> Any:
        assert self.study.lm is not None
        return load_tokenizer(self.study.lm.data.tokenizer)

    @cached_property
    def tokens(self) -> dict[str, Any]:
        """LongKVConfig fields from the tokenizer (lm) or none (mqar: its vocabulary)."""
        return special_tokens(self.tokenizer) if self.study.lm is not None else {}

    @cached_property
    def rows(self) -> tuple[TrainingRows, TrainingRows]:
        """(training rows, held-out rows) for the trainer."""
        if self.study.mqar is not None:
            return mqar_rows(self.study.mqar.train)
        assert self.study.lm is not None
        text = packed_corpus(self.tokenizer, self.study.lm.data)
        return text.train, text.held_out

    @cached_property
    def long_rows(self) -> torch.Tensor:
        """(lm.eval.rows, length + 1) held-out token rows for the loss by position, spread
        evenly over all the held-out rows (first and last included), so that the buckets
        average over the held-out documents rather than the first few."""
        assert self.study.lm is not None
        data, spec = self.study.lm.data, self.study.lm.eval
        rows = pack_texts(self.tokenizer, split_texts(data)[1], spec.length, data.packing)
        if len(rows) < spec.rows:
            raise ValueError(
                f"lm.eval.rows: the held-out documents fill {len(rows)} rows of "
                f"lm.eval.length={spec.length} tokens, fewer than {spec.rows}; lower rows or "
                "length, or hold out more documents (lm.data.every)"
            )
        return rows[torch.linspace(0, len(rows) - 1, spec.rows).round().long()]

    def model_config(self, variant: str) -> LongKVConfig:
        return self.study.model_config(variant, **self.tokens)

    def settings(self, variant: str, seed: int) -> dict[str, Any]:
        """The run's settings as eval.json records them (plain JSON data)."""
        cfg = self.study.train_config(seed)
        settings = run_settings(self.model_config(variant), cfg, self.study.data_settings())
        settings["eval"] = self.study.eval_settings()
        return json.loads(json.dumps(settings))


def read_record(path: Path) -> dict[str, Any] | None:
    """The eval.json at path, or None when there is none."""
    return json.loads(path.read_text()) if path.is_file() else None


def finished(data: StudyData, runs_dir: str | Path, variant: str, seed: int) -> dict | None:
    """The run's eval.json record if it holds the current settings, else None."""
    record = read_record(run_dir(runs_dir, data.study, variant, seed) / EVAL_FILE)
    if record is None or differences(record["settings"], data.settings(variant, seed)):
        return None
    return record


def state_slots(cache: LongKVCache) -> float | None:
    """The slots the kvm layers' states hold (mean over kvm layers), None without kvm layers."""
    sizes = [layer.mixer.num_slots for layer in cache.layers if isinstance(layer.mixer, KVMState)]
    return sum(sizes) / len(sizes) if sizes else None


FATES = ("founded", "merged", "window")  # where a pair's token is at the end of its row


def pair_fates(cache: LongKVCache, point: MQARConfig) -> Tensor | None:
    """(3,) how many of the pairs' tokens, over rows, KV heads and the kvm layers that track
    founders, founded a slot of their own, merged into other slots, or are still in the window
    at the end of the row (FATES); None without such layers."""
    tracked = [
        (layer.mixer.founders.tensor[..., 0], layer.mixer.window.start)  # (B, Hkv, S), position
        for layer in cache.layers
        if isinstance(layer.mixer, KVMState) and layer.mixer.founders is not None
    ]  # fmt: skip
    if not tracked:
        return None
    pos = point.lead + torch.arange(point.num_pairs * point.pair_len)
    counts = torch.zeros(len(FATES), dtype=torch.long)
    for founders, window_start in tracked:
        founded = (founders.cpu().unsqueeze(-1) == pos).any(dim=-2)  # (B, Hkv, pair tokens)
        window = (pos >= window_start) & ~founded
        counts += torch.stack([founded.sum(), (~founded & ~window).sum(), window.sum()])
    return counts


@contextlib.contextmanager
def founders_tracked(model: nn.Module) -> Iterator[None]:
    """Within: every KVM layer of model keeps its slots' founding positions (`pair_fates`)."""
    layers = {m: m.track_founders for m in model.modules() if isinstance(m, KVMAttention)}
    for layer in layers:
        layer.track_founders = True
    try:
        yield
    finally:
        for layer, before in layers.items():
            layer.track_founders = before


def _number(x: float) -> float | None:
    return None if math.isnan(x) else x


@torch.no_grad()
def evaluate_point(
    model: LongKVForCausalLM, point: MQARConfig, rows: int, batch_size: int, edges: list[int]
) -> dict[str, Any]:
    """Accuracy of `rows` rows of one MQAR point, by distance bucket, the state size and, for
    kvm layers, where the pairs' tokens are at the end of the row (shares of FATES)."""
    batch = make_mqar(point, rows)
    device = next(model.parameters()).device
    preds, slots, fates = [], None, None
    with founders_tracked(model):
        for i in range(0, rows, batch_size):
            out = model(batch.input_ids[i : i + batch_size].to(device))
            preds.append(predictions(out.logits).cpu())
            slots = state_slots(out.cache)
            counts = pair_fates(out.cache, point)
            if counts is not None:
                fates = counts if fates is None else fates + counts
    pred = torch.cat(preds)
    buckets = [
        {**asdict(b), "accuracy": _number(b.accuracy)}
        for b in accuracy_by_distance(pred, batch, edges)
    ]
    return {
        "num_pairs": point.num_pairs, "gap": point.gap, "filler": point.filler,
        "value_len": point.value_len, "lead": point.lead, "lead_kind": point.lead_kind,
        "seq_len": point.seq_len,
        "accuracy": accuracy(pred, batch), "by_distance": buckets, "state_slots": slots,
        "pair_tokens": None if fates is None else dict(
            zip(FATES, (fates / fates.sum()).tolist(), strict=True)
        ),
    }  # fmt: skip


def evaluate_mqar(model: LongKVForCausalLM, spec: MQARStudy, label: str) -> dict[str, Any]:
    """Every point of the evaluation grid, in grid order."""
    e = spec.eval
    points = e.points(spec.train)
    return {
        "points": [
            evaluate_point(model, p, e.rows, e.batch_size, list(e.distance_edges))
            for p in tqdm(points, desc=f"eval {label}", unit="point", leave=False)
        ]
    }


def evaluate_lm(model: LongKVForCausalLM, rows: torch.Tensor, spec: LMEval) -> dict[str, Any]:
    """Held-out loss by position bucket (and overall) over the long rows."""
    nll = held_out_position_nll(model, rows, spec.batch_size)
    return {
        "mean_loss": nll.mean().item(),
        "buckets": [asdict(b) for b in bucket_loss(nll, list(spec.edges or ()))],
    }


def run_one(
    data: StudyData,
    runs_dir: str | Path,
    variant: str,
    seed: int,
    label: str,
    on_step: Callable[[], object] | None = None,
) -> dict[str, Any]:
    """Train and evaluate one run unless its eval.json holds the current settings; its record.
    on_step: called after each training step."""  # fmt: skip
    study = data.study
    out = run_dir(runs_dir, study, variant, seed)
    settings = data.settings(variant, seed)
    path = out / EVAL_FILE
    old = read_record(path)
    if old is not None:
        changed = differences(old["settings"], settings)
        if not changed:
            return old
        refused = [d for d in changed if d[0] not in RESUMABLE and not d[0].startswith("eval.")]
        if refused:
            raise ValueError(
                f"{out} holds a run finished with other settings ({describe(refused)}; "
                f"recorded -> given); give another --runs-dir or study name, or delete {out} "
                "to redo it"
            )
    train_rows, held_out = data.rows
    config, cfg = data.model_config(variant), study.train_config(seed)
    metrics = train(
        config, cfg, train_rows, held_out, out, data=study.data_settings(), desc=label,
        on_step=on_step,
    )  # fmt: skip
    model = LongKVForCausalLM.from_pretrained(out / "model").to(train_device()).eval()
    if study.mqar is not None:
        results = evaluate_mqar(model, study.mqar, label)
    else:
        assert study.lm is not None
        results = evaluate_lm(model, data.long_rows, study.lm.eval)
    last = metrics[-1]
    record = {
        "variant": variant, "seed": seed, "settings": settings,
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": int(last["step"]), "train_seconds": last["seconds"], "loss": last["loss"],
        "eval_loss": next((m["eval_loss"] for m in reversed(metrics) if "eval_loss" in m), None),
        **results,
    }  # fmt: skip
    write_atomic(path, json.dumps(record, indent=2) + "\n")
    return record


def check_subset(
    study: StudyConfig, variants: Sequence[str] | None = None, seeds: Sequence[int] | None = None
) -> None:
    """Refuse the argument variants (or seeds) unless each is one of the study's."""
    unknown = sorted(set(variants or ()) - set(study.variants))
    require(
        not unknown, None, "variants",
        f"unknown variants {unknown}; the study has {list(study.variants)}",
    )  # fmt: skip
    missing = sorted(set(seeds or ()) - set(study.seeds))
    require(
        not missing, None, "seeds", f"{missing} are not among the study's seeds {list(study.seeds)}"
    )


def run_study(
    study: StudyConfig,
    runs_dir: str | Path = RUNS_DIR,
    *,
    variants: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    data: StudyData | None = None,
) -> dict[tuple[str, int], dict[str, Any]]:
    """Train and evaluate every (variant, seed) of the study, or of the given subsets; the
    records by (variant, seed). One process: not under torchrun."""
    if world()[1] > 1:
        raise ValueError("longkv study runs in one process; start it without torchrun")
    check_subset(study, variants, seeds)
    data = data or StudyData(study)
    grid = [(v, s) for v in variants or study.variants for s in seeds or study.seeds]
    records = {}
    steps = study.train_config(0).steps  # every run's
    # the whole study in training steps, so its ETA covers every run left (finished runs and
    # steps resumed from a checkpoint count as done when reached)
    bar = tqdm(total=len(grid) * steps, desc=f"study {study.name}", unit="step")
    for i, (variant, seed) in enumerate(grid, 1):
        label = f"{variant} seed {seed} ({i}/{len(grid)})"
        bar.set_postfix_str(label)
        records[(variant, seed)] = run_one(data, runs_dir, variant, seed, label, bar.update)
        bar.update(i * steps - bar.n)  # a finished or resumed run's steps
    bar.close()
    return records
