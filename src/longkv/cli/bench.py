"""`longkv bench kvm` and `longkv bench train`: options from their settings dataclasses."""

from __future__ import annotations

import argparse

from longkv.bench import kvm as bench_kvm
from longkv.bench import train as bench_train
from longkv.cli.args import HelpFormatter, add_settings


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """`bench` and its benchmarks, `bench kvm` and `bench train`."""
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    kvm = benches.add_parser(
        "kvm",
        help="prefill/decode time and peak memory: KVM vs BSWA vs full attention",
        description=bench_kvm.__doc__,
        formatter_class=HelpFormatter,
    )
    add_settings(kvm, bench_kvm.BenchSettings)
    kvm.set_defaults(func=_run_bench_kvm)
    train = benches.add_parser(
        "train",
        help="training tokens/s of kvm fixed, kvm sqrt, bswa and full at each context",
        description=bench_train.__doc__,
        formatter_class=HelpFormatter,
    )
    add_settings(train, bench_train.TrainBenchSettings)
    train.set_defaults(func=_run_bench_train)


def _run_bench_kvm(args: argparse.Namespace, argv: list[str]) -> int:
    result = bench_kvm.run(args.settings[bench_kvm.BenchSettings], argv)
    print(bench_kvm.table(result))
    paths = bench_kvm.save(result)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def _run_bench_train(args: argparse.Namespace, argv: list[str]) -> int:
    settings = args.settings[bench_train.TrainBenchSettings]
    report = bench_train.run(settings, argv)
    paths = bench_train.save(report, settings)
    print(paths[1].read_text())
    return 0
