"""A study's finished runs as records (an eval.json each, with its held-out loss curve), their
mean over seeds, and how a point's settings read (`setting`), records written before leads
included.
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean
from typing import Any

from longkv.study.grid import StudyData, finished, run_dir
from longkv.train.loop import METRICS_FILE
from longkv.train.report import read_metrics

Record = dict[str, Any]


def _mean(values: list[float | None]) -> float | None:
    """Mean of the values that are numbers; None when there are none."""
    present = [v for v in values if v is not None]
    return fmean(present) if present else None


def mean_over_seeds(records: list[Record]) -> Record:
    """One variant's results averaged over its seeds' records (same evaluation settings)."""
    out: Record = {
        "seeds": [r["seed"] for r in records],
        "train_seconds": fmean(r["train_seconds"] for r in records),
    }
    if "points" in records[0]:
        out["points"] = [
            _mean_point([r["points"][i] for r in records]) for i in range(len(records[0]["points"]))
        ]
    else:
        out["mean_loss"] = fmean(r["mean_loss"] for r in records)
        out["buckets"] = [
            {
                **{k: b[k] for k in ("low", "high")},
                "loss": fmean(r["buckets"][j]["loss"] for r in records),
            }
            for j, b in enumerate(records[0]["buckets"])
        ]
    return out


def _mean_point(seeds: list[Record]) -> Record:
    """One MQAR point's results averaged over the seeds (empty buckets and missing slots
    left out)."""
    first = seeds[0]
    buckets = [
        {
            **{k: b[k] for k in ("low", "high")},
            "accuracy": _mean([s["by_distance"][j]["accuracy"] for s in seeds]),
        }
        for j, b in enumerate(first["by_distance"])
    ]
    return {
        **{k: setting(first, k) for k in POINT_KEYS},
        "accuracy": fmean(s["accuracy"] for s in seeds),
        "state_slots": _mean([s["state_slots"] for s in seeds]),
        "pair_tokens": _mean_fates([s.get("pair_tokens") for s in seeds]),
        "by_distance": buckets,
    }


def _mean_fates(seeds: list[dict[str, float] | None]) -> dict[str, float] | None:
    """The shares of the pairs' tokens per fate averaged over the seeds that recorded them."""
    present = [f for f in seeds if f is not None]
    return {k: fmean(f[k] for f in present) for k in present[0]} if present else None


def collect(data: StudyData, runs_dir: str | Path) -> tuple[dict[str, list[Record]], list[str]]:
    """(finished records by variant in seed order, each with its held-out loss curve
    `held_out_curve` [[step, loss], ...] from metrics.csv; the runs missing as "variant seed
    k")."""
    study = data.study
    done: dict[str, list[Record]] = {}
    missing = []
    for variant in study.variants:
        for seed in study.seeds:
            record = finished(data, runs_dir, variant, seed)
            if record is None:
                missing.append(f"{variant} seed {seed}")
                continue
            metrics = read_metrics(run_dir(runs_dir, study, variant, seed) / METRICS_FILE)
            curve = [[int(m["step"]), m["eval_loss"]] for m in metrics if "eval_loss" in m]
            done.setdefault(variant, []).append({**record, "held_out_curve": curve})
    return done, missing


# a point's settings, and their headers on the page (lead and lead kind only where a point has
# a lead of its own kind or length: records written before leads count as NO_LEAD)
POINT_KEYS = ("num_pairs", "gap", "filler", "value_len", "lead", "lead_kind", "seq_len")
HEADERS = {"num_pairs": "pairs", "lead_kind": "lead kind", "seq_len": "tokens"}
NO_LEAD = {"lead": 0, "lead_kind": "filler"}


def setting(point: Record, key: str) -> Any:
    """A point's setting `key`, reading a record written before leads through NO_LEAD."""
    return point.get(key, NO_LEAD.get(key))


def has_leads(points: list[Record]) -> bool:
    """Whether any point has tokens before its pairs or a lead of its own ids."""
    return any(setting(p, k) != v for p in points for k, v in NO_LEAD.items())


def by_lead(points: list[Record], kind: str) -> dict[int, float]:
    """Accuracy per lead length (ascending) over the points with leads of `kind` (mean over
    their pairs, gaps, fillers and value lengths)."""
    mine = [p for p in points if setting(p, "lead_kind") == kind]
    leads = sorted({setting(p, "lead") for p in mine})
    return {x: fmean(p["accuracy"] for p in mine if setting(p, "lead") == x) for x in leads}
