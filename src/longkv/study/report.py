"""A study's result page: `<out_dir>/study_<name>.{json,md,png}` from its finished runs.

The JSON holds the provenance, the study, every finished run's eval.json record and the mean
over seeds per variant; the page has the tables (mean and per seed, state size, training
time) and the PNG the plots (`study.plots`). The runs are read as records (`study.records`);
runs not finished with the current settings are listed as missing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from longkv.results import markdown_table, provenance, write_report
from longkv.study.config import StudyConfig
from longkv.study.grid import StudyData
from longkv.study.mqar_config import TRAIN, MQARStudy
from longkv.study.plots import plot_lm, plot_mqar
from longkv.study.records import (
    HEADERS,
    NO_LEAD,
    POINT_KEYS,
    Record,
    by_lead,
    collect,
    has_leads,
    mean_over_seeds,
    setting,
)


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _fates(shares: dict[str, float] | None) -> str:
    """founded / merged / window in %."""
    return "-" if shares is None else " / ".join(f"{100 * x:.0f}" for x in shares.values())


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

    def plot(png: Path) -> None:
        if study.mqar is not None:
            plot_mqar(means, png, title)
        else:
            assert study.lm is not None
            plot_lm(means, study.lm.data.seq_len, png, title)

    return write_report(stem, title, payload, body, plot if done else None)
