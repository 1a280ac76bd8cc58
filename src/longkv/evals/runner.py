"""Needle-in-a-haystack over lengths x depths x methods: full attention, KV-Fold and the bounded
caches (StreamingLLM, SnapKV, KVM-Fold at each budget).

Every method answers the same prompt by greedy decoding: `full` from one pass over the whole
prompt, `fold` from a fold in chunks, a bounded method (labelled like `kvm-fold/sqrt@1024`,
`longkv.fold.methods`) from its cache after reading the prompt in chunks. Records are written
to the JSON file after every answer (atomically), and a rerun with the same settings reuses
those of an unfinished grid, so an interrupted grid loses nothing; a finished grid (such as a
committed result) is run again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from longkv.checks import SettingError, require, require_at_least, setting
from longkv.evals.niah import (
    ANSWER_BUDGET,
    TASKS,
    NiahSample,
    answer_span,
    make_sample,
    sample_score,
)
from longkv.fold.bounded import bounded_generate
from longkv.fold.fold import CLI_SWITCH, check_foldable, position_refusal
from longkv.fold.generate import fold_generate
from longkv.fold.kvm_cache import KVMFoldRunner
from longkv.fold.methods import (
    BOUNDED,
    METHODS,
    BoundedOptions,
    make_runner,
    method_of,
    split_label,
)
from longkv.fold.variants import (
    VARIANT_HELP,
    VARIANTS,
    check_variant,
    inserted_positions,
    require_variants,
)
from longkv.results import pyplot, save_figure, write_atomic


@dataclass(frozen=True)
class NiahSettings(BoundedOptions):
    """The grid, the methods and their options."""

    tasks: tuple[str, ...] = setting(("niah_single_2",), "needle tasks", choices=TASKS)
    lengths: tuple[int, ...] = setting(
        (4096,), "context lengths in tokens (prompt and answer budget)"
    )
    depths: tuple[float, ...] = setting((0.1, 0.5, 0.9), "needle depths in [0, 1]")
    methods: tuple[str, ...] = setting(
        ("full", "fold", "streaming"), "methods that answer", choices=METHODS
    )
    samples: int = setting(1, "samples per cell (task, length, depth)")
    seed: int = setting(0, "seed of the first sample; sample i uses seed + i")
    chunk_size: int = setting(1024, "fold chunk (tokens)")
    variant: str = setting("exact", "method fold: " + VARIANT_HELP, choices=VARIANTS)
    max_new_tokens: int = setting(32, "greedy answer tokens at most")

    def __post_init__(self) -> None:
        for name, values, allowed in (
            ("tasks", self.tasks, TASKS),
            ("methods", self.methods, METHODS),
        ):
            unknown = sorted(set(values) - set(allowed))
            require(
                not unknown,
                f"NiahSettings.{name}",
                f"unknown {unknown}; choose from {list(allowed)}",
            )
        at_least_one = ("lengths", "samples", "chunk_size", "max_new_tokens")
        require_at_least(1, "NiahSettings", self, *at_least_one)
        require_variants("NiahSettings.variant", self.variant)
        require(
            all(0 <= d <= 1 for d in self.depths),
            "NiahSettings.depths",
            f"must lie in [0, 1], got {self.depths}",
        )
        self.bounded_configs(self.methods)

    @property
    def runs(self) -> list[str]:
        """The label of every method run (`BoundedOptions.labels`)."""
        return self.labels(self.methods)


@dataclass(frozen=True)
class NiahRecord:
    """One method's answer to one sample."""

    task: str
    context_len: int
    depth: float
    seed: int
    method: str
    answers: list[str]
    prediction: str
    tokens: list[int]
    score: float
    seconds: float
    # kvm-fold: where the tokens spelling the first answer went (`KVMFoldRunner.fates`)
    needle_fate: dict[str, float] | None = None

    @property
    def key(self) -> tuple[str, int, float, int, str]:
        return (self.task, self.context_len, self.depth, self.seed, self.method)


@dataclass
class NiahRun:
    settings: NiahSettings
    records: list[NiahRecord] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        payload = {
            "provenance": self.provenance,
            "settings": asdict(self.settings),
            "records": [asdict(r) for r in self.records],
            "accuracy": accuracy(self.records),
        }
        mismatches = fold_mismatches(self.records)
        if mismatches is not None:  # only where both answered
            payload["fold_equals_full"] = mismatches == []
        write_atomic(path, json.dumps(payload, indent=2) + "\n")

    @classmethod
    def resume(cls, path: Path, settings: NiahSettings) -> list[NiahRecord]:
        """Records of an earlier run with the same settings at path (none if it differs)."""
        if not path.is_file():
            return []
        data = json.loads(path.read_text())
        if saved_settings(data) != json.loads(json.dumps(asdict(settings))):
            return []
        return [NiahRecord(**r) for r in data["records"]]


def saved_settings(data: dict[str, Any]) -> dict[str, Any]:
    """The settings of a niah result file (`NiahRun.save`), with the default of any setting
    added after the file was written."""
    defaults = {f.name: f.default for f in fields(NiahSettings)}
    return {**json.loads(json.dumps(defaults)), **data.get("settings", {})}


def answer(
    model: nn.Module,
    ids: torch.Tensor,
    method: str,
    s: NiahSettings,
    eos: int | None,
    allow_extrapolation: bool = False,
    span: tuple[int, int] | None = None,
) -> tuple[list[int], dict[str, float] | None]:
    """Greedy answer tokens of one method run (a label of `s.runs`) to the prompt ids (1, T),
    and for kvm-fold where the tokens of `span` went (`KVMFoldRunner.fates`; else None).

    allow_extrapolation lets full and fold run a RoPE model past its max_position_embeddings
    (`fold_generate`)."""
    n, fate = s.max_new_tokens, None
    if method in ("full", "fold"):
        size, variant = (ids.shape[1], "exact") if method == "full" else (s.chunk_size, s.variant)
        out = fold_generate(
            model, ids, size, n, eos_token_id=eos, allow_extrapolation=allow_extrapolation,
            variant=variant,
        )  # fmt: skip
    else:
        runner = make_runner(model, s.bounded_configs(s.methods)[method], track=True)
        out = bounded_generate(runner, ids, s.stream_chunk, n, eos_token_id=eos)
        if isinstance(runner, KVMFoldRunner) and span is not None:
            fate = runner.fates(*span)
    tokens = out[0].tolist()
    return tokens[: tokens.index(eos)] if eos is not None and eos in tokens else tokens, fate


def run_niah(
    model: nn.Module,
    tokenizer: Any,
    s: NiahSettings,
    path: Path,
    provenance: dict[str, Any] | None = None,
    corpus_dir: str | None = None,
    allow_extrapolation: bool = False,
    reuse: list[NiahRecord] | None = None,
) -> NiahRun:
    """Answer every sample of the grid with every method; save after each answer.

    The whole grid is checked first (`check_grid`, then every prompt is built), so a setting
    the model or a task cannot run fails before the first answer. allow_extrapolation lets
    full attention and the fold run a RoPE model past its max_position_embeddings. reuse:
    answers given elsewhere to this grid (`reusable_records`), taken instead of answering.
    """
    cells = [
        (task, n, d, s.seed + i)
        for task in s.tasks
        for n in s.lengths
        for d in s.depths
        for i in range(s.samples)
    ]
    runs = s.runs
    saved = NiahRun.resume(path, s)
    if len(saved) == len(cells) * len(runs):  # finished: measure again
        saved = []
    known = {r.key for r in saved}
    saved += [r for r in reuse or [] if r.key not in known]
    run = NiahRun(settings=s, records=saved, provenance=provenance or {})
    done = {r.key for r in run.records}
    todo = {c: [m for m in runs if (*c, m) not in done] for c in cells}
    check_grid(model, s, allow_extrapolation)
    samples = build_samples(tokenizer, [c for c in cells if todo[c]], corpus_dir)
    eos = getattr(tokenizer, "eos_token_id", None)
    progress = tqdm(total=len(cells) * len(runs) - len(done), desc="niah", unit="answer")
    for (task, n, d, seed), sample in samples.items():
        ids = torch.tensor([sample.input_ids], device=model.get_input_embeddings().weight.device)
        span = answer_span(tokenizer, sample)
        for method in todo[(task, n, d, seed)]:
            t0 = time.perf_counter()
            tokens, fate = answer(model, ids, method, s, eos, allow_extrapolation, span)
            prediction = tokenizer.decode(tokens, skip_special_tokens=True)
            run.records.append(
                NiahRecord(
                    task=task,
                    context_len=n,
                    depth=d,
                    seed=seed,
                    method=method,
                    answers=list(sample.answers),
                    prediction=prediction,
                    tokens=tokens,
                    score=sample_score(prediction, sample.answers),
                    seconds=time.perf_counter() - t0,
                    needle_fate=fate,
                )
            )
            run.save(path)
            progress.update()
    progress.close()
    run.save(path)
    return run


# the settings that choose which methods run; the others must agree for answers to be reused
RUN_FIELDS = ("methods", "budgets", "kvm_states")
# settings that only some methods read: a difference in one keeps the other methods' answers
ONLY_FOR = {
    "chunk_size": ("fold",),
    "variant": ("fold",),
    "sinks": BOUNDED,
    "stream_chunk": BOUNDED,
    "window": ("snapkv", "kvm-fold"),
    **{f.name: ("kvm-fold",) for f in fields(BoundedOptions) if f.name.startswith("kvm_")},
}


def reusable_records(path: Path, s: NiahSettings) -> tuple[list[NiahRecord], dict[str, Any]]:
    """The answers in a niah result file (`NiahRun.save`) to runs of this grid, and the file's
    provenance; a SettingError if the file's grid, or an option that one of its runs here
    reads (`ONLY_FOR`), differs from these."""
    data = json.loads(path.read_text())
    ours = json.loads(json.dumps(asdict(s)))
    theirs = saved_settings(data)
    runs = set(s.runs)
    records = [NiahRecord(**r) for r in data["records"] if r["method"] in runs]
    methods = {method_of(r.method) for r in records}
    differ = sorted(
        k
        for k in ours
        if k not in RUN_FIELDS
        and theirs[k] != ours[k]
        and (k not in ONLY_FOR or methods & set(ONLY_FOR[k]))
    )
    require(
        not differ,
        "NiahSettings.methods",
        f"{path} answered another grid or other method options ({differ} differ); its answers "
        "cannot be reused",
    )
    return records, data.get("provenance", {})


def check_grid(model: nn.Module, s: NiahSettings, allow_extrapolation: bool = False) -> None:
    """SettingError (naming the setting to change) if the model cannot run the grid's methods
    at its lengths; ValueError if it cannot run a method at all. Nothing is run.

    Full attention and the fold run past max_position_embeddings only on a RoPE model with
    allow_extrapolation (`position_refusal`); a bounded cache never does."""
    if {"full", "fold"} & set(s.methods):
        # the prompt (length - ANSWER_BUDGET tokens), then all but the last answer token
        n = max(s.lengths)
        needed = n - ANSWER_BUDGET + s.max_new_tokens - 1
        inserted = (
            inserted_positions(s.variant, n - ANSWER_BUDGET, s.chunk_size)
            if "fold" in s.methods
            else 0
        )
        needed += inserted
        what = "the prompt, then the answer" + (
            ", and the fold's BOS before every chunk" if inserted else ""
        )
        refusal = position_refusal(
            model, needed, allow_extrapolation=allow_extrapolation, switch=CLI_SWITCH
        )
        require(
            refusal is None,
            "NiahSettings.lengths",
            f"{n} takes {needed} positions under full attention and the fold ({what}), {refusal}",
        )
        if "fold" in s.methods:
            check_variant(s.variant, model)
        check_foldable(model, needed, allow_extrapolation=allow_extrapolation)
    s.check_runs(model, s.methods)


def build_samples(
    tokenizer: Any, cells: list[tuple[str, int, float, int]], corpus_dir: str | None = None
) -> dict[tuple[str, int, float, int], NiahSample]:
    """The sample of every cell (task, length, depth, seed); a length too short for its task is
    a SettingError on `lengths`."""
    samples = {}
    for task, n, d, seed in tqdm(cells, desc="prompts", unit="prompt", leave=False):
        try:
            samples[(task, n, d, seed)] = make_sample(
                task, tokenizer, n, d, seed, corpus_dir=corpus_dir
            )
        except ValueError as err:
            raise SettingError("NiahSettings.lengths", f"{n} for {task}: {err}") from err
    return samples


def mean_scores(records: list[NiahRecord], key: Callable[[NiahRecord], Any]) -> dict[Any, float]:
    """string_match_all (0-100) of the records grouped by key(record)."""
    groups: dict[Any, list[float]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r.score)
    return {k: 100 * sum(v) / len(v) for k, v in groups.items()}


def accuracy(records: list[NiahRecord]) -> dict[str, float]:
    """string_match_all (0-100) per "task/method/length", over depths and samples."""
    return dict(
        sorted(mean_scores(records, lambda r: f"{r.task}/{r.method}/{r.context_len}").items())
    )


def fold_mismatches(records: list[NiahRecord]) -> list[tuple[str, int, float, int]] | None:
    """Samples where the fold's answer tokens differ from full attention's, among the samples
    both answered; None if there is no such sample (nothing was compared)."""
    tokens = {r.key: r.tokens for r in records}
    both = [r for r in records if r.method == "fold" and (*r.key[:4], "full") in tokens]
    if not both:
        return None
    return [r.key[:4] for r in both if tokens[(*r.key[:4], "full")] != r.tokens]


def accuracy_table(run: NiahRun) -> str:
    """Markdown: rows task x method, columns lengths, cells string_match_all over depths."""
    s, acc = run.settings, accuracy(run.records)
    lines = [
        "| task | method | " + " | ".join(str(n) for n in s.lengths) + " | mean |",
        "|---|---|" + "---:|" * (len(s.lengths) + 1),
    ]
    for task in s.tasks:
        for method in s.runs:
            cells = [acc.get(f"{task}/{method}/{n}") for n in s.lengths]
            known = [c for c in cells if c is not None]
            mean = f"{sum(known) / len(known):.1f}" if known else ""
            shown = ["" if c is None else f"{c:.1f}" for c in cells]
            lines.append(f"| {task} | {method} | " + " | ".join(shown) + f" | {mean} |")
    return "\n".join(lines) + "\n"


def heatmap(run: NiahRun, path: Path) -> None:
    """One panel per task and method: score (0-100) over depth (rows) x length (columns)."""
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
                    if not grid[a, b].isnan():
                        ax.text(b, a, f"{grid[a, b]:.0f}", ha="center", va="center", fontsize=8)
            ax.set_title(f"{task} / {method}", fontsize=9)
            if i == rows - 1:
                ax.set_xlabel("context length")
            if j == 0:
                ax.set_ylabel("needle depth")
    fig.colorbar(image, ax=axes, shrink=0.8, label="string_match_all")
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
