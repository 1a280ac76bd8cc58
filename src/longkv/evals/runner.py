"""Needle-in-a-haystack over lengths x depths x methods: full attention, KV-Fold, StreamingLLM.

Every method answers the same prompt by greedy decoding: `full` from one pass over the whole
prompt, `fold` from a fold in chunks, `streaming` from a StreamingLLM cache. Records are written
to the JSON file after every answer (atomically), and a rerun with the same settings reuses
those of an unfinished grid, so an interrupted grid loses nothing; a finished grid (such as a
committed result) is run again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from longkv.checks import require, require_at_least
from longkv.evals.niah import TASKS, make_sample, sample_score
from longkv.fold.generate import fold_generate
from longkv.fold.streaming import check_streamable, streaming_generate
from longkv.results import pyplot, save_figure, write_atomic

METHODS = ("full", "fold", "streaming")


@dataclass(frozen=True)
class NiahSettings:
    """The grid and the methods' options."""

    tasks: tuple[str, ...] = ("niah_single_2",)
    lengths: tuple[int, ...] = (4096,)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    methods: tuple[str, ...] = METHODS
    samples: int = 1
    seed: int = 0
    chunk_size: int = 1024
    sinks: int = 4
    window: int = 1020
    stream_chunk: int = 64
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        for name, values, allowed in (
            ("tasks", self.tasks, TASKS),
            ("methods", self.methods, METHODS),
        ):
            unknown = set(values) - set(allowed)
            if unknown:
                raise ValueError(f"{name}: unknown {sorted(unknown)}; choose from {list(allowed)}")
        at_least_one = ("lengths", "samples", "chunk_size", "window", "stream_chunk")
        require_at_least(1, "NiahSettings", self, *at_least_one, "max_new_tokens")
        require_at_least(0, "NiahSettings", self, "sinks")
        require(
            all(0 <= d <= 1 for d in self.depths),
            "NiahSettings.depths",
            f"must lie in [0, 1], got {self.depths}",
        )


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
            "fold_equals_full": fold_mismatches(self.records) == [],
        }
        write_atomic(path, json.dumps(payload, indent=2) + "\n")

    @classmethod
    def resume(cls, path: Path, settings: NiahSettings) -> list[NiahRecord]:
        """Records of an earlier run with the same settings at path (none if it differs)."""
        if not path.is_file():
            return []
        data = json.loads(path.read_text())
        if data.get("settings") != json.loads(json.dumps(asdict(settings))):
            return []
        return [NiahRecord(**r) for r in data["records"]]


def answer(
    model: nn.Module, ids: torch.Tensor, method: str, s: NiahSettings, eos: int | None
) -> list[int]:
    """Greedy answer tokens of one method to the prompt ids (1, T)."""
    n = s.max_new_tokens
    if method == "full":
        out = fold_generate(model, ids, ids.shape[1], n, eos_token_id=eos)
    elif method == "fold":
        out = fold_generate(model, ids, s.chunk_size, n, eos_token_id=eos)
    else:
        out = streaming_generate(
            model, ids, n, sinks=s.sinks, window=s.window, chunk_size=s.stream_chunk,
            eos_token_id=eos,
        )  # fmt: skip
    tokens = out[0].tolist()
    return tokens[: tokens.index(eos)] if eos is not None and eos in tokens else tokens


def check_methods(model: nn.Module, s: NiahSettings) -> None:
    """Raise ValueError, before any answer, if one of the methods cannot run on the model."""
    if "streaming" in s.methods:
        try:
            check_streamable(model, s.sinks, s.window)
        except ValueError as err:
            raise ValueError(
                f"methods: streaming cannot run on this model ({err}); leave it out, e.g. "
                "--methods full fold"
            ) from err


def run_niah(
    model: nn.Module,
    tokenizer: Any,
    s: NiahSettings,
    path: Path,
    provenance: dict[str, Any] | None = None,
    corpus_dir: str | None = None,
) -> NiahRun:
    """Answer every sample of the grid with every method; save after each answer."""
    check_methods(model, s)
    cells = [
        (task, n, d, s.seed + i)
        for task in s.tasks
        for n in s.lengths
        for d in s.depths
        for i in range(s.samples)
    ]
    saved = NiahRun.resume(path, s)
    if len(saved) == len(cells) * len(s.methods):  # finished: measure again
        saved = []
    run = NiahRun(settings=s, records=saved, provenance=provenance or {})
    done = {r.key for r in run.records}
    eos = getattr(tokenizer, "eos_token_id", None)
    progress = tqdm(total=len(cells) * len(s.methods) - len(done), desc="niah", unit="answer")
    for task, n, d, seed in cells:
        todo = [m for m in s.methods if (task, n, d, seed, m) not in done]
        if not todo:
            continue
        sample = make_sample(task, tokenizer, n, d, seed, corpus_dir=corpus_dir)
        ids = torch.tensor([sample.input_ids], device=model.get_input_embeddings().weight.device)
        for method in todo:
            t0 = time.perf_counter()
            tokens = answer(model, ids, method, s, eos)
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
                )
            )
            run.save(path)
            progress.update()
    progress.close()
    run.save(path)
    return run


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


def fold_mismatches(records: list[NiahRecord]) -> list[tuple[str, int, float, int]]:
    """Samples where the fold's answer tokens differ from full attention's."""
    tokens = {r.key: r.tokens for r in records}
    return [
        r.key[:4]
        for r in records
        if r.method == "fold" and (*r.key[:4], "full") in tokens
        if tokens[(*r.key[:4], "full")] != r.tokens
    ]


def accuracy_table(run: NiahRun) -> str:
    """Markdown: rows task x method, columns lengths, cells string_match_all over depths."""
    s, acc = run.settings, accuracy(run.records)
    lines = [
        "| task | method | " + " | ".join(str(n) for n in s.lengths) + " | mean |",
        "|---|---|" + "---:|" * (len(s.lengths) + 1),
    ]
    for task in s.tasks:
        for method in s.methods:
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
    rows, cols = len(s.tasks), len(s.methods)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(3.2 * cols + 1.2, 2.6 * rows + 0.8),
        squeeze=False,
        layout="constrained",
    )
    for i, task in enumerate(s.tasks):
        for j, method in enumerate(s.methods):
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
