"""`longkv bench routing`: how much of full attention's probability mass each bounded cache
attends exactly, by length (`longkv.caches.recall`).

For every needle prompt of the grid (the prompts of `longkv niah`: task, length, depth, seed),
full attention's probabilities at the prompt's last query (the one that predicts the answer)
come from one exact fold (`full_attention_at`); then each bounded run reads the prompt as it
reads one to answer it (`read_prompt`) and its recall of the answer's mass is measured, each
query head weighted by the mass it puts on the answer, with its recall of all of full
attention's mass and the tokens it attended exactly. For corpus text of each length, the same
at `text_queries` queries spread over its second half, read in chunks as `longkv bounded`
reads its NLL text (all mass; there is no answer). Each finished measurement is kept beside the
page (NAME.partial.json) so an interrupted run resumes; the page's files are written together
at the end. Recall needs no timing: the runs may share the machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from longkv.caches.bounded import bounded_fold, read_prompt
from longkv.caches.methods import BOUNDED, BoundedOptions, make_runner, split_table
from longkv.caches.recall import full_attention_at, head_recall, recall
from longkv.checks import require, require_at_least, require_known, setting, typed
from longkv.data.corpus import DEFAULT_TEXT, text_tokens
from longkv.dtypes import DTYPES
from longkv.evals.niah import TASKS, answer_span
from longkv.evals.niah_records import grid_cells
from longkv.evals.niah_run import build_samples
from longkv.fold.compat import input_device
from longkv.fold.fold import FOLD_CHUNK
from longkv.results import (
    OUT_DIR,
    OUT_DIR_HELP,
    finish_figure,
    load_partial,
    markdown_table,
    pyplot,
    save_partial,
    write_report,
)

# the bounded methods whose exact tokens a runner knows (SnapKV's kept tokens are not tracked)
METHODS = tuple(m for m in BOUNDED if m != "snapkv")


@dataclass(frozen=True)
class RoutingSettings(BoundedOptions):
    """`longkv bench routing`: the needle grid, the corpus text, the bounded runs."""

    tasks: tuple[str, ...] = setting(
        ("niah_single_1", "niah_single_2", "niah_multikey_1"), "needle tasks", choices=TASKS
    )
    lengths: tuple[int, ...] = setting((4096, 8192), "prompt and text lengths in tokens")
    depths: tuple[float, ...] = setting((0.25, 0.5, 0.75), "needle depths in [0, 1]")
    samples: int = setting(2, "samples per cell (task, length, depth)")
    seed: int = setting(0, "seed of the first sample; sample i uses seed + i")
    methods: tuple[str, ...] = setting(
        ("kvm-fold", "quest", "infllm"), "bounded methods measured", choices=METHODS
    )
    text_queries: int = setting(
        8, "queries of corpus text per length whose recall of all of the mass is measured"
    )
    text: str = setting(DEFAULT_TEXT, "corpus file of the text queries")
    chunk_size: int = setting(FOLD_CHUNK, "chunk of the exact fold behind full attention's mass")
    corpus_dir: str | None = setting(
        None, "corpus folder (default: $LONGKV_CORPUS_DIR, else the texts shipped with longkv)"
    )
    dtype: str = setting("fp32", "weights and activations", choices=sorted(DTYPES))
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    name: str = setting("routing", "file name stem of the results")

    def __post_init__(self) -> None:
        require_known(self, "tasks", self.tasks, TASKS)
        require_known(self, "methods", self.methods, METHODS)
        require_at_least(1, self, "lengths", "samples", "chunk_size")
        require_at_least(0, self, "text_queries")
        require(
            all(0 <= d <= 1 for d in self.depths), self, "depths",
            f"must lie in [0, 1], got {typed(self.depths)}",
        )  # fmt: skip
        self.bounded_configs(self.methods)

    @property
    def cells(self) -> list[tuple[str, int, float, int]]:
        """Every (task, length, depth, seed) of the needle grid."""
        return grid_cells(self.tasks, self.lengths, self.depths, self.seed, self.samples)


def text_positions(n: int, queries: int) -> list[int]:
    """`queries` token indices spread over the second half of n tokens, the last among them."""
    return sorted({n - 1 - i * (n // 2) // queries for i in range(queries)})


def measured(
    model: nn.Module, ids: torch.Tensor, tokens: list[int], span: tuple[int, int] | None,
    s: RoutingSettings, label: str, full: dict[int, list[torch.Tensor | None]],
) -> dict[str, Any]:  # fmt: skip
    """One bounded run `label` reading ids (1, T): a prompt, read as it is read to answer it,
    with the answer at `span` and its last token watched; or text (span None), read in chunks up
    to the last watched token. Its `recall` at each token of `tokens` (full attention's
    probabilities there: `full`), their mean, and per token and bounded layer (`layer_index`)
    the sums over query heads of `head_recall`."""
    runner = make_runner(model, s.bounded_configs(s.methods)[label])
    runner.watch = set(tokens)
    if span is not None:
        read_prompt(runner, ids, s.stream_chunk)
    else:
        bounded_fold(runner, ids[:, : max(tokens) + 1], s.stream_chunk, score=False)
    per_token, layers = [], []
    for token in tokens:
        heads = head_recall(full[token], runner.exact_tokens(token), span)
        per_token.append(recall(heads))
        layers.append({name: [round(x, 6) for x in heads[name].sum(1).tolist()] for name in heads})
    mean = {k: sum(r[k] for r in per_token) / len(per_token) for k in per_token[0]}
    index = [i for i, p in enumerate(full[tokens[0]]) if p is not None]
    return {**mean, "per_token": per_token, "layers": layers, "layer_index": index}


def run(
    model: nn.Module, tokenizer: Any, s: RoutingSettings, settings: dict[str, Any],
    corpus_dir: str | None = None, allow_extrapolation: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Every measurement of the grid and the text (`measured`), by key "task/length/depth/seed/
    label" and "text/length/label"; the finished ones are kept in NAME.partial.json beside the
    page after each (with `settings`, what they depend on) and taken from it by a rerun."""
    stem = Path(s.out_dir) / s.name
    stem.parent.mkdir(parents=True, exist_ok=True)
    partial = stem.with_suffix(".partial.json")
    parts = load_partial(partial, settings)
    labels = list(s.bounded_configs(s.methods))
    cells = [c for c in s.cells if any(f"{key(c)}/{x}" not in parts for x in labels)]
    texts = [
        n for n in s.lengths if s.text_queries and any(f"text/{n}/{x}" not in parts for x in labels)
    ]
    bar = tqdm(total=len(cells) + len(texts), desc="routing", unit="input")
    device = input_device(model)

    def measure(
        prefix: str, ids: torch.Tensor, tokens: list[int], span: tuple[int, int] | None
    ) -> None:
        full = full_attention_at(model, ids, tokens, s.chunk_size, allow_extrapolation)
        for label in labels:
            if f"{prefix}/{label}" not in parts:
                parts[f"{prefix}/{label}"] = measured(model, ids, tokens, span, s, label, full)
                save_partial(partial, settings, parts)
        bar.update()

    for cell, sample in build_samples(tokenizer, cells, corpus_dir).items():
        ids = torch.tensor([sample.input_ids], device=device)
        measure(key(cell), ids, [ids.shape[1] - 1], answer_span(tokenizer, sample))
    for n in texts:
        ids = torch.tensor([text_tokens(tokenizer, n, s.text, corpus_dir)], device=device)
        measure(f"text/{n}", ids, text_positions(n, s.text_queries), None)
    bar.close()
    return parts


def key(cell: tuple[str, int, float, int]) -> str:
    """A needle sample's key: "task/length/depth/seed"."""
    task, n, depth, seed = cell
    return f"{task}/{n}/{depth:g}/{seed}"


def collect(
    parts: dict[str, Any], s: RoutingSettings, label: str, n: int, task: str | None = None
) -> list[dict[str, Any]]:  # fmt: skip
    """The needle measurements of run `label` at length n (of one task, or all)."""
    return [
        parts[found]
        for c in s.cells
        if c[1] == n and task in (None, c[0]) and (found := f"{key(c)}/{label}") in parts
    ]


def spread(measurements: list[dict[str, Any]], name: str = "answer", spec: str = ".3f") -> str:
    """ "mean (least)" of a value of the measurements."""
    values = [m[name] for m in measurements]
    return f"{sum(values) / len(values):{spec}} ({min(values):{spec}})"


def by_length(
    parts: dict[str, Any], s: RoutingSettings, cell: Callable[[list[dict[str, Any]]], str],
    task: str | None = None, what: str = "",
) -> list[str]:  # fmt: skip
    """Markdown: a row per run, a column per length (headed `what` first), cell(its needle
    measurements there)."""
    rows = []
    for label in s.bounded_configs(s.methods):
        found = [collect(parts, s, label, n, task) for n in s.lengths]
        rows.append([label, *(cell(f) if f else "-" for f in found)])
    head = ["run", *(f"{what}, {n} tokens" if what else f"{n} tokens" for n in s.lengths)]
    return markdown_table(head, rows, "<" + ">" * len(s.lengths))


def text_cell(parts: dict[str, Any], label: str, n: int) -> str:
    """The mean mass recall of a run's text queries at length n ("-" where not measured)."""
    found = parts.get(f"text/{n}/{label}")
    return "-" if found is None else f"{found['mass']:.3f}"


def layer_rows(parts: dict[str, Any], s: RoutingSettings, n: int) -> list[str]:
    """Markdown: per bounded layer, at length n over the needle samples, the layer's share of
    the answer's mass under full attention and each run's answer recall there (its exact mass
    over its mass, summed over samples and heads)."""
    labels = [label for label in s.bounded_configs(s.methods) if collect(parts, s, label, n)]
    if not labels:
        return []
    first = collect(parts, s, labels[0], n)
    index = first[0]["layer_index"]
    mass = [sum(m["layers"][0]["answer"][i] for m in first) for i in range(len(index))]
    total = sum(mass) or 1.0
    rows = [[str(layer), f"{100 * a / total:.1f} %"] for layer, a in zip(index, mass, strict=True)]
    for label in labels:
        found = collect(parts, s, label, n)
        for i, row in enumerate(rows):
            answer = sum(m["layers"][0]["answer"][i] for m in found)
            exact = sum(m["layers"][0]["answer_exact"][i] for m in found)
            row.append(f"{exact / answer:.3f}" if answer > 0 else "-")
    header = ["layer", "answer mass", *labels]
    return markdown_table(header, rows, "<" + ">" * (len(labels) + 1))


def routing_plot(parts: dict[str, Any], s: RoutingSettings, path: Path, title: str) -> None:
    """Two panels against length, one line per run: the answer recall at the needle prompts'
    last query (the mean, a band down to the least), and the mass recall at the text
    queries."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in s.bounded_configs(s.methods):
        found = {n: collect(parts, s, label, n) for n in s.lengths}
        lengths = [n for n in s.lengths if found[n]]
        means = [sum(m["answer"] for m in found[n]) / len(found[n]) for n in lengths]
        lows = [min(m["answer"] for m in found[n]) for n in lengths]
        (line,) = left.plot(lengths, means, marker="o", label=label)
        left.fill_between(lengths, lows, means, color=line.get_color(), alpha=0.15)
        text = [n for n in s.lengths if f"text/{n}/{label}" in parts]
        mass = [parts[f"text/{n}/{label}"]["mass"] for n in text]
        right.plot(text, mass, marker="o", label=label, color=line.get_color())
    panels = ((left, "answer recall, needle prompts' last query"), (right, "mass recall, text"))
    for ax, what in panels:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(what)
        ax.axhline(0.95, color="gray", linewidth=0.8, linestyle="--")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    finish_figure(fig, path, title)


def write_page(
    parts: dict[str, Any], s: RoutingSettings, payload: dict[str, Any], title: str
) -> list[Path]:  # fmt: skip
    """stem.{json,md,png}: what each run attends, the answer recall by length (all tasks, then
    per task), the mass recall and the tokens attended exactly, the answer recall per layer at
    the longest length, and the plot; written together (`write_report`)."""
    configs = s.bounded_configs(s.methods)
    longest = max(s.lengths)
    body = [
        f"- needle prompts: {', '.join(s.tasks)} at depths {typed(s.depths)}, {s.samples} "
        f"sample(s) per cell; text: {s.text_queries} queries over the second half of the first "
        f"tokens of {s.text}; bounded caches read in chunks of {s.stream_chunk}, full "
        f"attention's mass from the exact fold in chunks of {s.chunk_size}",
        "",
        "## What each run attends",
        "",
        "Per layer and KV head: the sinks and the exact window, the middle (two-level "
        "KVM-Fold's slot read-outs), and the most leaves a query opens exactly beside them (a "
        "prefill chunk's queries together per KV head, a decoded token per query head).",
        "",
        *split_table(configs),
        "",
        "## Answer recall",
        "",
        "At the needle prompts' last query (the one that predicts the answer), over the bounded "
        "layers: the share of full attention's mass on the answer's tokens that the cache "
        "attends exactly, each query head weighted by the mass it puts on the answer; the mean "
        "over the needle samples, the least in brackets.",
        "",
        *by_length(parts, s, spread),
    ]
    for task in s.tasks:
        body += ["", f"### {task}", "", *by_length(parts, s, spread, task)]
    body += [
        "",
        "## Mass recall and exact entries",
        "",
        "The share of all of full attention's mass that the cache attends exactly (the mean "
        "over query heads and bounded layers), at the needle prompts' last query (mean, least) "
        "and at the text queries (mean); then the tokens a query attends exactly (mean per head "
        "and bounded layer).",
        "",
        *by_length(parts, s, lambda f: spread(f, "mass")),
        "",
        *markdown_table(
            ["run", *(f"text, {n} tokens" for n in s.lengths)],
            [[label, *(text_cell(parts, label, n) for n in s.lengths)] for label in configs],
            "<" + ">" * len(s.lengths),
        ),
        "",
        *by_length(parts, s, lambda f: spread(f, "entries", ".0f"), what="exact entries"),
        "",
        f"## Answer recall per layer at {longest} tokens",
        "",
        "Each bounded layer's share of full attention's mass on the answer (over its query "
        "heads and the needle samples), and each run's answer recall in that layer.",
        "",
        *layer_rows(parts, s, longest),
    ]
    stem = Path(s.out_dir) / s.name
    return write_report(stem, title, payload, body, lambda png: routing_plot(parts, s, png, title))
