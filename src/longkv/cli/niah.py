"""`longkv niah`: needle-in-a-haystack for full attention, KV-Fold and StreamingLLM."""

from __future__ import annotations

import argparse
from pathlib import Path

from longkv.cli.args import settings_from_args
from longkv.cli.fold import DTYPES, add_model_args, load
from longkv.evals.niah import TASKS
from longkv.evals.runner import (
    METHODS,
    NiahSettings,
    accuracy_table,
    fold_mismatches,
    heatmap,
    run_niah,
)
from longkv.results import provenance, provenance_lines, write_atomic


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `niah`; its defaults are the short demonstration `make run` shows."""
    d = NiahSettings()
    p = commands.add_parser(
        "niah",
        help="needle in a haystack: full vs fold vs streaming; JSON, table and heatmap",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(d.tasks))
    p.add_argument("--lengths", nargs="+", type=int, default=list(d.lengths))
    p.add_argument("--depths", nargs="+", type=float, default=list(d.depths))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(d.methods))
    p.add_argument("--samples", type=int, default=d.samples, help="samples per cell")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="fold chunk")
    p.add_argument("--sinks", type=int, default=d.sinks)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--stream-chunk", type=int, default=d.stream_chunk, help="1 = token by token")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--name", default="niah_demo", help="result file stem")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    settings = settings_from_args(NiahSettings, args)
    model, tokenizer = load(args, DTYPES[args.dtype])
    stem = Path(args.out_dir) / args.name
    prov = provenance(argv)
    result = run_niah(model, tokenizer, settings, stem.with_suffix(".json"), prov, args.corpus_dir)
    table = accuracy_table(result)
    mismatches = fold_mismatches(result.records)
    verdict = (
        "The fold's answers equal full attention's on every sample."
        if not mismatches
        else f"The fold's answers differ from full attention's on {len(mismatches)} samples: "
        f"{mismatches}"
    )
    page = [
        f"# longkv niah: {args.model}, {args.dtype}",
        "",
        *provenance_lines(prov),
        f"- fold chunk {settings.chunk_size}; StreamingLLM {settings.sinks} sinks + "
        f"{settings.window} recent, chunk {settings.stream_chunk}; greedy, at most "
        f"{settings.max_new_tokens} new tokens; {settings.samples} sample(s) per cell",
        "",
        "string_match_all (0-100) per task, method and context length, over depths "
        f"{list(settings.depths)}:",
        "",
        table,
        verdict,
        "",
        f"![heatmap]({stem.name}.png)",
    ]
    print(table + verdict)
    write_atomic(stem.with_suffix(".md"), "\n".join(page) + "\n")
    heatmap(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, {stem}.md, {stem}.png")
    return 0
