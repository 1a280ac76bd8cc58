"""Fold against one full forward (and the bounded caches) on the same tokens, in one run.

Each method first reads the first WARM_UP_TOKENS tokens (what its first call sets up, caches
and kernels, is counted nowhere), then runs once with its peak memory measured, then `repeats`
timed runs with the heap kept for reuse; the reported time is their median. With
`decode_tokens` n, it then reads all but the last n tokens once more and feeds those n one at a
time, as decoding does (the input's own tokens rather than its guesses, so that every method
steps through the same positions, inside the input's length). The methods take those steps in
turns, one token each, as the timed runs go in rounds, so that a machine that slows down over
the minutes weighs on every method's steps alike: the reported decode time is the median of a
method's steps. The weights are read in before anything is measured, so no method's
peak counts them (`load_weights`). Measuring sets glibc's allocator options for the process
(`keep_freed_heap`).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from longkv.attention.state import tensor_bytes
from longkv.bench.memory import keep_freed_heap, load_weights, peak_memory
from longkv.caches.bounded import STREAM_CHUNK, BoundedConfig, BoundedRunner, bounded_fold
from longkv.caches.methods import make_runner
from longkv.checks import require_at_least, setting
from longkv.fold.fold import FoldResult, FoldRunner, kv_fold
from longkv.models.modeling import LongKVCache
from longkv.results import markdown_table

# enough tokens for every bounded cache of the default budgets to append, merge and evict
WARM_UP_TOKENS = 2048


@dataclass(frozen=True)
class MethodRun:
    """One method over the tokens: time, peak memory and quality."""

    method: str
    chunk_size: int
    seconds: float
    peak_memory_bytes: int | None
    mean_nll: float
    # None where full attention did not run (`compare_methods(reference=False)`)
    nll_gap_vs_full: float | None
    max_abs_nll_diff_vs_full: float | None
    # the queries of the last chunk: entries attended as a share of full attention's, per query
    # head and layer (mean, largest); full and the fold attend all
    attended_share: float
    attended_share_max: float
    # after the run: bytes of the cache (a bounded cache's bounded part), of two-level
    # KVM-Fold's leaves in memory and in a file
    cache_bytes: int
    leaf_bytes: int
    leaf_file_bytes: int
    # the median seconds of one decoding step at the input's length (None: not measured)
    decode_seconds: float | None = None


@dataclass(frozen=True)
class Timing:
    """How the comparing commands time each method."""

    repeats: int = setting(1, "timed runs per method, in rounds over the methods (median)")
    decode_tokens: int = setting(
        0, "decoding steps timed per method after its runs, at the input's length (0: none)"
    )

    def __post_init__(self) -> None:
        require_at_least(1, self, "repeats")
        require_at_least(0, self, "decode_tokens")


Run = Callable[[Tensor], FoldResult]
Step = Callable[[Tensor], Tensor]  # ids (B, 1) -> logits (B, 1, V), continuing a read


def step_seconds(steps: dict[str, Step], ids: Tensor) -> dict[str, float]:
    """The median wall time of each step fed ids (B, n) one token at a time, the steps taking
    each token in turn."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    with torch.inference_mode():
        for i in range(ids.shape[1]):
            for name, step in steps.items():
                start = time.perf_counter()
                step(ids[:, i : i + 1])
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _runs(
    model: nn.Module,
    chunk_size: int,
    bounded: dict[str, BoundedConfig],
    stream_chunk: int,
    allow_extrapolation: bool,
    variant: str,
) -> tuple[dict[str, tuple[int | None, Run]], dict[str, BoundedRunner]]:
    """Each method as (its chunk size, None for all tokens at once; its run over ids (B, T)),
    and where each bounded run leaves its last runner (by label)."""

    def fold(ids: Tensor, size: int, variant: str, progress: bool) -> FoldResult:
        return kv_fold(
            model, ids, size, variant=variant, allow_extrapolation=allow_extrapolation,
            progress=progress,
        )  # fmt: skip

    def read(label: str, ids: Tensor) -> FoldResult:
        runner = last[label] = make_runner(model, bounded[label])
        return bounded_fold(
            runner, ids, stream_chunk, progress=True, desc=f"{label}, {ids.shape[1]} tokens"
        )

    runs: dict[str, tuple[int | None, Run]] = {
        "full": (None, lambda ids: fold(ids, ids.shape[1], "exact", False)),
        "fold": (chunk_size, lambda ids: fold(ids, chunk_size, variant, True)),
    }
    last: dict[str, BoundedRunner] = {}
    for label in bounded:
        runs[label] = (stream_chunk, functools.partial(read, label))
    return runs, last


def cache_use(result: FoldResult, runner: BoundedRunner | None, T: int) -> dict[str, Any]:
    """`MethodRun`'s attended shares and bytes of a run over T tokens: a bounded runner's, or
    a cache of every token's (runner None)."""
    if runner is None:
        cache = result.cache  # a longkv model's own cache counts its states itself
        held = cache.nbytes if isinstance(cache, LongKVCache) else sum(
            tensor_bytes(layer.keys, layer.values) for layer in cache.layers
        )  # fmt: skip
        return dict(attended_share=1.0, attended_share_max=1.0, cache_bytes=held, leaf_bytes=0,
                    leaf_file_bytes=0)  # fmt: skip
    share = runner.attention_share(since=(T - 1) // result.chunk_size * result.chunk_size)
    held = runner.resident_bytes()
    return dict(
        attended_share=share["mean"], attended_share_max=share["max"],
        cache_bytes=held["bounded"], leaf_bytes=held.get("leaves", 0),
        leaf_file_bytes=held.get("leaves_file", 0),
    )  # fmt: skip


def compare_methods(
    model: nn.Module,
    input_ids: Tensor,
    chunk_size: int,
    *,
    methods: tuple[str, ...] = ("full", "fold"),
    repeats: int = 1,
    bounded: dict[str, BoundedConfig] | None = None,
    stream_chunk: int = STREAM_CHUNK,
    allow_extrapolation: bool = False,
    variant: str = "exact",
    decode_tokens: int = 0,
    reference: bool = True,
) -> dict[str, Any]:
    """Measure each method on input_ids (B, T); ratios against the full forward.

    methods: "full" and "fold", and labels of `bounded` (label -> config; see
    `longkv.caches.methods`), run in chunks of stream_chunk. The `repeats` timed runs go in
    rounds, each method once per round, so that a machine that slows down or speeds up over
    the minutes weighs on every method alike. allow_extrapolation: let full and fold run a
    RoPE model past its max_position_embeddings (`kv_fold`); a bounded cache's positions stay
    within its budget. variant: how "fold" departs from the exact fold
    (`longkv.fold.variants`). decode_tokens: steps of decoding timed after each method's
    runs (module docstring; 0: none). reference: run full attention first, the reference of
    the NLL gaps and of the ratios; False runs `methods` alone (full attention only if named),
    without either (at a length full attention takes too long to read).
    """
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    T = input_ids.shape[1]
    if not 0 <= decode_tokens < T:
        raise ValueError(f"decode_tokens: must lie in [0, {T}), got {decode_tokens}")
    keep_freed_heap()
    load_weights(model)
    runs, last = _runs(model, chunk_size, bounded or {}, stream_chunk, allow_extrapolation, variant)
    order = ("full", *[m for m in methods if m != "full"]) if reference else tuple(methods)
    measured: dict[str, dict[str, Any]] = {}
    full_nll: Tensor | None = None
    for method in tqdm(order, desc=f"methods over {T} tokens", unit="method"):
        size, run_on = runs[method]
        run_on(input_ids[:, : min(T, WARM_UP_TOKENS)])  # what a first call sets up is not counted
        first, peak = peak_memory(functools.partial(run_on, input_ids), input_ids.device)
        full_nll = first.nll if method == "full" else full_nll
        gap = None if full_nll is None else first.nll - full_nll
        measured[method] = dict(
            method=method, chunk_size=size or T, peak_memory_bytes=peak,
            mean_nll=first.nll.mean().item(),
            nll_gap_vs_full=None if gap is None else gap.mean().item(),
            max_abs_nll_diff_vs_full=None if gap is None else gap.abs().max().item(),
            **cache_use(first, last.get(method), T),
        )  # fmt: skip
    times: dict[str, list[float]] = {m: [] for m in order}
    for _ in tqdm(range(repeats), desc="timed rounds", unit="round"):
        for method in order:
            times[method].append(runs[method][1](input_ids).seconds)
    decode: dict[str, float] = {}
    if decode_tokens:
        steps = {m: _step(model, m, runs[m][1](input_ids[:, : T - decode_tokens]), last, variant,
                          chunk_size) for m in order}  # fmt: skip
        decode = step_seconds(steps, input_ids[:, T - decode_tokens :])
    results = {
        m: MethodRun(**measured[m], seconds=statistics.median(times[m]),
                     decode_seconds=decode.get(m))
        for m in order
    }  # fmt: skip
    return {"runs": [asdict(r) for r in results.values()], "ratios": _ratios(results)}


def _step(
    model: nn.Module, method: str, read: FoldResult, last: dict[str, BoundedRunner],
    variant: str, chunk_size: int,
) -> Step:  # fmt: skip
    """How decoding continues the read `read` of a method: a bounded run's runner, or a fold
    runner over full attention's or the fold's cache."""
    if method in last:
        return last[method].forward
    variant = variant if method == "fold" else "exact"
    runner = FoldRunner(model, read.cache, read.next_position, variant=variant,
                        chunk_size=chunk_size)  # fmt: skip
    return runner.forward


def _ratios(results: dict[str, MethodRun]) -> dict[str, float]:
    """Each method's time, peak memory and decoding step against full attention's (none
    without full attention)."""
    if "full" not in results:
        return {}
    full = results["full"]
    ratios = {}
    for name, r in results.items():
        if name == "full":
            continue
        ratios[f"{name} / full time"] = r.seconds / full.seconds
        if r.peak_memory_bytes is not None and full.peak_memory_bytes:
            ratios[f"{name} / full peak memory"] = r.peak_memory_bytes / full.peak_memory_bytes
        if r.decode_seconds is not None and full.decode_seconds:
            ratios[f"{name} / full decoding step"] = r.decode_seconds / full.decode_seconds
    return ratios


def markdown_rows(report: dict[str, Any]) -> list[str]:
    """Markdown tables of a `compare_methods` report."""
    header = [
        "method",
        "chunk",
        "seconds",
        "peak MiB",
        "mean NLL",
        "NLL gap vs full",
        "max abs NLL diff vs full",
        "entries attended (last chunk, mean / max)",
        "cache MiB",
        "leaves MiB (memory / file)",
        "decoding ms / step",
    ]
    rows = [
        [
            r["method"],
            str(r["chunk_size"]),
            f"{r['seconds']:.2f}",
            "n/a" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**20:.0f}",
            f"{r['mean_nll']:.4f}",
            optional(r["nll_gap_vs_full"], "+.4f"),
            optional(r["max_abs_nll_diff_vs_full"], ".2e"),
            f"{100 * r['attended_share']:.1f} % / {100 * r['attended_share_max']:.1f} %",
            f"{r['cache_bytes'] / 2**20:.1f}",
            leaves(r),
            "-" if r.get("decode_seconds") is None else f"{1000 * r['decode_seconds']:.1f}",
        ]
        for r in report["runs"]
    ]
    table = markdown_table(header, rows, "<" + ">" * 10)
    ratios = [[name, f"{value:.3f}"] for name, value in report["ratios"].items()]
    if not ratios:  # full attention did not run
        return table
    return [*table, "", *markdown_table(["ratio (same run)", "value"], ratios, "<>")]


def optional(value: float | None, spec: str, missing: str = "-") -> str:
    """value formatted by spec, `missing` for None (not measured)."""
    return missing if value is None else format(value, spec)


def leaves(run: dict[str, Any]) -> str:
    """A run's leaf bytes in MiB, in memory / in a file ("-" without leaves)."""
    memory, file = run["leaf_bytes"], run["leaf_file_bytes"]
    if not memory and not file:
        return "-"
    return f"{memory / 2**20:.1f} / {file / 2**20:.1f}"
