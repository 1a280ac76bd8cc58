"""Trained runs side by side: held-out loss on the same rows, training time, loss curves."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from longkv.models import LongKVForCausalLM
from longkv.results import finish_figure, markdown_table, pyplot, write_atomic
from longkv.train.loop import METRICS_FILE
from longkv.train.rows import evaluate

PROVENANCE = "provenance.json"  # in a run's out_dir: a record per finished `longkv train`
RUN_FILE = "run.yaml"  # in a run's out_dir: the run file of its last finished `longkv train`


@dataclass(frozen=True)
class RunResult:
    """One finished run, scored on held-out rows shared by every run in the comparison."""

    label: str
    out_dir: str
    mixers: list[str]
    parameters: int
    steps: int
    train_tokens: int
    train_seconds: float
    held_out_loss: float
    held_out_tokens: int
    trained_by: str


def record_provenance(path: Path, record: dict[str, Any]) -> None:
    """Append record (command, commit, machine) to the JSON list at path."""
    records = json.loads(path.read_text()) if path.is_file() else []
    write_atomic(path, json.dumps([*records, record], indent=2) + "\n")


def trained_by(out: Path) -> str:
    """The commands and commits that trained the run in out, from its provenance.json."""
    path = out / PROVENANCE
    if not path.is_file():
        return f"no {PROVENANCE} in {out}"
    return "; ".join(
        f"`{r['command']}` at commit {r['commit'][:12]} on {r['machine']['cpu_count']} CPUs, "
        f"{r['date']}"
        for r in json.loads(path.read_text())
    )


def read_metrics(path: Path) -> list[dict[str, float]]:
    """metrics.csv of a run: one dict per step (eval_loss only on eval steps)."""
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {path.parent}; run `longkv train` first")
    with path.open(newline="") as f:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]


def score_run(
    label: str, out: Path, train_batch: int, held_out: Tensor, eval_batch: int, batches: int
) -> RunResult:
    """The run in out, its model scored on the first `batches` batches of held_out (N, L + 1).

    train_batch: the run's rows per step (for its token count); eval_batch: rows per held-out
    batch, the same for every run compared.
    """
    folder = out / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no finished model in {folder}; finish `longkv train` first")
    model = LongKVForCausalLM.from_pretrained(folder).eval()
    metrics = read_metrics(out / METRICS_FILE)
    steps = int(metrics[-1]["step"])
    n = min(batches, len(held_out) // eval_batch)
    return RunResult(
        label=label,
        out_dir=str(out),
        mixers=model.config.mixers,
        parameters=sum(p.numel() for p in model.parameters()),
        steps=steps,
        train_tokens=steps * train_batch * (held_out.shape[1] - 1),
        train_seconds=metrics[-1]["seconds"],
        held_out_loss=evaluate(model, held_out, n, eval_batch),
        held_out_tokens=n * eval_batch * (held_out.shape[1] - 1),
        trained_by=trained_by(out),
    )


def runs_table(results: list[RunResult]) -> list[str]:
    """The comparison as a markdown table; the last column is relative to the first run."""
    base = results[0].held_out_loss
    header = ["run", "mixers", "parameters", "steps", "tokens", "train minutes", "held-out loss"]
    rows = [
        [
            r.label,
            "/".join(dict.fromkeys(r.mixers)),
            f"{r.parameters:,}",
            str(r.steps),
            f"{r.train_tokens:,}",
            f"{r.train_seconds / 60:.1f}",
            f"{r.held_out_loss:.4f}",
            f"{100 * (r.held_out_loss / base - 1):+.2f} %",
        ]
        for r in results
    ]
    return markdown_table([*header, f"vs {results[0].label}"], rows, "<<" + ">" * 6)


def plot_runs(curves: dict[str, list[dict[str, float]]], path: Path, title: str) -> None:
    """Training loss (faint) and eval loss (markers) against step and against wall time."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (label, rows), colour in zip(curves.items(), colours, strict=False):
        evals = [r for r in rows if "eval_loss" in r]
        for ax, x in zip(axes, ("step", "seconds"), strict=True):
            scale = 1 / 60 if x == "seconds" else 1
            ax.plot(
                [r[x] * scale for r in rows], [r["loss"] for r in rows], color=colour, alpha=0.3
            )
            ax.plot(
                [r[x] * scale for r in evals], [r["eval_loss"] for r in evals],
                marker="o", color=colour, label=f"{label} (held-out)",
            )  # fmt: skip
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training minutes")
    axes[0].set_ylabel("next-token loss (nats)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    finish_figure(fig, path, title, title_size=10)
