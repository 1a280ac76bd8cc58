"""A niah run on its page: the methods and their options, the accuracy table, whether the fold
answered as full attention did, the heatmap over depth and length, and the score against each
bounded method's budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from longkv.caches.methods import describe_runs, split_label
from longkv.evals.niah_records import (
    NiahRecord,
    NiahRun,
    NiahSettings,
    accuracy,
    fold_mismatches,
    mean_scores,
)
from longkv.fold.variants import VARIANTS
from longkv.results import (
    markdown_table,
    provenance_lines,
    pyplot,
    replaced_together,
    save_figure,
)


def accuracy_table(run: NiahRun) -> str:
    """Markdown: rows task x method, columns lengths, cells string_match_all over depths."""
    s, acc = run.settings, accuracy(run.records)
    rows = []
    for task in s.tasks:
        for method in s.runs:
            cells = [acc.get(f"{task}/{method}/{n}") for n in s.lengths]
            known = [c for c in cells if c is not None]
            mean = f"{sum(known) / len(known):.1f}" if known else ""
            shown = ["" if c is None else f"{c:.1f}" for c in cells]
            rows.append([task, method, *shown, mean])
    header = ["task", "method", *(f"{n} tokens" for n in s.lengths), "mean"]
    lines = markdown_table(header, rows, "<<" + ">" * (len(s.lengths) + 1))
    return "\n".join(lines) + "\n"


def accuracy_caption(run: NiahRun) -> str:
    """What `accuracy_table`'s cells are: the score, and the depths it is a mean over."""
    depths = ", ".join(map(str, run.settings.depths))
    return (
        "string_match_all (0-100: the share of a sample's answers found in the reply) per task, "
        f"method and context length, the mean over depths {depths}:"
    )


def label_colour(score: float) -> str:
    """The colour of a score's label on its heatmap cell (RdYlGn, 0-100): white on the dark
    red and green ends, black on the light middle."""
    return "white" if score < 20 or score > 80 else "black"


def heatmap(run: NiahRun, path: Path, title: str) -> None:
    """One panel per task and method: score (0-100) over depth (rows) x length (columns), under
    `title` (the model and dtype)."""
    plt = pyplot()
    s = run.settings
    scores = mean_scores(run.records, lambda r: (r.task, r.method, r.depth, r.context_len))
    rows, cols = len(s.tasks), len(s.runs)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(3.2 * cols + 1.2, 2.6 * rows + 0.8),
        squeeze=False,
        layout="constrained",
    )
    for i, task in enumerate(s.tasks):
        for j, method in enumerate(s.runs):
            grid = torch.tensor(
                [[scores.get((task, method, d, n), float("nan")) for n in s.lengths]
                 for d in s.depths]
            )  # fmt: skip
            ax = axes[i][j]
            image = ax.imshow(grid.numpy(), vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(
                range(len(s.lengths)),
                [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in s.lengths],
            )
            ax.set_yticks(range(len(s.depths)), [f"{d:g}" for d in s.depths])
            for a in range(len(s.depths)):
                for b in range(len(s.lengths)):
                    value = float(grid[a, b])
                    if value == value:  # not NaN: a cell that was answered
                        ax.text(b, a, f"{value:.0f}", ha="center", va="center", fontsize=8,
                                color=label_colour(value))  # fmt: skip
            ax.set_title(f"{task} / {method}", fontsize=9)
            if i == rows - 1:
                ax.set_xlabel("context length")
            if j == 0:
                ax.set_ylabel("needle depth")
    fig.colorbar(image, ax=axes, shrink=0.8, label="string_match_all")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=100)


def budget_plot(run: NiahRun, path: Path) -> None:
    """One panel per task: score (0-100, over lengths and depths) against the budget of each
    bounded method, the unbounded methods as horizontal lines."""
    plt = pyplot()
    s = run.settings
    scores = mean_scores(run.records, lambda r: (r.task, r.method))
    fig, axes = plt.subplots(
        1, len(s.tasks), figsize=(4.2 * len(s.tasks), 3.4), squeeze=False, layout="constrained"
    )
    budgets = sorted(s.budgets)
    for ax, task in zip(axes[0], s.tasks, strict=True):
        lines: dict[str, list[tuple[int, float]]] = {}
        for label in s.runs:
            name, budget = split_label(label)
            score = scores.get((task, label))
            if score is None:
                continue
            if budget is None:
                ax.axhline(score, linestyle="--", color="gray" if name == "full" else "black",
                           label=name)  # fmt: skip
            else:
                lines.setdefault(name, []).append((budget, score))
        for name, points in lines.items():
            points.sort()
            ax.plot([b for b, _ in points], [v for _, v in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_ylim(-5, 105)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("entries per layer and KV head")
        ax.set_ylabel("string_match_all")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    save_figure(fig, path)


def verdict(records: list[NiahRecord]) -> list[str]:
    """Whether the fold answered as full attention did: one line, or none if not both ran."""
    mismatches = fold_mismatches(records)
    if mismatches is None:
        return []
    if not mismatches:
        return ["The fold's answers equal full attention's on every sample."]
    return [
        f"The fold's answers differ from full attention's on {len(mismatches)} samples: "
        f"{mismatches}"
    ]


def methods_line(s: NiahSettings) -> str:
    """The methods that ran and their options, for the page."""
    variant = "" if s.variant == "exact" else f", variant {s.variant}: {VARIANTS[s.variant]}"
    options = {"full": "full attention", "fold": f"KV-Fold in chunks of {s.chunk_size}{variant}"}
    said = [options[m] for m in s.methods if m in options]
    if said and s.exact_up_to:
        said[-1] += f" (up to {s.exact_up_to} tokens)"
    bounded = s.bounded_configs(s.methods)
    if bounded:
        said.append(f"bounded caches read in chunks of {s.stream_chunk}: {describe_runs(bounded)}")
    return (
        "; ".join(said)
        + f"; greedy, at most {s.max_new_tokens} new tokens; {s.samples} sample(s) per cell"
    )


def write_niah_page(
    run: NiahRun, stem: Path, title: str, prov: dict[str, Any], sources: list[str] | None = None
) -> list[Path]:
    """stem.json (the run), stem.md (the methods, where reused answers came from (`sources`,
    lines), the accuracy table, the fold's verdict) and stem.png (the heatmap), replaced
    together (`replaced_together`); returns the three paths."""
    said = verdict(run.records)
    page = [
        f"# {title}",
        "",
        *provenance_lines(prov),
        f"- {methods_line(run.settings)}",
        *(sources or []),
        "",
        accuracy_caption(run),
        "",
        accuracy_table(run),
        *said,
        *([""] if said else []),
        f"![heatmap]({stem.name}.png)",
    ]
    paths = [stem.with_suffix(suffix) for suffix in (".json", ".md", ".png")]
    with replaced_together(paths) as (json_tmp, md_tmp, png_tmp):
        run.save(json_tmp)
        md_tmp.write_text("\n".join(page) + "\n")
        heatmap(run, png_tmp, title)
    return paths
