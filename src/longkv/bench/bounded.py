"""Bounded caches of a frozen model against full attention, on one page (`longkv bounded`).

For every method run (full attention, and each bounded method at each budget): the held-out
NLL, its gap to full attention, time and peak memory over corpus text at each length
(`longkv.bench.compare`), and needle-in-a-haystack answers over the grid
(`longkv.evals.niah_run`), with where kvm-fold put the tokens of each needle's answer. The NLL
reports are kept in a partial file after every length, so an interrupted run resumes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from longkv.bench.compare import Timing, compare_methods, markdown_rows, optional
from longkv.caches.methods import split_table
from longkv.evals.niah_records import NiahRecord, NiahRun, NiahSettings
from longkv.evals.niah_report import accuracy_table, budget_plot, heatmap, methods_line
from longkv.results import (
    finish_figure,
    load_partial,
    markdown_table,
    pyplot,
    replaced_together,
    report_texts,
    save_partial,
)

FATES = ("exact", "founded", "merged", "dropped")


def bounded_nll(
    model: nn.Module, ids: torch.Tensor, s: NiahSettings, lengths: tuple[int, ...],
    partial: Path, settings: dict[str, Any], allow_extrapolation: bool = False,
    timing: Timing = Timing(),  # noqa: B008 (frozen)
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """`compare_methods` of every run of s at n (`NiahSettings.runs_at`: the fold in chunks of
    s.chunk_size; full attention the reference up to s.exact_up_to, none past it) over the
    first n tokens of ids (1, T), by n in lengths, timed as `timing` says; each finished length
    is kept in `partial` (with `settings`, what it depends on), so a rerun measures only the
    lengths it lacks."""
    reports = load_partial(partial, settings)
    for n in sorted(lengths):
        if str(n) in reports:
            continue
        reports[str(n)] = compare_methods(
            model, ids[:, :n], s.chunk_size, methods=tuple(s.runs_at(n)),
            reference=n <= s.exact_or_any,
            bounded=s.bounded_configs(s.methods), stream_chunk=s.stream_chunk,
            allow_extrapolation=allow_extrapolation, repeats=timing.repeats,
            decode_tokens=timing.decode_tokens,
        )  # fmt: skip
        save_partial(partial, settings, reports)
    return reports


def length_rows(
    nll: dict[str, Any], value: Callable[[dict[str, Any], int], float | None], what: str,
    spec: str = ".1f",
) -> list[str]:  # fmt: skip
    """Markdown: value(run, n) of each method's run (`MethodRun`) at each length n (formatted by
    spec; "-" where the method did not run at n, "n/a" where value is None), and longest /
    shortest; `what` names the values in the header."""
    lengths = sorted(nll, key=int)
    values: dict[str, dict[str, float | None]] = {}
    for n in lengths:
        for r in nll[n]["runs"]:
            values.setdefault(r["method"], {})[n] = value(r, int(n))
    rows = []
    for method, by_length in values.items():
        held = [by_length.get(n) for n in lengths]
        shown = [
            "-" if n not in by_length else optional(v, spec, "n/a")
            for n, v in zip(lengths, held, strict=True)
        ]
        first, last = held[0], held[-1]
        ratio = "n/a" if not first or last is None else f"{last / first:.2f}"
        rows.append([method, *shown, ratio])
    header = ["method", *(f"{what} at {n}" for n in lengths), f"{lengths[-1]} / {lengths[0]}"]
    return markdown_table(header, rows, "<" + ">" * (len(lengths) + 1))


def mib(key: str) -> Callable[[dict[str, Any], int], float | None]:
    """A run's bytes `key` in MiB (None where not measured), for `length_rows`."""
    return lambda run, n: None if run.get(key) is None else run[key] / 2**20


def per_1k(run: dict[str, Any], n: int) -> float:
    """A run's seconds per 1024 tokens of its n, for `length_rows`."""
    return run["seconds"] * 1024 / n


def cost_plot(nll: dict[str, Any], path: Path, title: str) -> None:
    """One panel per length full attention ran at: each method's NLL gap to it against the
    entries its last chunk's queries attended (mean share of full attention's), labelled by
    method; a ValueError if it ran at none."""
    plt = pyplot()
    lengths = [n for n in sorted(nll, key=int) if nll[n]["runs"][0]["method"] == "full"]
    if not lengths:
        raise ValueError("full attention ran at none of the lengths: there is no NLL gap to plot")
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths), 4.2), squeeze=False)
    for ax, n in zip(axes[0], lengths, strict=True):
        for r in nll[n]["runs"]:
            x, y = 100 * r["attended_share"], r["nll_gap_vs_full"]
            ax.scatter([x], [y], s=22)
            ax.annotate(r["method"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{n} tokens", fontsize=9)
        ax.set_xlabel("entries attended by the last chunk's queries (% of full attention's)")
        ax.set_ylabel("NLL gap to full attention (nats)")
    finish_figure(fig, path, title)


def by_outcome(
    records: list[NiahRecord], key: str
) -> dict[tuple[str, bool], list[dict[str, float]]]:
    """The needle fates that hold `key`, by (method, answered right), sorted."""
    groups: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for r in records:
        if r.needle_fate is not None and key in r.needle_fate:
            groups.setdefault((r.method, r.score == 1.0), []).append(r.needle_fate)
    return dict(sorted(groups.items()))


def section(title: str, intro: str, table: list[str]) -> list[str]:
    """Page lines of a section: its heading, a paragraph, its table; none for a table with
    no rows (a header and its rule only)."""
    return ["", f"## {title}", "", intro, "", *table] if len(table) > 2 else []


def fate_rows(records: list[NiahRecord]) -> list[str]:
    """Markdown: where each kvm-fold run put the tokens of the needles' answers, over the
    samples it answered right and those it missed."""
    rows = []
    for (method, right), fates in by_outcome(records, "exact").items():
        cells = [f"{100 * sum(f[k] for f in fates) / len(fates):.1f} %" for k in FATES]
        # over the samples where the answer founded slots at all (their mean is 0 elsewhere)
        sizes = [f["founded_slot_tokens"] for f in fates if f["founded"] > 0]
        size = f"{sum(sizes) / len(sizes):.1f}" if sizes else "-"
        rows.append([method, "yes" if right else "no", str(len(fates)), *cells, size])
    header = ["method", "answered", "samples", *FATES, "tokens per founded slot"]
    return markdown_table(header, rows, "<<>" + ">" * (len(FATES) + 1))


def route_cells(routes: list[dict[str, float]]) -> list[str]:
    """Over needle routes (`RetrievalRunner.needle_route`): the share of answer tokens that had
    left the window, of those the share routed, and the median of their units' median ranks."""
    left = sum(x["left"] for x in routes) / len(routes)
    gone = [x for x in routes if "routed" in x]  # some answer tokens had left the window
    routed = f"{100 * sum(x['routed'] for x in gone) / len(gone):.1f} %" if gone else "-"
    ranks = sorted(x["slot_rank"] for x in gone)
    return [f"{100 * left:.1f} %", routed, f"{ranks[len(ranks) // 2]:g}" if ranks else "-"]


ROUTE_HEADER = ["left the window", "routed", "unit rank"]


def route_rows(records: list[NiahRecord]) -> list[str]:
    """Markdown: how each retrieval cache's last prompt query routed to the answer's tokens
    (`route_cells`), over the samples each run answered right and those it missed."""
    rows = [
        [method, "yes" if right else "no", str(len(routes)), *route_cells(routes)]
        for (method, right), routes in by_outcome(records, "left").items()
    ]
    return markdown_table(["method", "answered", "samples", *ROUTE_HEADER], rows, "<<>>>>")


def miss_rows(records: list[NiahRecord]) -> list[str]:
    """Markdown: every sample a retrieval cache missed where full attention answered, with its
    answer and how its last prompt query routed to the answer's tokens (`route_cells`)."""
    answered = {r.key[:4] for r in records if r.method == "full" and r.score == 1.0}
    rows = [
        [r.method, r.task, str(r.context_len), f"{r.depth:g}", str(r.seed),
         repr(r.prediction.strip()[:24]), *route_cells([r.needle_fate])]
        for r in sorted(records, key=lambda r: (r.method, r.key))
        if r.needle_fate is not None and "left" in r.needle_fate and r.score < 1.0
        and r.key[:4] in answered
    ]  # fmt: skip
    header = ["method", "task", "length", "depth", "seed", "answer", *ROUTE_HEADER]
    return markdown_table(header, rows, "<<>>><>>>")


def write_bounded_page(
    stem: Path, title: str, payload: dict[str, Any], reports: dict[str, dict[str, Any]],
    niah: NiahRun, text: str, sources: list[str],
) -> list[Path]:  # fmt: skip
    """stem.{json,md,png}, stem_budget.png and stem_cost.png: the NLL reports by length, peak
    memory and the cache against length, the NLL gap against the entries attended, the needles,
    where kvm-fold put their answers, how the retrieval caches routed to them and which they
    missed; payload (with the provenance) is the JSON. The five are replaced together
    (`replaced_together`); returns their paths."""
    s = niah.settings
    body = [
        f"- {methods_line(s)}",
        f"- NLL over the first tokens of {text}; needles over depths {list(s.depths)}",
        *sources,
    ]
    bounded = s.bounded_configs(s.methods)
    if bounded:
        body += [
            "",
            "## What each bounded run attends",
            "",
            "Per layer and KV head: the sinks, the exact window, the middle (two-level "
            "KVM-Fold's slot read-outs, SnapKV's kept tokens) and the most leaves a query opens "
            "exactly beside them, and so the most exact entries a query attends.",
            "",
            *split_table(bounded),
        ]
    body += ["", "## Held-out NLL, time and peak memory"]
    for n in sorted(reports, key=int):
        body += ["", f"### {n} tokens", "", *markdown_rows(reports[n])]
    body += ["", "### Peak memory against length", ""]
    body += length_rows(reports, mib("peak_memory_bytes"), "peak MiB")
    body += ["", "### Time per 1K tokens against length", ""]
    body += length_rows(reports, per_1k, "seconds per 1K", ".2f")
    body += ["", "### The cache after the read against length", ""]
    body += ["The bounded part of a bounded cache (two-level KVM-Fold's leaves apart); full "
             "attention's every key and value.", ""]  # fmt: skip
    body += length_rows(reports, mib("cache_bytes"), "cache MiB")
    body += ["", "### NLL gap against the entries attended", "", f"![cost]({stem.name}_cost.png)"]
    body += ["", "## Needles", "", "string_match_all (0-100) per task, method and length:", ""]
    body += [accuracy_table(niah), f"![heatmap]({stem.name}.png)", ""]
    body += [f"![accuracy against budget]({stem.name}_budget.png)"]
    body += section(
        "Where kvm-fold put the needles' answer tokens",
        "Over layers, KV heads and the tokens that spell the (first) answer: still exact (sink "
        "or window), founded a slot, merged into another token's slot, or dropped; and how many "
        "tokens the slots they founded hold by the end.",
        fate_rows(niah.records),
    )
    body += section(
        "How the retrieval caches routed to the needles' answer tokens",
        "At the prompt's last query (the one that predicts the answer), over layers and query "
        "heads: the share of the answer's tokens that had left the window, of those the share "
        "whose unit (two-level's slot, Quest's page, InfLLM's block) the head opened, and the "
        "median rank of their units (0: the head's best).",
        route_rows(niah.records),
    )
    body += section(
        "The needles the retrieval caches missed where full attention answered",
        "Each such sample, what the cache answered and how its last prompt query routed to the "
        "answer's tokens (as above, for that sample alone).",
        miss_rows(niah.records),
    )
    paths = [stem.with_suffix(suffix) for suffix in (".json", ".md", ".png")]
    paths += [stem.parent / f"{stem.name}_{plot}.png" for plot in ("budget", "cost")]
    with replaced_together(paths) as (json_tmp, md_tmp, png_tmp, budget_tmp, cost_tmp):
        json_text, md_text = report_texts(title, payload, body)
        json_tmp.write_text(json_text)
        md_tmp.write_text(md_text)
        heatmap(niah, png_tmp, title)
        budget_plot(niah, budget_tmp)
        cost_plot(reports, cost_tmp, title)
    return paths
