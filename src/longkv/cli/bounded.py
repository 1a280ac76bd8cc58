"""`longkv bounded`: bounded caches of a frozen model compared with full attention, on one page.

For every method run (full attention, and each bounded method at each budget): the held-out
NLL, its gap to full attention, time and peak memory over corpus text at each length of
`--nll-tokens` (`longkv.bench.compare`), and needle-in-a-haystack answers over the grid
(`longkv.evals.niah_run`), with where kvm-fold put the tokens of each needle's answer. Partial
results are kept beside the page (`<name>.nll.json`, `<name>.niah.json`) after every step, so
an interrupted run resumes; they are removed once the page is written.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from longkv.bench.compare import compare_methods, markdown_rows
from longkv.checks import require_at_least, setting
from longkv.cli.args import add_settings
from longkv.cli.common import ModelOptions, dtype_setting, input_device, require_positions
from longkv.cli.niah import methods_line
from longkv.data.corpus import DEFAULT_TEXT, text_tokens
from longkv.evals.niah_records import NiahRecord, NiahSettings
from longkv.evals.niah_report import accuracy_table, budget_plot, heatmap
from longkv.evals.niah_resume import reusable_records
from longkv.evals.niah_run import check_grid, run_niah
from longkv.results import (
    load_partial,
    markdown_table,
    provenance,
    save_partial,
    write_report,
)

FATES = ("exact", "founded", "merged", "dropped")


@dataclass(frozen=True)
class BoundedStudyOptions:
    """`longkv bounded`: the text the NLL is measured on, the dtype and the page's name."""

    nll_tokens: tuple[int, ...] = setting(
        (2048, 8192), "lengths of corpus text the NLL, time and peak memory are measured at"
    )
    text: str = setting(DEFAULT_TEXT, "corpus file the NLL is measured on")
    dtype: str = dtype_setting()
    name: str = setting("bounded", "file name stem of the results")
    niah_records: tuple[str, ...] = setting(
        (),
        "result files of `longkv niah` runs of the same grid and method options whose answers "
        "are reused (runs split over processes); their commands are listed on the page",
    )

    def __post_init__(self) -> None:
        require_at_least(1, "BoundedStudyOptions", self, "nll_tokens")


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `bounded`."""
    add_settings(parser, ModelOptions)
    add_settings(parser, BoundedStudyOptions)
    add_settings(parser, NiahSettings)
    parser.set_defaults(func=run)


def memory_rows(nll: dict[str, Any]) -> list[str]:
    """Markdown: peak memory of each method at each length, and longest / shortest."""
    lengths = sorted(nll, key=int)
    peaks: dict[str, list[int | None]] = {}
    for n in lengths:
        for r in nll[n]["runs"]:
            peaks.setdefault(r["method"], []).append(r["peak_memory_bytes"])
    rows = []
    for method, values in peaks.items():
        shown = ["n/a" if v is None else f"{v / 2**20:.0f}" for v in values]
        first, last = values[0], values[-1]
        ratio = "n/a" if not first or last is None else f"{last / first:.2f}"
        rows.append([method, *shown, ratio])
    header = ["method", *(f"peak MiB at {n}" for n in lengths), f"{lengths[-1]} / {lengths[0]}"]
    return markdown_table(header, rows, "<" + ">" * (len(lengths) + 1))


def fate_rows(records: list[NiahRecord]) -> list[str]:
    """Markdown: where each kvm-fold run put the tokens of the needles' answers, over the
    samples it answered right and those it missed."""
    groups: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for r in records:
        if r.needle_fate is not None:
            groups.setdefault((r.method, r.score == 1.0), []).append(r.needle_fate)
    rows = []
    for (method, right), fates in sorted(groups.items()):
        cells = [f"{100 * sum(f[k] for f in fates) / len(fates):.1f} %" for k in FATES]
        # over the samples where the answer founded slots at all (their mean is 0 elsewhere)
        sizes = [f["founded_slot_tokens"] for f in fates if f["founded"] > 0]
        size = f"{sum(sizes) / len(sizes):.1f}" if sizes else "-"
        rows.append([method, "yes" if right else "no", str(len(fates)), *cells, size])
    header = ["method", "answered", "samples", *FATES, "tokens per founded slot"]
    return markdown_table(header, rows, "<<>" + ">" * (len(FATES) + 1))


def _reused_answers(
    paths: tuple[str, ...], settings: NiahSettings
) -> tuple[list[NiahRecord], list[str]]:
    """The answers this grid reuses from `longkv niah` result files at paths, and a Markdown line
    per file naming its command and commit."""
    reused: list[NiahRecord] = []
    sources: list[str] = []
    for path in paths:
        records, source = reusable_records(Path(path), settings)
        reused += records
        sources.append(
            f"- {len(records)} needle answers from `{source.get('command')}` "
            f"(commit `{source.get('commit')}`)"
        )
    return reused, sources


def run(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[ModelOptions], args.settings[BoundedStudyOptions]
    s = args.settings[NiahSettings]
    model, tokenizer = m.load(o.dtype)
    check_grid(model, s, m.allow_extrapolation)
    longest = max(o.nll_tokens)
    require_positions(
        model, longest, "BoundedStudyOptions.nll_tokens", f"{longest} tokens",
        m.allow_extrapolation,
    )  # fmt: skip
    reused, sources = _reused_answers(o.niah_records, s)
    stem = Path(m.out_dir) / o.name
    stem.parent.mkdir(parents=True, exist_ok=True)
    prov = provenance(argv)
    # what the results depend on (not where reused answers were read from)
    options = {k: v for k, v in asdict(o).items() if k != "niah_records"}
    settings = {**options, **asdict(s), "model": m.model}
    nll_path = stem.with_suffix(".nll.json")
    reports = load_partial(nll_path, settings)
    ids = text_tokens(tokenizer, longest, o.text, m.corpus_dir)
    labels = tuple(label for label in s.runs if label != "fold")
    for n in sorted(o.nll_tokens):
        if str(n) in reports:
            continue
        report = compare_methods(
            model, torch.tensor([ids[:n]], device=input_device(model)), s.chunk_size,
            methods=labels, bounded=s.bounded_configs(s.methods), stream_chunk=s.stream_chunk,
            allow_extrapolation=m.allow_extrapolation,
        )  # fmt: skip
        reports[str(n)] = report
        save_partial(nll_path, settings, reports)
    niah_path = stem.with_suffix(".niah.json")
    niah = run_niah(
        model, tokenizer, s, niah_path, prov, m.corpus_dir, m.allow_extrapolation, reused
    )
    body = [
        f"- {methods_line(s)}",
        f"- NLL over the first tokens of {o.text}; needles over depths {list(s.depths)}",
        *sources,
        "",
        "## Held-out NLL, time and peak memory",
    ]
    for n in sorted(reports, key=int):
        body += ["", f"### {n} tokens", "", *markdown_rows(reports[n])]
    body += ["", "### Peak memory against length", "", *memory_rows(reports)]
    body += ["", "## Needles", "", "string_match_all (0-100) per task, method and length:", ""]
    body += [accuracy_table(niah), f"![heatmap]({stem.name}.png)", ""]
    body += [f"![accuracy against budget]({stem.name}_budget.png)"]
    fates = fate_rows(niah.records)
    if len(fates) > 2:
        body += [
            "",
            "## Where kvm-fold put the needles' answer tokens",
            "",
            "Over layers, KV heads and the tokens that spell the (first) answer: still exact "
            "(sink or window), founded a slot, merged into another token's slot, or dropped; and "
            "how many tokens the slots they founded hold by the end.",
            "",
            *fates,
        ]
    payload = {
        "provenance": prov,
        "settings": settings,
        "nll": reports,
        "niah": json.loads(niah_path.read_text()),
    }
    title = f"longkv bounded: {m.model}, {o.dtype}"
    paths = write_report(stem, title, payload, body)
    heatmap(niah, stem.with_suffix(".png"))
    budget_plot(niah, stem.parent / f"{stem.name}_budget.png")
    nll_path.unlink()
    niah_path.unlink()
    print(accuracy_table(niah))
    print("wrote " + ", ".join(map(str, paths)) + f", {stem}.png, {stem}_budget.png")
    return 0
