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
from longkv.results import pyplot, save_figure


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
        d = self.drift
        bins = [d[2**k : 2 ** (k + 1)] for k in range((len(d) - 1).bit_length())]
        return [sum(b) / len(b) for b in bins]


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
    lines = [
        "| chunk | dtype | variant | chunks | seconds | mean abs drift | "
        + " | ".join(f"depth {b}" for b in depth_bins(n))
        + " |",
        "|---:|---|---|---:|---:|---:|" + "---:|" * n,
    ]
    for r in results:
        means = [f"{m:+.1e}" for m in r.depth_means()]
        cells = means + [""] * (n - len(means))
        lines.append(
            f"| {r.chunk_size} | {r.dtype} | {r.variant} | {len(r.drift)} | {r.seconds:.0f} | "
            f"{r.mean_abs_drift:.2e} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def plot_drift(results: list[DriftResult], path: Path, title: str) -> None:
    """Drift against chunk depth (log axis), one panel per variant; colour = chunk size,
    solid = the first dtype, dashed = the others."""
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
            depth = range(1, len(r.drift))
            ax.plot(
                depth, r.drift[1:], style, color=colours[r.chunk_size], linewidth=0.9,
                label=f"C={r.chunk_size}, {r.dtype}",
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
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)
