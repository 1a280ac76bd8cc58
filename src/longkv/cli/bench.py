"""`longkv bench kvm` and `longkv bench train`."""

from __future__ import annotations

import argparse

from longkv.bench import kvm as bench_kvm
from longkv.bench import train as bench_train
from longkv.cli.args import settings_from_args


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """Register `bench kvm` and `bench train`."""
    bench = commands.add_parser("bench", help="speed and memory benchmarks")
    benches = bench.add_subparsers(dest="bench", required=True)
    _bench_kvm_parser(benches)
    _bench_train_parser(benches)


def _bench_kvm_parser(sub: argparse._SubParsersAction) -> None:
    d = bench_kvm.BenchSettings()
    p = sub.add_parser(
        "kvm",
        help="prefill/decode time and peak memory: KVM vs BSWA vs full attention",
        description=bench_kvm.__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--lengths", type=int, nargs="+", default=list(d.lengths), help="context lengths T"
    )
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--chunk-len", type=int, default=d.chunk_len)
    p.add_argument("--window-chunks", type=int, default=d.window_chunks)
    p.add_argument("--dtype", choices=sorted(bench_kvm.DTYPES), default=d.dtype)
    p.add_argument("--device", default=d.device)
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed prefill calls (median)")
    p.add_argument(
        "--decode-tokens", type=int, default=None, help="decode steps timed (default: chunk-len)"
    )
    p.add_argument("--methods", nargs="+", choices=bench_kvm.METHODS, default=list(d.methods))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--no-keep-heap",
        dest="keep_heap",
        action="store_false",
        help="let glibc return freed memory to the OS (timings then include page faults)",
    )
    p.add_argument("--out-dir", default=d.out_dir, help="where the JSON and PNG go")
    p.add_argument("--name", default=d.name, help="file name stem of the results")
    p.set_defaults(func=_run_bench_kvm)


def _run_bench_kvm(args: argparse.Namespace, argv: list[str]) -> int:
    settings = settings_from_args(bench_kvm.BenchSettings, args)
    result = bench_kvm.run(settings, argv)
    print(bench_kvm.table(result))
    paths = bench_kvm.save(result)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def _bench_train_parser(sub: argparse._SubParsersAction) -> None:
    d = bench_train.TrainBenchSettings()
    p = sub.add_parser(
        "train",
        help="training tokens/s of kvm fixed, kvm sqrt, bswa and full at each context",
        description=bench_train.__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--contexts", type=int, nargs="+", default=list(d.contexts))
    p.add_argument(
        "--variants", nargs="+", choices=list(bench_train.VARIANTS), default=list(d.variants)
    )
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--out-dir", default=d.out_dir)
    p.add_argument("--name", default=d.name)
    p.set_defaults(func=_run_bench_train)


def _run_bench_train(args: argparse.Namespace, argv: list[str]) -> int:
    settings = settings_from_args(bench_train.TrainBenchSettings, args)
    report = bench_train.run(settings, argv)
    paths = bench_train.save(report, settings)
    print(paths[1].read_text())
    return 0
