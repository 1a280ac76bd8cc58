"""`longkv fold` and `longkv drift`: KV-Fold on a pretrained model over corpus text."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from longkv.bench.compare import compare_methods, markdown_rows
from longkv.data.corpus import DEFAULT_TEXT, text_tokens
from longkv.fold.drift import drift_table, full_forward, measure_drift, plot_drift
from longkv.models.pretrained import DEFAULT_MODEL, load_pretrained
from longkv.results import provenance, write_report

DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --device, --device-map, --corpus-dir, --out-dir: shared by the model commands."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="local path, hub id, or smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--device-map", default=None, help='accelerate placement, e.g. "auto"')
    p.add_argument("--corpus-dir", default=None, help="default: $LONGKV_CORPUS_DIR, else shipped")
    p.add_argument("--out-dir", default="results")


def add_text_args(p: argparse.ArgumentParser) -> None:
    """--tokens and --text: the corpus text a fold runs over."""
    p.add_argument("--tokens", type=int, default=8192, help="tokens of corpus text per run")
    p.add_argument("--text", default=DEFAULT_TEXT, help="corpus file to read the tokens from")


def load(args: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """The model and tokenizer the options name."""
    return load_pretrained(args.model, dtype, args.device, args.device_map)


def input_device(model: torch.nn.Module) -> torch.device:
    """Where token ids go: the device of the input embedding."""
    return model.get_input_embeddings().weight.device


def _tokens(args: argparse.Namespace, tokenizer: Any, model: torch.nn.Module) -> torch.Tensor:
    ids = text_tokens(tokenizer, args.tokens, args.text, args.corpus_dir)
    return torch.tensor([ids], device=input_device(model))


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """Register `fold` and `drift`."""
    fold = commands.add_parser(
        "fold",
        help="fold a pretrained model over corpus text; time, memory and NLL against full",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_args(fold)
    add_text_args(fold)
    fold.add_argument("--chunk-size", type=int, default=1024)
    fold.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    fold.add_argument(
        "--methods", nargs="+", choices=["full", "fold", "streaming"], default=["full", "fold"]
    )
    fold.add_argument("--repeats", type=int, default=1, help="timed runs per method (median)")
    fold.add_argument("--sinks", type=int, default=4, help="StreamingLLM sink tokens")
    fold.add_argument("--window", type=int, default=1020, help="StreamingLLM recent tokens")
    fold.add_argument("--stream-chunk", type=int, default=64, help="StreamingLLM chunk (1 = exact)")
    fold.add_argument("--name", default=None, help="result file stem (default fold_<tokens>)")
    fold.set_defaults(func=run_fold)

    drift = commands.add_parser(
        "drift",
        help="per-chunk drift of the fold against one full forward, as a table and a PNG",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_args(drift)
    add_text_args(drift)
    drift.add_argument("--chunk-sizes", type=int, nargs="+", default=[256, 512, 1024])
    drift.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    drift.add_argument("--prefixes", nargs="+", choices=["none", "bos"], default=["none", "bos"])
    drift.add_argument("--name", default=None, help="result file stem (default drift_<tokens>)")
    drift.set_defaults(func=run_drift)


def run_fold(args: argparse.Namespace, argv: list[str]) -> int:
    model, tokenizer = load(args, DTYPES[args.dtype])
    ids = _tokens(args, tokenizer, model)
    report = compare_methods(
        model, ids, args.chunk_size, methods=tuple(args.methods), repeats=args.repeats,
        sinks=args.sinks, window=args.window, stream_chunk=args.stream_chunk,
    )  # fmt: skip
    report = {"provenance": provenance(argv), "settings": vars_of(args), **report}
    stem = Path(args.out_dir) / (args.name or f"fold_{args.tokens}")
    title = f"longkv fold: {args.model}, {args.tokens} tokens of {args.text}, {args.dtype}"
    tables = markdown_rows(report)
    print("\n".join(tables))
    paths = write_report(stem, title, report, ["", *tables])
    print("\nwrote " + ", ".join(map(str, paths)))
    return 0


def run_drift(args: argparse.Namespace, argv: list[str]) -> int:
    model, tokenizer = load(args, torch.float32)
    ids = _tokens(args, tokenizer, model)
    bos = getattr(tokenizer, "bos_token_id", None)
    if "bos" in args.prefixes and bos is None:
        raise ValueError("--prefixes bos: the tokenizer has no bos_token_id")
    prefixes = {"none": None, "bos": None if bos is None else torch.tensor([bos])}
    results = []
    for dtype in args.dtypes:
        model = model.to(DTYPES[dtype])
        reference = full_forward(model, ids)
        for size in args.chunk_sizes:
            for name in args.prefixes:
                prefix = prefixes[name]
                run = measure_drift(
                    model, ids, size, DTYPES[dtype], prefix_ids=prefix, prefix_name=name,
                    reference=reference, progress=True,
                )  # fmt: skip
                results.append(run)
    stem = Path(args.out_dir) / (args.name or f"drift_{args.tokens}")
    table = drift_table(results)
    body = [
        "",
        "drift(t) = mean NLL of chunk t under the fold - the same under one full forward in the",
        "same dtype (nats).",
        "",
        table,
        f"![drift]({stem.name}.png)",
    ]
    print(table)
    payload = {
        "provenance": provenance(argv),
        "settings": vars_of(args),
        "runs": [asdict(r) for r in results],
    }
    write_report(
        stem, f"longkv drift: {args.model}, {args.tokens} tokens of {args.text}", payload, body
    )
    plot_drift(
        results,
        stem.with_suffix(".png"),
        f"{args.model}: fold vs full forward, {args.tokens} tokens",
    )
    print(f"wrote {stem}.json, {stem}.md, {stem}.png")
    return 0


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed options as a JSON-ready dict."""
    return {k: v for k, v in vars(args).items() if k != "func"}
