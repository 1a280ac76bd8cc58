"""Drift of the fold against one full forward (spec kvfold.md section 2).

drift(t) = mean NLL of chunk t's tokens under the fold - the same under one full-attention
forward over the whole sequence, both in the same dtype; t is the chunk's depth in the chain
(chunk 0 has no carried cache). An exact fold shows only numerical differences; the fold
variants (`longkv.fold.variants`) are the structural departures worth comparing against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from longkv.fold.fold import FoldResult, chunk_means, kv_fold
from longkv.results import finish_figure, markdown_table, pyplot

# the paper's drift has saturated by depth 7
PLATEAU_FROM = 8


def _mean(x: list[float]) -> float:
    return sum(x) / len(x)


def _bin_edges(n: int) -> list[tuple[int, int]]:
    """[2^k, 2^(k+1)) for the depths 1 .. n-1 of n chunks."""
    return [(2**k, 2 ** (k + 1)) for k in range((n - 1).bit_length())]


@dataclass(frozen=True)
class DriftResult:
    """Per-chunk NLL of the fold and of the full forward, and their difference (nats)."""

    chunk_size: int
    dtype: str
    variant: str
    fold_nll: list[float]
    full_nll: list[float]
    seconds: float

    @property
    def drift(self) -> list[float]:
        return [f - r for f, r in zip(self.fold_nll, self.full_nll, strict=True)]

    @property
    def mean_abs_drift(self) -> float:
        return sum(abs(d) for d in self.drift) / len(self.drift)

    def depth_means(self) -> list[float]:
        """Mean drift over depth bins 1, 2-3, 4-7, ..., [2^k, 2^(k+1)) (chunk 0 left out)."""
        return [_mean(self.drift[lo:hi]) for lo, hi in _bin_edges(len(self.drift))]

    def depth_centres(self) -> list[float]:
        """The mean depth of the chunks in each bin of `depth_means`."""
        n = len(self.drift)
        return [(lo + min(hi, n) - 1) / 2 for lo, hi in _bin_edges(n)]

    def plateau(self, start: int = PLATEAU_FROM) -> tuple[float, float] | None:
        """The mean drift over depths >= start, and the mean over the deeper half of those
        depths minus the mean over the shallower half (about 0 on a flat plateau); None with
        fewer than two such depths."""
        d = self.drift[start:]
        if len(d) < 2:
            return None
        half = len(d) // 2
        return _mean(d), _mean(d[half:]) - _mean(d[:half])


def measure_drift(
    model: nn.Module,
    input_ids: Tensor,
    chunk_size: int,
    dtype: torch.dtype = torch.float32,
    *,
    variant: str = "exact",
    reference: FoldResult | None = None,
    allow_extrapolation: bool = False,
    progress: bool = False,
) -> DriftResult:
    """Per-chunk drift of a fold (`kv_fold`, with its variant) of input_ids (B, T), the model
    cast to dtype.

    reference: the full forward in that dtype (`full_forward`), to share it between runs.
    """
    model = model.to(dtype)
    full = full_forward(model, input_ids, allow_extrapolation) if reference is None else reference
    fold = kv_fold(
        model, input_ids, chunk_size, variant=variant, progress=progress,
        allow_extrapolation=allow_extrapolation,
    )  # fmt: skip
    return DriftResult(
        chunk_size=chunk_size,
        dtype=str(dtype).removeprefix("torch."),
        variant=variant,
        fold_nll=fold.chunk_nll().tolist(),
        full_nll=chunk_means(full.nll, chunk_size).tolist(),
        seconds=fold.seconds,
    )


def full_forward(
    model: nn.Module, input_ids: Tensor, allow_extrapolation: bool = False
) -> FoldResult:
    """One full causal forward over input_ids (B, T): a fold with a single chunk."""
    return kv_fold(model, input_ids, input_ids.shape[1], allow_extrapolation=allow_extrapolation)


def depth_bins(n: int) -> list[str]:
    """Labels of the first n depth bins of `DriftResult.depth_means`: 1, 2-3, 4-7, ..."""
    return ["1" if k == 0 else f"{2**k}-{2 ** (k + 1) - 1}" for k in range(n)]


def drift_table(results: list[DriftResult]) -> str:
    """Markdown: one row per run, its mean drift in each depth bin (chunk depth 1, 2-3, ...)."""
    n = max(len(r.depth_means()) for r in results)
    header = ["chunk", "dtype", "variant", "chunks", "seconds", "mean abs drift"]
    header += [f"depth {b}" for b in depth_bins(n)]
    rows = []
    for r in results:
        means = [f"{m:+.1e}" for m in r.depth_means()]
        run = [str(r.chunk_size), r.dtype, r.variant, str(len(r.drift)), f"{r.seconds:.0f}"]
        rows.append([*run, f"{r.mean_abs_drift:.2e}", *means, *[""] * (n - len(means))])
    lines = markdown_table(header, rows, "><<>>>" + ">" * n)
    return "\n".join(lines) + "\n"


def plateau_table(results: list[DriftResult]) -> str:
    """Markdown: per chunk size and variant, each dtype's plateau (mean drift over depths >=
    PLATEAU_FROM) and its deeper-minus-shallower change, and with two or more dtypes the ratio
    of each later dtype's plateau to the first's (1 = unchanged by the precision)."""
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    runs = {(r.chunk_size, r.variant, r.dtype): r for r in results}
    keys = list(dict.fromkeys((r.chunk_size, r.variant) for r in results))
    head = ["chunk", "variant"]
    for d in dtypes:
        head += [f"plateau {d}", f"deeper - shallower {d}"]
    head += [f"{d} / {dtypes[0]}" for d in dtypes[1:]]
    rows = []
    for size, variant in keys:
        # None where a dtype left this variant out or had too few chunks for a plateau
        stats = [r.plateau() if (r := runs.get((size, variant, d))) else None for d in dtypes]
        if all(x is None for x in stats):
            continue
        cells = [str(size), variant]
        for x in stats:
            cells += ["", ""] if x is None else [f"{x[0]:+.2e}", f"{x[1]:+.1e}"]
        first = stats[0]
        cells += [
            f"{x[0] / first[0]:.4g}" if x is not None and first is not None and first[0] else ""
            for x in stats[1:]
        ]
        rows.append(cells)
    lines = markdown_table(head, rows, "><" + ">" * (len(head) - 2))
    return "\n".join(lines) + "\n"


def plot_drift(results: list[DriftResult], path: Path, title: str) -> None:
    """Drift against chunk depth (log axis), one panel per variant: the mean of each depth bin
    (markers) over the drift of every chunk (faint); colour = chunk size, solid = the first
    dtype, dashed = the others."""
    plt = pyplot()
    variants = list(dict.fromkeys(r.variant for r in results))
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    sizes = sorted({r.chunk_size for r in results})
    colours = dict(zip(sizes, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    cols = min(3, len(variants))
    rows = -(-len(variants) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False, sharex=True, sharey=True
    )
    for ax, variant in zip(axes.flat, variants, strict=False):
        for r in (r for r in results if r.variant == variant):
            style = "-" if r.dtype == dtypes[0] else "--"
            colour = colours[r.chunk_size]
            ax.plot(range(1, len(r.drift)), r.drift[1:], style, color=colour, linewidth=0.5,
                    alpha=0.25)  # fmt: skip
            ax.plot(
                r.depth_centres(), r.depth_means(), style, marker="o", markersize=3,
                color=colour, linewidth=1.2, label=f"C={r.chunk_size}, {r.dtype}",
            )  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_title(variant, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(variants) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("chunk depth t")
    for ax in axes[:, 0]:
        ax.set_ylabel("drift (nats)")
    finish_figure(fig, path, title, title_size=11)
