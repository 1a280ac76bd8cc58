"""A study's result page: `<out_dir>/study_<name>.{json,md,png}` from its finished runs.

The JSON holds the provenance, the study, every finished run's eval.json record and the mean
over seeds per variant; the page has the tables (mean and per seed, state size, training
time) and the PNG the plots (mqar: accuracy against pairs, gap and state size; lm: loss against
position with the training length marked). Runs not finished with the current settings are
listed as missing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from statistics import fmean
from typing import Any

from longkv.results import finish_figure, markdown_table, provenance, pyplot, write_report
from longkv.study.config import StudyConfig
from longkv.study.grid import StudyData, finished, run_dir
from longkv.study.mqar_config import TRAIN, MQARStudy
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


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _fates(shares: dict[str, float] | None) -> str:
    """founded / merged / window in %."""
    return "-" if shares is None else " / ".join(f"{100 * x:.0f}" for x in shares.values())


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


def below_half(recall: dict[int, float], chance: float) -> str:
    """The shortest lead whose recall is below half of the lead-0 recall ("-" with no lead-0
    point, "> longest" where none is, "at chance" where half the lead-0 recall is no more than
    `chance`, so that no fall could be told from noise)."""
    if 0 not in recall:
        return "-"
    if recall[0] / 2 <= chance:
        return "at chance"
    below = [x for x, r in recall.items() if r < recall[0] / 2]
    return str(below[0]) if below else f"> {max(recall)}"


def lead_table(done: dict[str, list[Record]], points: list[Record], chance: float) -> list[str]:
    """Per run and lead kind: accuracy at each lead length and where it first falls below half
    of its lead-0 accuracy (`below_half`)."""
    kinds = sorted({setting(p, "lead_kind") for p in points})
    leads = sorted({setting(p, "lead") for p in points})
    rows = []
    for variant, records in done.items():
        for r in records:
            for kind in kinds:
                recall = by_lead(r["points"], kind)
                cells = [_pct(recall.get(x)) for x in leads]
                rows.append([variant, str(r["seed"]), kind, *cells, below_half(recall, chance)])
    return [
        "",
        "## Accuracy against the lead, per seed (%)",
        "",
        "Mean over the points with that lead (pairs, gaps); the last column is the shortest "
        "lead at which the run's accuracy falls below half of its accuracy with no lead "
        f'("at chance" where that half is at most chance, {100 * chance:.1f} %).',
        "",
        *markdown_table(["variant", "seed", "lead kind", *map(str, leads), "below half at"], rows),
    ]


def point_columns(points: list[Record]) -> tuple[list[str], Callable[[Record], list[str]]]:
    """(the header cells of a point, a function from a point to its cells)."""
    keys = [k for k in POINT_KEYS if k not in NO_LEAD or has_leads(points)]

    def cells(p: Record) -> list[str]:
        return [str(setting(p, k)) for k in keys]

    return [HEADERS.get(k, k) for k in keys], cells


def mqar_tables(
    done: dict[str, list[Record]], means: dict[str, Record], chance: float
) -> list[str]:
    """Accuracy per point (mean, then per seed), against the lead where points have leads
    (`chance`: one-token values' chance accuracy), where the kvm layers keep the pairs' tokens
    and the kvm state sizes."""
    variants = list(done)
    points = next(iter(means.values()))["points"]
    header, label = point_columns(points)
    lines = [
        "",
        "## Accuracy (%, mean over seeds)",
        "",
        "A query is right when every value token is; accuracy is the fraction of right queries.",
        "",
        *markdown_table(
            header + variants,
            [
                label(p) + [_pct(means[v]["points"][i]["accuracy"]) for v in variants]
                for i, p in enumerate(points)
            ],
        ),
        "",
        "## Accuracy per seed (%)",
        "",
    ]
    runs = [(v, r) for v in variants for r in done[v]]
    lines += markdown_table(
        header + [f"{v} s{r['seed']}" for v, r in runs],
        [
            label(p) + [_pct(r["points"][i]["accuracy"]) for _, r in runs]
            for i, p in enumerate(points)
        ],
    )
    if has_leads(points):
        lines += lead_table(done, points, chance)
    kvm = [v for v in variants if means[v]["points"][0]["state_slots"] is not None]
    tracked = [v for v in kvm if means[v]["points"][0].get("pair_tokens") is not None]
    if tracked:
        lines += [
            "",
            "## Where the pairs' tokens are at the end of the row (kvm layers, mean over seeds)",
            "",
            "% of the pairs' tokens (keys and values, over rows, KV heads and kvm layers) that "
            "founded a slot of their own / merged into another slot / are still in the window.",
            "",
            *markdown_table(
                header + tracked,
                [
                    label(p) + [_fates(means[v]["points"][i]["pair_tokens"]) for v in tracked]
                    for i, p in enumerate(points)
                ],
            ),
        ]
    if kvm:
        lines += [
            "",
            "## State size (slots at the end of the row, mean over kvm layers and seeds)",
            "",
            *markdown_table(
                header + kvm,
                [
                    label(p) + [f"{means[v]['points'][i]['state_slots']:.1f}" for v in kvm]
                    for i, p in enumerate(points)
                ],
            ),
        ]
    return lines


def lm_tables(done: dict[str, list[Record]], means: dict[str, Record]) -> list[str]:
    """Held-out loss per position bucket (mean, then per seed)."""
    variants = list(done)
    buckets = next(iter(means.values()))["buckets"]
    runs = [(v, r) for v in variants for r in done[v]]
    return [
        "",
        "## Held-out loss by position (mean over seeds)",
        "",
        *markdown_table(
            ["positions", *variants],
            [
                [f"{b['low']}-{b['high'] - 1}"]
                + [f"{means[v]['buckets'][j]['loss']:.4f}" for v in variants]
                for j, b in enumerate(buckets)
            ],
        ),
        "",
        "## Per seed",
        "",
        *markdown_table(
            ["positions", *(f"{v} s{r['seed']}" for v, r in runs)],
            [
                [f"{b['low']}-{b['high'] - 1}"]
                + [f"{r['buckets'][j]['loss']:.4f}" for _, r in runs]
                for j, b in enumerate(buckets)
            ],
        ),
    ]


TIME_HEADER = [
    "variant",
    "seed",
    "parameters",
    "steps",
    "loss",
    "held-out loss",
    "held-out curve",
    "minutes",
]


def time_table(done: dict[str, list[Record]]) -> list[str]:
    """Steps, final losses, the held-out loss curve and training minutes of every run."""
    return [
        "",
        "## Training",
        "",
        "Minutes: the trainer's clock (steps and held-out evaluations, resumes included). "
        "Held-out curve: the held-out loss at each evaluation, in step order (where a run "
        "leaves a plateau, and how many steps it had after).",
        "",
        *markdown_table(
            TIME_HEADER,
            [
                [
                    v,
                    str(r["seed"]),
                    f"{r['parameters']:,}",
                    str(r["steps"]),
                    f"{r['loss']:.4f}",
                    "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}",
                    " ".join(f"{loss:.2f}" for _, loss in r["held_out_curve"]) or "-",
                    f"{r['train_seconds'] / 60:.2f}",
                ]
                for v, records in done.items()
                for r in records
            ],
        ),
    ]


def value_ids(mqar: MQARStudy) -> int:
    """How many ids a value token is drawn from: chance is 1 / this with one-token values."""
    return mqar.train.configs(TRAIN)[0].key_vocab


def describe_study(study: StudyConfig, data: StudyData) -> list[str]:
    """What was trained and how: the task, variants, seeds, steps, token shift."""
    variants = [
        f"- `{v}`: {overrides or 'the shared model'}" for v, overrides in study.variants.items()
    ]
    shifted = [v for v in study.variants if data.model_config(v).token_shift]
    shift = (
        "Token shift is on in every variant's model."
        if len(shifted) == len(study.variants)
        else f"Token shift is on in: {', '.join(shifted)}."
        if shifted
        else "Token shift is off."
    )
    if study.mqar is not None:
        t = study.mqar.train
        lead = (
            "filler"
            if t.lead_kind == "filler"
            else f"a {t.lead_kind} lead of {t.lead_vocab} ids of its own"
        )
        gaps = (
            "the gap filling the rest"
            if t.gaps is None
            else f"gaps {list(t.gaps)} capped at the rest, {lead} before the pairs filling it"
        )
        task = (
            f"Task mqar: trained on {t.rows} rows of {t.seq_len} tokens (num_pairs "
            f"{list(t.num_pairs)}, fillers {list(t.fillers)}, value_lens {list(t.value_lens)}, "
            f"queries = pairs, {gaps}), loss on the answer tokens only; "
            f"evaluated on {study.mqar.eval.rows} rows per point."
        )
        n = value_ids(study.mqar)
        task += (
            f" Chance is a held-out loss of ln {n} = {math.log(n):.2f} (every one of the {n} "
            f"value ids alike) and {100 / n:.1f} % with one-token values: a run there has not "
            "learned recall, and a mean over seeds that includes it is pulled down (read the "
            "per-seed tables)."
        )
    else:
        assert study.lm is not None
        d, e = study.lm.data, study.lm.eval
        task = (
            f"Task lm: trained on rows of {d.seq_len} tokens; held-out loss by position over "
            f"{e.rows} held-out rows of {e.length} tokens (one forward each)."
        )
    return [
        "",
        task,
        f"Every variant is trained for {study.train.steps} steps of batch {study.train.batch_size} "
        f"on the same rows, once per seed ({', '.join(map(str, study.seeds))}). {shift}",
        "",
        f"Shared model: {study.model or 'the tiny preset'}. Variants:",
        "",
        *variants,
    ]


def plot_mqar(means: dict[str, Record], path: Path, title: str) -> None:
    """Accuracy vs pairs and vs gap per (filler, value_len), vs lead length per lead kind where
    the points have leads, and vs state size for kvm."""
    plt = pyplot()
    points = next(iter(means.values()))["points"]
    kinds = sorted({(p["filler"], p["value_len"]) for p in points})
    kvm = [v for v, m in means.items() if m["points"][0]["state_slots"] is not None]
    leads = has_leads(points)
    lead_kinds = sorted({p["lead_kind"] for p in points}) if leads else []
    nrows = 2 + int(leads) + int(bool(kvm))
    ncols = max(len(kinds), len(lead_kinds))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.5 * nrows), squeeze=False)
    for row in axes:
        for ax in row[len(kinds) :]:
            ax.axis("off")
    color = {variant: f"C{i}" for i, variant in enumerate(means)}  # one colour per variant
    for col, (filler, value_len) in enumerate(kinds):
        for row, key in enumerate(("num_pairs", "gap")):
            ax = axes[row][col]
            for variant, m in means.items():
                mine = [
                    p for p in m["points"] if (p["filler"], p["value_len"]) == (filler, value_len)
                ]
                xs = sorted({p[key] for p in mine})
                ys = [fmean(p["accuracy"] for p in mine if p[key] == x) for x in xs]
                ax.plot(xs, ys, marker="o", label=variant, color=color[variant])
            other = "gaps" if key == "num_pairs" else "pairs"
            ax.set_title(f"{filler} filler, value_len {value_len}", fontsize=9)
            ax.set_xlabel(f"{'pairs' if key == 'num_pairs' else 'gap'} (mean over {other})")
            ax.set_ylabel("accuracy")
            ax.set_ylim(-0.02, 1.02)
            ticks = sorted({p[key] for p in points})
            if key == "gap":  # 0 and long gaps on one axis
                ax.set_xscale("symlog", linthresh=1)
                ax.set_xlim(0, max(ticks) * 1.2 + 1)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.legend(fontsize=7)
    for col, kind in enumerate(lead_kinds):  # recall against the lead's length
        ax = axes[2][col]
        ax.axis("on")
        for variant, m in means.items():
            recall = by_lead(m["points"], kind)
            ax.plot(list(recall), list(recall.values()), marker="o", label=variant,
                    color=color[variant])  # fmt: skip
        ax.set_xscale("symlog", linthresh=64)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("lead before the pairs (tokens; mean over pairs, gaps, fillers)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{kind} lead", fontsize=9)
        ax.legend(fontsize=7)
    if kvm:  # recall against pairs per state slot, one panel per value length
        lengths = sorted({value_len for _, value_len in kinds})
        for col, value_len in enumerate(lengths):
            ax = axes[nrows - 1][col]
            for variant in kvm:
                pts = [p for p in means[variant]["points"] if p["value_len"] == value_len]
                ax.scatter(
                    [p["num_pairs"] / p["state_slots"] for p in pts],
                    [p["accuracy"] for p in pts],
                    label=variant, color=color[variant], alpha=0.6,
                )  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("pairs per state slot (end of row)")
            ax.set_ylabel("accuracy")
            ax.set_title(f"kvm: every point, value_len {value_len}", fontsize=9)
            ax.legend(fontsize=7)
        for col in range(len(lengths), ncols):
            axes[nrows - 1][col].axis("off")
    finish_figure(fig, path, title)


def plot_lm(means: dict[str, Record], train_len: int, path: Path, title: str) -> None:
    """Held-out loss against position (each bucket at its end), the training length marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, m in means.items():
        ax.plot(
            [b["high"] for b in m["buckets"]],
            [b["loss"] for b in m["buckets"]],
            marker="o",
            label=variant,
        )
    ax.axvline(train_len, color="gray", linestyle="--", label=f"training length {train_len}")
    ax.set_xscale("log")
    ax.set_xlabel("position (end of bucket)")
    ax.set_ylabel("held-out loss (nats)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    finish_figure(fig, path)


def write_study_report(
    data: StudyData, runs_dir: str | Path, out_dir: str | Path, argv: list[str] | None
) -> list[Path]:
    """study_<name>.{json,md,png} in out_dir from the study's finished runs; the paths."""
    study = data.study
    done, missing = collect(data, runs_dir)
    stem = Path(out_dir) / f"study_{study.name}"
    means = {v: mean_over_seeds(records) for v, records in done.items()}
    title = f"longkv study {study.name} ({study.task})"
    body = describe_study(study, data)
    if missing:
        body += ["", f"Not run (or run with other settings): {', '.join(missing)}."]
    if done:
        tables = (
            mqar_tables(done, means, 1 / value_ids(study.mqar))
            if study.mqar is not None
            else lm_tables(done, means)
        )
        body += [*tables, *time_table(done), "", f"![plots]({stem.name}.png)"]
    payload = {
        "provenance": provenance(argv),
        "study": study.as_dict(),
        "runs": [r for records in done.values() for r in records],
        "mean": means,
        "missing": missing,
    }
    paths = write_report(stem, title, payload, body)
    if done:
        png = stem.with_suffix(".png")
        if study.mqar is not None:
            plot_mqar(means, png, title)
        else:
            assert study.lm is not None
            plot_lm(means, study.lm.data.seq_len, png, title)
        paths.append(png)
    return paths
