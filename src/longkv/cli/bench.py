"""`longkv bench kvm`, `train`, `document`, `qa`, `readme`, `routing`, `serve` and `anchor`:
options from their settings dataclasses."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from longkv.bench import anchor as bench_anchor
from longkv.bench import anchor_page, kvm_page
from longkv.bench import document as bench_document
from longkv.bench import kvm as bench_kvm
from longkv.bench import qa as bench_qa
from longkv.bench import readme as bench_readme
from longkv.bench import routing as bench_routing
from longkv.bench import serve as bench_serve
from longkv.bench import train as bench_train
from longkv.cli.args import HelpFormatter, command
from longkv.cli.common import LoadOptions, require_own_page, require_positions
from longkv.results import provenance


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """`bench` and its benchmarks."""
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for bench, module, settings, run, help_text in (
        ("kvm", bench_kvm, bench_kvm.BenchSettings, _run_bench_kvm,
         "prefill/decode time and peak memory: KVM vs BSWA vs full attention"),
        ("train", bench_train, bench_train.TrainBenchSettings, _run_bench_train,
         "training tokens/s of kvm fixed, kvm sqrt, bswa and full at each context"),
        ("document", bench_document, bench_document.DocumentBenchSettings, _run_bench_document,
         "a kept read against reading again (first-token seconds), saved and loaded"),
        ("qa", bench_qa, bench_qa.QABenchSettings, _run_bench_qa,
         "questions about a shipped novel, by method and prompt, scored by string match"),
        ("readme", bench_readme, bench_readme.ReadmeBenchSettings, _run_bench_readme,
         "the README's Python blocks on text of realistic length, each statement bounded"),
        ("routing", bench_routing, bench_routing.RoutingSettings, _run_bench_routing,
         "the share of full attention's mass each bounded cache attends exactly, by length"),
        ("serve", bench_serve, bench_serve.ServeBenchSettings, _run_bench_serve,
         "longkv serve over HTTP: a second question's first token, requests per minute"),
        ("anchor", bench_anchor, bench_anchor.AnchorSettings, _run_bench_anchor,
         "longkv's reads against llama.cpp's on the same ids: seconds, peak memory, agreement"),
    ):  # fmt: skip
        sub = benches.add_parser(
            bench, help=help_text, description=module.__doc__, formatter_class=HelpFormatter
        )
        loads = bench in ("document", "qa", "routing")
        kept = "the finished measurements are beside the page (.partial.json)"
        command(
            sub, run, *((LoadOptions,) if loads else ()), settings,
            kept=kept if bench in ("routing", "anchor") else None,
        )  # fmt: skip


def own_page(settings: Any) -> None:
    """Refuse --name where the benchmark's page holds a run of other settings."""
    require_own_page(Path(settings.out_dir) / f"{settings.name}.json", asdict(settings), settings)


def _run_bench_kvm(args: argparse.Namespace, argv: list[str]) -> int:
    own_page(args.settings[bench_kvm.BenchSettings])
    result = bench_kvm.run(args.settings[bench_kvm.BenchSettings], argv)
    print(kvm_page.table(result))
    paths = kvm_page.save(result)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def _run_bench_train(args: argparse.Namespace, argv: list[str]) -> int:
    settings = args.settings[bench_train.TrainBenchSettings]
    own_page(settings)
    report = bench_train.run(settings, argv)
    paths = bench_train.save(report, settings)
    print(paths[1].read_text())
    return 0


def _run_bench_document(args: argparse.Namespace, argv: list[str]) -> int:
    m = args.settings[LoadOptions]
    settings = args.settings[bench_document.DocumentBenchSettings]
    own_page(settings)
    model, tokenizer = m.load(settings.dtype)
    report = bench_document.run(model, tokenizer, settings, argv)
    paths = bench_document.write_page(report, settings)
    print(paths[1].read_text())
    return 0


def _run_bench_qa(args: argparse.Namespace, argv: list[str]) -> int:
    m, settings = args.settings[LoadOptions], args.settings[bench_qa.QABenchSettings]
    own_page(settings)
    model, tokenizer = m.load(settings.dtype)
    paths = bench_qa.write_page(bench_qa.run(model, tokenizer, settings, argv), settings)
    print(paths[1].read_text())
    return 0


def _run_bench_readme(args: argparse.Namespace, argv: list[str]) -> int:
    """Exit status 1 where a statement was stopped at the bound."""
    settings = args.settings[bench_readme.ReadmeBenchSettings]
    own_page(settings)
    report = bench_readme.run(settings, argv)
    paths = bench_readme.write_page(report, settings)
    print(paths[1].read_text())
    return 0 if bench_readme.within_bound(report) else 1


def _run_bench_routing(args: argparse.Namespace, argv: list[str]) -> int:
    m, s = args.settings[LoadOptions], args.settings[bench_routing.RoutingSettings]
    # what the recall depends on (not the folder, so measurements may move with the page)
    settings = {**{k: v for k, v in asdict(s).items() if k != "out_dir"}, "model": m.model}
    stem = Path(s.out_dir) / s.name
    require_own_page(stem.with_suffix(".json"), settings, s)
    model, tokenizer = m.load(s.dtype)
    s.check_runs(model, s.methods)
    longest = max(s.lengths)  # full attention's reference reads the longest input
    require_positions(model, longest, s, "lengths", f"{longest} tokens", m.allow_extrapolation)
    parts = bench_routing.run(model, tokenizer, s, settings, s.corpus_dir, m.allow_extrapolation)
    payload = {"provenance": provenance(argv), "settings": settings, "parts": parts}
    paths = bench_routing.write_page(parts, s, payload, f"longkv bench routing: {m.model}")
    stem.with_suffix(".partial.json").unlink(missing_ok=True)
    print(paths[1].read_text())
    return 0


def _run_bench_serve(args: argparse.Namespace, argv: list[str]) -> int:
    settings = args.settings[bench_serve.ServeBenchSettings]
    own_page(settings)
    report = bench_serve.run(settings, argv)
    paths = bench_serve.write_page(report, settings)
    print(paths[1].read_text())
    return 0


def _run_bench_anchor(args: argparse.Namespace, argv: list[str]) -> int:
    s = args.settings[bench_anchor.AnchorSettings]
    settings = bench_anchor.page_settings(s)
    stem = Path(s.out_dir) / s.name
    require_own_page(stem.with_suffix(".json"), settings, s)
    report = bench_anchor.run(s, settings)
    payload = {"provenance": provenance(argv), "settings": settings, **report}
    paths = anchor_page.write_page(report, s, payload)
    stem.with_suffix(".partial.json").unlink(missing_ok=True)
    print(paths[1].read_text())
    return 0
