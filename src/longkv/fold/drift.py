"""Drift of the fold against one full forward (spec kvfold.md section 2).

drift(t) = mean NLL of chunk t's tokens under the fold - the same under one full-attention
forward over the whole sequence, both in the same dtype. An exact fold shows only numerical
differences; a per-chunk prefix (e.g. a BOS re-inserted at each chunk start) is the structural
perturbation worth comparing against.
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
    prefix: str
    fold_nll: list[float]
    full_nll: list[float]

    @property
    def drift(self) -> list[float]:
        return [f - r for f, r in zip(self.fold_nll, self.full_nll, strict=True)]

    @property
    def mean_abs_drift(self) -> float:
        return sum(abs(d) for d in self.drift) / len(self.drift)


def measure_drift(
    model: nn.Module,
    input_ids: Tensor,
    chunk_size: int,
    dtype: torch.dtype = torch.float32,
    *,
    prefix_ids: Tensor | None = None,
    prefix_name: str = "none",
    reference: FoldResult | None = None,
    allow_extrapolation: bool = False,
    progress: bool = False,
) -> DriftResult:
    """Per-chunk drift of a fold of input_ids (B, T) with the model cast to dtype.

    reference: the full forward in that dtype (`full_forward`), to share it between runs.
    """
    model = model.to(dtype)
    full = full_forward(model, input_ids, allow_extrapolation) if reference is None else reference
    fold = kv_fold(
        model, input_ids, chunk_size, prefix_ids=prefix_ids, progress=progress,
        allow_extrapolation=allow_extrapolation,
    )  # fmt: skip
    return DriftResult(
        chunk_size=chunk_size,
        dtype=str(dtype).removeprefix("torch."),
        prefix=prefix_name,
        fold_nll=fold.chunk_nll().tolist(),
        full_nll=chunk_means(full.nll, chunk_size).tolist(),
    )


def full_forward(
    model: nn.Module, input_ids: Tensor, allow_extrapolation: bool = False
) -> FoldResult:
    """One full causal forward over input_ids (B, T): a fold with a single chunk."""
    return kv_fold(model, input_ids, input_ids.shape[1], allow_extrapolation=allow_extrapolation)


def drift_table(results: list[DriftResult]) -> str:
    """Markdown: one row per run, drift per chunk depth summarised."""
    lines = [
        "| chunk | dtype | prefix | chunks | mean abs drift | max abs drift | "
        "drift at chunks 1, 2, 4, last |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        d = r.drift
        picks = [d[i] for i in (1, 2, 4) if i < len(d)] + [d[-1]]
        lines.append(
            f"| {r.chunk_size} | {r.dtype} | {r.prefix} | {len(d)} | {r.mean_abs_drift:.2e} | "
            f"{max(abs(x) for x in d):.2e} | {', '.join(f'{x:+.1e}' for x in picks)} |"
        )
    return "\n".join(lines) + "\n"


def plot_drift(results: list[DriftResult], path: Path, title: str) -> None:
    """Drift against token position, one panel per dtype; colour = chunk size, dashed = prefix."""
    plt = pyplot()
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    sizes = sorted({r.chunk_size for r in results})
    colours = dict(zip(sizes, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(
        1, len(dtypes), figsize=(6.5 * len(dtypes), 4.5), squeeze=False, sharey=True
    )
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        for r in (r for r in results if r.dtype == dtype):
            ends = [(i + 1) * r.chunk_size for i in range(len(r.drift))]
            style = "-" if r.prefix == "none" else "--"
            label = f"C={r.chunk_size}" + ("" if r.prefix == "none" else f", {r.prefix} per chunk")
            ax.plot(ends, r.drift, style, marker=".", color=colours[r.chunk_size], label=label)
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xlabel("token position (end of chunk)")
        ax.set_title(f"{title}, {dtype}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("drift: fold NLL - full NLL (nats)")
    fig.tight_layout()
    save_figure(fig, path)
