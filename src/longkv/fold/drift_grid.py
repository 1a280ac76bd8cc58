"""A grid of folds (dtype x chunk size x variant) measured against full forwards, resumable,
written as one page: what `longkv drift` runs."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from tqdm import tqdm

from longkv.checks import SettingError, require
from longkv.dtypes import DTYPES
from longkv.fold.drift import (
    PLATEAU_FROM,
    DriftResult,
    drift_table,
    full_forward,
    measure_drift,
    plateau_table,
    plot_drift,
)
from longkv.fold.fold import FoldResult
from longkv.fold.variants import VARIANTS, check_variant
from longkv.results import load_partial, save_partial, write_report

Run = tuple[str, int, str]  # (dtype name, chunk size, variant)


def drift_runs(
    model: nn.Module, dtypes: tuple[str, ...], chunk_sizes: tuple[int, ...],
    variants: tuple[str, ...], owner: object,
) -> tuple[list[Run], list[str]]:  # fmt: skip
    """The runs of the grid the model can make, and why any (dtype, variant) pair was left out
    (`check_variant`); if nothing is left, a refusal of owner's `variants`."""
    runs, skipped = [], []
    for dtype in dtypes:
        for variant in variants:
            try:
                check_variant(variant, model, DTYPES[dtype])
            except SettingError as err:
                skipped.append(f"{variant} in {dtype} ({err.message})")
            else:
                runs += [(dtype, size, variant) for size in chunk_sizes]
    require(bool(runs), owner, "variants", f"nothing can run: {'; '.join(skipped)}")
    return runs, skipped


def drift_grid(
    model: nn.Module, ids: Tensor, runs: list[Run], partial: Path, settings: dict[str, Any],
    allow_extrapolation: bool = False,
) -> list[DriftResult]:  # fmt: skip
    """Each run's drift over ids (1, T), in order. Finished folds are kept in `partial` after
    each one (with `settings`, what they depend on): a rerun with the grid interrupted or grown
    measures only the folds it lacks. The model is moved to each run's dtype."""
    done = load_partial(partial, settings)
    references: dict[str, FoldResult] = {}
    for dtype, size, variant in tqdm(runs, desc="drift", unit="fold"):
        key = f"{dtype}/{size}/{variant}"
        if key in done:
            continue
        model = model.to(DTYPES[dtype])
        if dtype not in references:
            references[dtype] = full_forward(model, ids, allow_extrapolation)
        run = measure_drift(
            model, ids, size, DTYPES[dtype], variant=variant, reference=references[dtype],
            allow_extrapolation=allow_extrapolation,
        )  # fmt: skip
        done[key] = asdict(run)
        save_partial(partial, settings, done)
    return [DriftResult(**done[f"{d}/{c}/{v}"]) for d, c, v in runs]


def write_drift_page(
    results: list[DriftResult], variants: tuple[str, ...], skipped: list[str], stem: Path,
    title: str, payload: dict[str, Any], plot_title: str,
) -> list[Path]:  # fmt: skip
    """stem.{json,md,png}: the drift table, the plateau table and the plot; payload (with its
    provenance) gets the runs. Returns the paths written."""
    body = [
        "",
        "drift(t) = mean NLL of chunk t under the fold - the same under one full forward in the",
        "same dtype (nats); chunk t sits at depth t of the chain (chunk 0 carries no cache).",
        "Each depth column is the mean drift over the chunks of that depth range.",
        "",
        "Variants: " + "; ".join(f"{v}: {VARIANTS[v]}" for v in variants) + ".",
        *(["", "Left out: " + ", ".join(skipped) + "."] if skipped else []),
        "",
        drift_table(results),
        f"The plateau: the mean drift over depths >= {PLATEAU_FROM} (the paper's drift has",
        "saturated by depth 7), and the mean over the deeper half of those depths minus the",
        "mean over the shallower half (0 when flat); with several dtypes, the ratio of each",
        "dtype's plateau to the first's (1 when the precision changes nothing).",
        "",
        plateau_table(results),
        f"![drift]({stem.name}.png)",
    ]
    return write_report(
        stem, title, {**payload, "runs": [asdict(r) for r in results]}, body,
        lambda png: plot_drift(results, png, plot_title),
    )  # fmt: skip
