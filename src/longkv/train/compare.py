"""`compare_runs`: finished runs scored on the same held-out rows, as a page and a plot."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from longkv.results import provenance, write_report
from longkv.train.checkpoint import describe, differences
from longkv.train.loop import METRICS_FILE
from longkv.train.report import plot_runs, read_metrics, runs_table, score_run
from longkv.train.run import finished_run, load_run


def compare_runs(
    configs: list[str], batches: int, stem: Path, argv: list[str] | None
) -> tuple[list[str], list[Path]]:
    """Score the finished runs of the run files `configs` (each with its own recorded settings;
    the first run's own tokenizer packs the rows) on `batches` held-out batches, and write
    stem.{json,md,png}. Returns the table's lines and the paths written. Runs recorded with
    different data sections are refused: their held-out rows would differ."""
    runs = [(Path(c).stem, finished_run(c, load_run(c, []), "--configs")) for c in configs]
    base, first = runs[0]
    data = first.sections.data
    differ = "; ".join(
        f"{label}: {describe(changed)}"
        for label, run in runs[1:]
        if (changed := differences({"data": asdict(data)}, {"data": asdict(run.sections.data)}))
    )
    if differ:
        raise ValueError(
            f"--configs: the runs recorded different data sections, so their held-out rows "
            f"would differ too ({differ}; {base} -> that run); compare runs trained on the "
            "same data"
        )
    held = first.held_out()
    eval_batch = first.sections.train.batch_size
    results = [
        score_run(label, run.sections.out, run.sections.train.batch_size, held, eval_batch, batches)
        for label, run in tqdm(runs, desc="score", unit="run")
    ]
    table = runs_table(results)
    body = [
        "",
        f"Held-out loss: mean next-token loss over the same {results[0].held_out_tokens:,} "
        "held-out tokens for every run (documents never trained on). Train minutes: the "
        "runs' own clock (metrics.csv `seconds`: steps and evaluations, not checkpoint writes).",
        "",
        *table,
        "",
        *[f"- {r.label}: {r.trained_by}" for r in results],
        "",
        f"![loss curves]({stem.name}.png)",
    ]
    payload = {
        "provenance": provenance(argv),
        "settings": {"configs": configs, "batches": batches},
        "runs": [asdict(r) for r in results],
    }
    curves = {label: read_metrics(run.sections.out / METRICS_FILE) for label, run in runs}
    paths = write_report(
        stem, "longkv compare-runs: " + ", ".join(configs), payload, body,
        lambda png: plot_runs(curves, png, "loss curves: " + ", ".join(curves)),
    )  # fmt: skip
    return table, paths
