"""`longkv fold` and `longkv drift`: KV-Fold on a pretrained model over corpus text."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from longkv.bench.compare import Timing, compare_methods, markdown_rows
from longkv.caches.methods import CACHE_METHODS, BoundedOptions, describe_runs
from longkv.checks import refused_as, require, require_at_least, setting
from longkv.cli.args import command
from longkv.cli.common import ModelOptions, dtype_setting, require_own_page, require_positions
from longkv.data.corpus import DEFAULT_TEXT
from longkv.dtypes import DTYPES
from longkv.fold.drift import drift_table
from longkv.fold.drift_grid import drift_grid, drift_runs, write_drift_page
from longkv.fold.fold import FOLD_CHUNK
from longkv.fold.variants import (
    VARIANT_HELP,
    VARIANTS,
    check_variant,
    inserted_positions,
    require_variants,
)
from longkv.results import provenance, write_report


@dataclass(frozen=True)
class TextOptions:
    """The corpus text a fold runs over."""

    tokens: int = setting(8192, "tokens of corpus text per run")
    text: str = setting(DEFAULT_TEXT, "corpus file to read the tokens from")

    def __post_init__(self) -> None:
        require_at_least(1, self, "tokens")


@dataclass(frozen=True)
class FoldOptions(BoundedOptions, TextOptions, Timing):
    """`longkv fold`: the methods compared with one full forward, and their options."""

    chunk_size: int = setting(FOLD_CHUNK, "fold chunk (tokens)")
    variant: str = setting("exact", "method fold: " + VARIANT_HELP, choices=VARIANTS)
    dtype: str = dtype_setting()
    methods: tuple[str, ...] = setting(
        ("full", "fold"),
        "methods to run; full always runs, as the reference",
        choices=CACHE_METHODS,
    )
    name: str | None = setting(None, "file name stem of the results (default: fold_<tokens>)")

    def __post_init__(self) -> None:
        super().__post_init__()
        Timing.__post_init__(self)  # TextOptions's does not go on to it
        require_at_least(1, self, "chunk_size")
        require(
            self.decode_tokens < self.tokens, self, "decode_tokens",
            f"{self.decode_tokens} steps do not fit --tokens {self.tokens}",
        )  # fmt: skip
        require_variants(self, "variant", self.variant)
        self.bounded_configs(self.methods)


@dataclass(frozen=True)
class DriftOptions(TextOptions):
    """`longkv drift`: the folds measured against one full forward."""

    chunk_sizes: tuple[int, ...] = setting((256, 512, 1024), "fold chunks (tokens)")
    dtypes: tuple[str, ...] = setting(
        ("fp32", "bf16"),
        "dtypes of the model, each with its own full forward",
        choices=sorted(DTYPES),
    )
    variants: tuple[str, ...] = setting(
        ("exact", "bos"), "fold variants, each run at every chunk size and dtype; " + VARIANT_HELP,
        choices=VARIANTS,
    )  # fmt: skip
    name: str | None = setting(None, "file name stem of the results (default: drift_<tokens>)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(1, self, "chunk_sizes")
        require_variants(self, "variants", *self.variants)


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `fold` or `drift`."""
    if name == "fold":
        command(parser, run_fold, ModelOptions, FoldOptions)
    else:
        command(
            parser, run_drift, ModelOptions, DriftOptions,
            kept="the finished folds are beside the page (.runs.json)",
        )  # fmt: skip


def run_fold(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[ModelOptions], args.settings[FoldOptions]
    stem = Path(m.out_dir) / (o.name or f"fold_{o.tokens}")
    require_own_page(stem.with_suffix(".json"), {**asdict(m), **asdict(o)}, o)
    model, tokenizer = m.load(o.dtype)
    if "fold" in o.methods:
        with refused_as(o, "variant"):
            check_variant(o.variant, model)
    inserted = inserted_positions(o.variant, o.tokens, o.chunk_size) if "fold" in o.methods else 0
    require_positions(
        model, o.tokens + inserted, o, "tokens",
        f"{o.tokens} tokens" + (" and the fold's BOS before every chunk" if inserted else ""),
        m.allow_extrapolation,
    )  # fmt: skip
    bounded = o.check_runs(model, o.methods)
    ids = m.token_ids(model, tokenizer, o.tokens, o.text)
    report = compare_methods(
        model, ids, o.chunk_size, methods=tuple(o.labels(o.methods)), repeats=o.repeats,
        bounded=bounded, stream_chunk=o.stream_chunk, allow_extrapolation=m.allow_extrapolation,
        variant=o.variant, decode_tokens=o.decode_tokens,
    )  # fmt: skip
    report = {"provenance": provenance(argv), "settings": {**asdict(m), **asdict(o)}, **report}
    title = f"longkv fold: {m.model}, {o.tokens} tokens of {o.text}, {o.dtype}"
    tables = markdown_rows(report)
    if bounded:
        tables = [f"Bounded caches, read in chunks of {o.stream_chunk}: {describe_runs(bounded)}.",
                  "", *tables]  # fmt: skip
    print("\n".join(tables))
    paths = write_report(stem, title, report, ["", *tables])
    print("\nwrote " + ", ".join(map(str, paths)))
    return 0


def run_drift(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[ModelOptions], args.settings[DriftOptions]
    stem = Path(m.out_dir) / (o.name or f"drift_{o.tokens}")
    grid = ("chunk_sizes", "dtypes", "variants", "name")  # a run may grow these
    settings = {**asdict(m), **{k: v for k, v in asdict(o).items() if k not in grid}}
    require_own_page(
        stem.with_suffix(".json"), settings, o,
        lambda data: {k: v for k, v in data.get("settings", {}).items() if k not in grid},
    )  # fmt: skip
    model, tokenizer = m.load("fp32")
    runs, skipped = drift_runs(model, o.dtypes, o.chunk_sizes, o.variants, o)
    # the smallest chunk inserts the most
    inserted = max(inserted_positions(v, o.tokens, min(o.chunk_sizes)) for v in o.variants)
    require_positions(
        model, o.tokens + inserted, o, "tokens", f"{o.tokens} tokens and their prefixes",
        m.allow_extrapolation,
    )  # fmt: skip
    ids = m.token_ids(model, tokenizer, o.tokens, o.text)
    partial = stem.with_suffix(".runs.json")
    results = drift_grid(model, ids, runs, partial, settings, m.allow_extrapolation)
    print(drift_table(results))
    payload = {"provenance": provenance(argv), "settings": {**asdict(m), **asdict(o)}}
    title = f"longkv drift: {m.model}, {o.tokens} tokens of {o.text}"
    plot_title = f"{m.model}: fold vs full forward, {o.tokens} tokens"
    paths = write_drift_page(results, o.variants, skipped, stem, title, payload, plot_title)
    partial.unlink()
    print("wrote " + ", ".join(map(str, paths)))
    return 0
