"""The page of `longkv bench anchor`: each reader's time and peak against llama.cpp's, where
its peak goes, and how closely the readers agree."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from longkv.bench.anchor import LLAMA_CPP, AnchorSettings, reader_parts, run_key
from longkv.results import finish_figure, markdown_table, pyplot, write_report

MIB = 2**20
# the bar for longkv's fold against llama.cpp at the same ids: peak and read time
TARGETS = {"peak": 2.0, "seconds": 0.8}
NLL_TOLERANCE = 0.01  # and a fold reader's NLL of the last ids from the float32 fold's
# the parts of a peak (`breakdown`), in the order they stack
PARTS = ("runtime", "weights", "read keeps", "transient")


def runs_of(parts: dict[str, Any], n: int, method: str) -> list[dict[str, Any]]:
    """The finished rounds of one reader at n ids, in order."""
    runs, repeat = [], 0
    while (key := run_key(n, method, repeat)) in parts:
        runs.append(parts[key])
        repeat += 1
    return runs


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median read seconds, peak MiB and decoding seconds per token over rounds."""
    per_token = [r["decode_seconds"] / max(1, len(r["continuation"])) for r in runs]
    return {
        "seconds": statistics.median(r["seconds"] for r in runs),
        "peak": statistics.median(r["peak_bytes"] for r in runs) / MIB,
        "per_token": statistics.median(per_token),
    }


def breakdown(run: dict[str, Any]) -> dict[str, float]:
    """MiB of a run's peak by part (`PARTS`), from its resident memory at each stage: the
    process with its libraries imported, the rise from loading the weights, what the read
    keeps at its end, and how far the peak went above that; they add up to the peak."""
    st = run["stages"]
    return {
        "runtime": st["imports"]["rss"] / MIB,
        "weights": (st["loaded"]["rss"] - st["imports"]["rss"]) / MIB,
        "read keeps": (st["read"]["rss"] - st["loaded"]["rss"]) / MIB,
        "transient": (run["peak_bytes"] - st["read"]["rss"]) / MIB,
    }


def ratio(value: float, anchor: dict[str, float] | None, key: str) -> str:
    """value over llama.cpp's (key of its medians), "-" without llama.cpp."""
    return "-" if anchor is None else f"{value / anchor[key]:.2f}"


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def length_rows(parts: dict[str, Any], n: int, methods: list[str]) -> list[list[str]]:
    """Time and peak of each reader at n ids."""
    anchored = runs_of(parts, n, LLAMA_CPP)
    anchor = medians(anchored) if anchored else None
    rows = []
    for method in methods:
        runs = runs_of(parts, n, method)
        if not runs:
            continue
        m = medians(runs)
        rows.append([
            method, " / ".join(f"{r['seconds']:.1f}" for r in runs), f"{m['seconds']:.1f}",
            ratio(m["seconds"], anchor, "seconds"), f"{m['peak']:.0f}",
            ratio(m["peak"], anchor, "peak"), f"{m['per_token']:.3f}",
        ])  # fmt: skip
    return rows


def agreement_rows(parts: dict[str, Any], n: int, methods: list[str]) -> list[list[str]]:
    """Each reader's NLL of the last ids and greedy continuation against llama.cpp's and the
    fold's (the first round's)."""
    first = {m: parts[run_key(n, m, 0)] for m in methods if run_key(n, m, 0) in parts}
    rows = []
    for method, r in first.items():
        cells = [method, "-" if r["nll"] is None else f"{r['nll']:.4f}"]
        for other in (LLAMA_CPP, "fold"):
            o = first.get(other)
            ok = o is not None and r["nll"] is not None and o["nll"] is not None
            cells.append(f"{r['nll'] - o['nll']:+.4f}" if ok else "-")  # type: ignore[index]
        anchor = first.get(LLAMA_CPP)
        cells.append(
            "-" if anchor is None
            else f"{same_prefix(r['continuation'], anchor['continuation'])} of "
            f"{len(anchor['continuation'])}"
        )  # fmt: skip
        cells.append(" ".join(r.get("continuation_text", "").split()))
        rows.append(cells)
    return rows


def breakdown_rows(parts: dict[str, Any], n: int, methods: list[str]) -> list[list[str]]:
    """Where each reader's peak goes (its first round), and the tensors longkv counts."""
    rows = []
    for method in methods:
        key = run_key(n, method, 0)
        if key not in parts:
            continue
        r, b = parts[key], breakdown(parts[key])
        counted = [r.get("weight_bytes"), r.get("cache_bytes")]
        rows.append([
            method, *(f"{b[p]:.0f}" for p in PARTS), f"{r['peak_bytes'] / MIB:.0f}",
            *("-" if c is None else f"{c / MIB:.0f}" for c in counted),
        ])  # fmt: skip
    return rows


def verdicts(parts: dict[str, Any], n: int, methods: list[str]) -> list[str]:
    """Each fold reader against TARGETS at n ids, where it and llama.cpp ran, and its NLL of
    the last ids against the float32 fold's (within NLL_TOLERANCE)."""
    anchored = runs_of(parts, n, LLAMA_CPP)
    if not anchored:
        return []
    a, base = medians(anchored), parts.get(run_key(n, "fold", 0), {}).get("nll")
    lines = []
    for method in (m for m in methods if reader_parts(m)[0] == "fold"):
        runs = runs_of(parts, n, method)
        if not runs:
            continue
        f, checks = medians(runs), []
        for key, bar in TARGETS.items():
            what = "peak" if key == "peak" else "read time"
            value = f[key] / a[key]
            checks.append((f"{what} {value:.2f}x llama.cpp's (target <= {bar}x)", value <= bar))
        nll = runs[0]["nll"]
        if method != "fold" and nll is not None and base is not None:
            gap = nll - base
            checks.append((f"NLL {gap:+.4f} from the fold's (target within {NLL_TOLERANCE})",
                           abs(gap) <= NLL_TOLERANCE))  # fmt: skip
        said = "; ".join(f"{text}: {'met' if ok else 'missed'}" for text, ok in checks)
        lines.append(f"- {method}: {said}")
    return lines


def write_page(report: dict[str, Any], s: AnchorSettings, payload: dict[str, Any]) -> list[Path]:
    """<out_dir>/<name>.json, .md and .png."""
    parts = report["parts"]
    methods = [m for m in s.methods if m not in report["skipped"]]
    body = ["", *(f"- {m}: skipped, {why}" for m, why in report["skipped"].items())]
    body += [
        f"- ids: the first tokens of {s.text} (the model's tokenizer); every reader reads all but "
        f"the last (timed: read s), then the last and up to {s.continue_tokens} greedy tokens "
        f"(decode s/token); {s.threads} threads; each read in a process of its own, "
        f"{s.repeats} rounds, the readers interleaved; llama.cpp: flash attention, batch "
        f"{s.llama_batch}; streaming: {s.budget} entries; two-level: its default",
        "- peak: the process's resident high-water mark (VmHWM) after decoding, libraries "
        "and weights included; medians over the rounds",
    ]
    for n in s.tokens:
        targets = verdicts(parts, n, methods)
        body += [
            "", f"## {n} tokens", "",
            *markdown_table(
                ["reader", "read s (rounds)", "read s", "x llama.cpp", "peak MiB",
                 "x llama.cpp", "decode s/token"],
                length_rows(parts, n, methods), "<>>>>>>",
            ),
            *(["", *targets] if targets else []), "",
            f"Agreement (first round): mean NLL of the last {s.nll_tokens} ids, and the greedy "
            "continuation's leading tokens equal to llama.cpp's.", "",
            *markdown_table(
                ["reader", "NLL", "- llama.cpp", "- fold", "continuation = llama.cpp",
                 "continuation"],
                agreement_rows(parts, n, methods), "<>>>><",
            ),
            "", "Where the peak goes (first round, MiB): the process with its libraries "
            "imported (runtime), the rise from loading the weights, what the read keeps at its "
            "end (its cache, and freed memory the allocator kept), and the peak's rise above "
            "that (transient); longkv also counts its weights' and its read's cache tensors.",
            "",
            *markdown_table(
                ["reader", *PARTS, "peak", "weight tensors", "cache tensors"],
                breakdown_rows(parts, n, methods), "<>>>>>>>",
            ),
        ]  # fmt: skip
    out = Path(s.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = f"longkv bench anchor: {s.model} against llama.cpp"
    draw = lambda png: plot(parts, s, methods, png)  # noqa: E731
    return write_report(out / s.name, title, payload, body, draw)


def plot(parts: dict[str, Any], s: AnchorSettings, methods: list[str], png: Path) -> None:
    """Per length: each reader's peak, stacked by part, and its read seconds."""
    plt = pyplot()
    fig, axes = plt.subplots(len(s.tokens), 2, figsize=(10, 3 * len(s.tokens)), squeeze=False)
    for (left, right), n in zip(axes, s.tokens, strict=True):
        shown = [m for m in methods if runs_of(parts, n, m)]
        base = [0.0] * len(shown)
        for part in PARTS:
            sizes = [breakdown(parts[run_key(n, m, 0)])[part] for m in shown]
            left.barh(shown, sizes, left=base, label=part)
            base = [b + x for b, x in zip(base, sizes, strict=True)]
        left.set_xlabel(f"peak resident MiB, {n} tokens")
        left.invert_yaxis()
        right.barh(shown, [medians(runs_of(parts, n, m))["seconds"] for m in shown])
        right.set_xlabel(f"read seconds, {n} tokens")
        right.invert_yaxis()
    axes[0][0].legend(fontsize="small")
    finish_figure(fig, png, f"{s.model}: longkv against llama.cpp, {s.threads} threads")
