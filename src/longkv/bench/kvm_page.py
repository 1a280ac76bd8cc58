"""`longkv bench kvm`'s page: the measurements as a plain-text table, a markdown page and a plot
(`longkv.bench.kvm` measures them)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from longkv.bench import ratios_table, verdict
from longkv.bench.kvm import BenchResult, Measurement
from longkv.results import finish_figure, markdown_table, pyplot, write_report

COLUMNS = (
    "method", "T", "prefill ms", "floor ms", "GFLOP", "peak MiB", "decode ms/token",
    "decode floor ms", "state MiB",
)  # fmt: skip


def cells(m: Measurement) -> list[str]:
    """One measurement's row of COLUMNS."""
    peak = "n/a" if m.prefill_peak_bytes is None else f"{m.prefill_peak_bytes / 2**20:.1f}"
    return [
        m.method, str(m.T), f"{m.prefill_s * 1e3:.1f}", f"{m.prefill_floor_s * 1e3:.1f}",
        f"{m.prefill_flops / 1e9:.2f}", peak, f"{m.decode_s_per_token * 1e3:.3f}",
        f"{m.decode_floor_s * 1e3:.4f}", f"{m.state_bytes / 2**20:.2f}",
    ]  # fmt: skip


def table(r: BenchResult) -> str:
    """Plain-text table of the measurements and ratios."""
    rows = [list(COLUMNS)] + [cells(m) for m in r.measurements]
    widths = [max(len(row[i]) for row in rows) + 2 for i in range(len(COLUMNS))]
    lines = ["".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.append("")
    for name, ratio in r.ratios.items():
        said = verdict(ratio)
        lines.append(f"{name:<48}{ratio['value']:>8.2f}" + (f"  (target {said})" if said else ""))
    return "\n".join(lines)


def plot(r: BenchResult, path: Path) -> None:
    """Prefill time, peak memory and decode time against context length, one line per method."""
    plt = pyplot()
    panels = [
        ("prefill_s", "prefill time (s)"),
        ("prefill_peak_bytes", "prefill peak memory (MiB)"),
        ("decode_s_per_token", "decode time per token (ms)"),
    ]
    scale = {"prefill_s": 1.0, "prefill_peak_bytes": 2.0**-20, "decode_s_per_token": 1e3}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for method in r.settings.methods:
            ms = [m for m in r.measurements if m.method == method]
            ys = [getattr(m, key) for m in ms]
            if any(y is None for y in ys):
                continue
            ax.plot([m.T for m in ms], [y * scale[key] for y in ys], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length T (tokens)")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    s, p = r.settings, r.provenance
    title = (
        f"B={s.batch} H={s.heads} D={s.head_dim} {s.dtype} C={s.chunk_len} N={s.window_chunks} "
        f"on {s.device} ({p['machine']['cpu_count']} CPUs) at {p['commit'][:12]}"
    )
    finish_figure(fig, path, title, title_size=10)


def markdown_body(r: BenchResult) -> list[str]:
    """The page below its provenance: settings, the measurements and the ratios."""
    p, s = r.provenance, r.settings
    return [
        f"- settings: B={s.batch} H={s.heads} D={s.head_dim} {s.dtype} on {s.device}, "
        f"C={s.chunk_len} N={s.window_chunks}, median of {s.repeats} prefills; decode: the "
        f"median over {s.repeats} runs of the mean of {s.n_decode} tokens; heap kept: "
        f"{p.get('heap_kept')}",
        "- floor: the matmul FLOPs the method needs (GFLOP: q.k and p.v over the visible "
        "pairs, KVM's token-slot and OVQ's token-centroid similarities) at the rate this "
        "machine ran matmuls of "
        "the same shapes in this run (`longkv.bench.flops`)",
        "",
        *markdown_table(COLUMNS, map(cells, r.measurements), "<" + ">" * (len(COLUMNS) - 1)),
        "",
        *ratios_table(r.ratios),
    ]


def save(r: BenchResult) -> list[Path]:
    """Write <out_dir>/<name>.json, .md and .png atomically; return their paths."""
    stem = Path(r.settings.out_dir) / r.settings.name
    payload = {
        "provenance": r.provenance,
        "settings": asdict(r.settings),
        "measurements": [asdict(m) for m in r.measurements],
        "ratios": r.ratios,
    }
    return write_report(
        stem, "longkv bench kvm", payload, markdown_body(r), lambda png: plot(r, png)
    )
