"""`longkv bench document`: a kept read against reading again, and a read saved and loaded.

The document is the first `tokens` tokens of a shipped novel. Per method run (full, fold,
two-level KVM-Fold, ...): the document is read once (`longkv.read`) and asked the first question
(which also warms up the decoding path), then the second; its time to the first answer token is
set against that of a fresh read of document and second question (`read_and_answer`, the path
`longkv ask` took for every question before reads were kept), whose answer it is compared with,
token for token (greedy). Then the read is saved and loaded (size, seconds) twice, every tensor
as held and by default (`kv_dtype` auto: a float32 read's keys and values in float16), and each
loaded read asked the second question again: its answer must equal the kept read's. Two-level
runs once per leaf store (`leaves`); the fresh read is made for the first only (the others
differ from it in the leaves alone). Runs go one after another, nothing else running: time it
alone.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from longkv.bench import check_threads, threads_setting, use_threads
from longkv.caches.bounded import STREAM_CHUNK
from longkv.caches.kvm_fold import KVMFoldConfig
from longkv.caches.methods import BoundedOptions, make_runner, read_and_answer
from longkv.checks import require, require_at_least, require_known, setting
from longkv.data.corpus import read_text
from longkv.document.prompt import document_ids, prompt_ids
from longkv.document.read import AUTO, METHODS, Document, read_ids, read_settings
from longkv.document.save import dtype_name, load, save
from longkv.dtypes import DTYPES
from longkv.fold.fold import FOLD_CHUNK
from longkv.results import (
    OUT_DIR,
    OUT_DIR_HELP,
    finish_figure,
    markdown_table,
    provenance,
    pyplot,
    write_report,
)

LEAVES = ("exact", "int8", "file")


@dataclass(frozen=True)
class DocumentBenchSettings:
    """`longkv bench document`: the document, the questions, the methods."""

    text: str = setting("austen/prideprejudice.txt.gz", "the shipped novel the document opens")
    tokens: int = setting(
        7800,
        "tokens of the novel the document holds (with the template, question and answer, "
        "within SmolLM2's 8192 positions)",
    )
    questions: tuple[str, ...] = setting(
        ("Who has taken Netherfield Park?", "How old is Charlotte Lucas?"),
        "two questions: the first warms up, the second is timed against a fresh read",
    )
    methods: tuple[str, ...] = setting(
        ("full", "fold", "two-level"), "method runs", choices=METHODS
    )
    leaves: tuple[str, ...] = setting(
        LEAVES, "two-level: leaf stores, each run once (the fresh read with the first)",
        choices=LEAVES,
    )  # fmt: skip
    budget: int = setting(1024, "bounded methods: entries per layer and KV head")
    kvm_open: int = setting(8, "two-level: slots each query head opens")
    chunk_size: int = setting(FOLD_CHUNK, "fold: chunk (tokens)")
    stream_chunk: int = setting(STREAM_CHUNK, "bounded methods: chunk (tokens)")
    max_new_tokens: int = setting(32, "answer tokens at most")
    dtype: str = setting("fp32", "weights and activations", choices=sorted(DTYPES))
    threads: int | None = threads_setting()
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    name: str = setting("document_bench", "stem of the result files")

    def __post_init__(self) -> None:
        require_at_least(1, self, "tokens", "budget", "kvm_open", "chunk_size", "stream_chunk",
                         "max_new_tokens")  # fmt: skip
        require_known(self, "methods", self.methods, METHODS)
        require_known(self, "leaves", self.leaves, LEAVES)
        check_threads(self)
        require(
            len(self.questions) == 2, self, "questions",
            f"give two questions, got {len(self.questions)}",
        )  # fmt: skip

    def runs(self) -> list[tuple[str, str, Any, bool]]:
        """(label, method, bounded config or None, with a fresh read) of each run."""
        out: list[tuple[str, str, Any, bool]] = []
        for method in self.methods:
            if method != "two-level":
                configs = BoundedOptions(budgets=(self.budget,)).bounded_configs((method,))
                out.append((method, method, next(iter(configs.values()), None), True))
                continue
            for i, leaves in enumerate(self.leaves):
                config = KVMFoldConfig(budget=self.budget, open=self.kvm_open, leaves=leaves)
                out.append((f"two-level/{leaves}", "kvm-fold", config, i == 0))
        return out


def document_text(tokenizer: Any, name: str, tokens: int) -> str:
    """The first `tokens` tokens of shipped text `name`, as text."""
    ids = tokenizer(read_text(name), add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def fresh_answer(
    model: nn.Module, tokenizer: Any, text: str, question: str, method: str, config: Any,
    s: DocumentBenchSettings,
) -> dict[str, Any]:  # fmt: skip
    """A read of document and question together, then its greedy answer: seconds to its first
    token and its tokens."""
    ids = torch.tensor([prompt_ids(tokenizer, text, question)])
    eos = getattr(tokenizer, "eos_token_id", None)
    start = time.perf_counter()
    first: list[float] = []
    runner = None if config is None else make_runner(model, config)
    out = read_and_answer(
        model, ids, method if config is None else "bounded", s.max_new_tokens, runner=runner,
        chunk_size=s.chunk_size, stream_chunk=s.stream_chunk, eos_token_id=eos,
        on_token=lambda _: first.append(time.perf_counter() - start) if not first else None,
    )[0].tolist()  # fmt: skip
    tokens = [t for t in out if t != eos]
    return {"first_token_seconds": first[0], "tokens": tokens}


def measure_run(
    model: nn.Module, tokenizer: Any, text: str, run: tuple[str, str, Any, bool],
    s: DocumentBenchSettings, folder: Path,
) -> dict[str, Any]:  # fmt: skip
    """One run: the kept read, its two answers, the fresh read, the save and the load."""
    label, method, config, with_fresh = run
    ids = document_ids(tokenizer, text)
    settings = read_settings(method, config, chunk_size=s.chunk_size, stream_chunk=s.stream_chunk)
    doc: Document = read_ids(model, tokenizer, ids, settings)
    q1, q2 = s.questions
    ask = {"max_new_tokens": s.max_new_tokens, "stop_at_repeat": False}
    first, second = doc.ask(q1, **ask), doc.ask(q2, **ask)
    out: dict[str, Any] = {
        "run": label, "label": settings.label, "document_tokens": doc.tokens,
        "read_seconds": doc.read_seconds, "pending_tokens": len(doc.pending),
        "kept": {
            "first_token_seconds": second.first_token_seconds, "seconds": second.seconds,
            "read_tokens": second.read_tokens, "answer": second.text,
            "first_answer": first.text,
        },
    }  # fmt: skip
    if with_fresh:
        fresh = fresh_answer(model, tokenizer, text, q2, method, config, s)
        out["fresh"] = {"first_token_seconds": fresh["first_token_seconds"]}
        out["speedup"] = fresh["first_token_seconds"] / second.first_token_seconds
        out["equal_to_fresh"] = fresh["tokens"] == second.tokens
    for kind, kv_dtype in (("held", dtype_name(model)), ("narrow", AUTO)):
        start = time.perf_counter()
        where = save(doc, folder / label.replace("/", "-"), kv_dtype)
        saved = {"save_seconds": time.perf_counter() - start}
        saved["save_bytes"] = sum(p.stat().st_size for p in where.iterdir())
        start = time.perf_counter()
        loaded = load(where, model, tokenizer)
        saved["load_seconds"] = time.perf_counter() - start
        loaded_answer = loaded.ask(q2, **ask)
        saved["loaded_equal"] = loaded_answer.tokens == second.tokens
        saved["loaded_answer"] = loaded_answer.text
        out[kind] = saved
        shutil.rmtree(where)
    return out


def run(
    model: nn.Module, tokenizer: Any, s: DocumentBenchSettings, argv: list[str] | None = None
) -> dict[str, Any]:
    """Every run of s, one after another (`measure_run`), with the provenance."""
    use_threads(s.threads)
    text = document_text(tokenizer, s.text, s.tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="longkv-bench-document-") as tmp:
        for r in s.runs():
            print(f"{r[0]} ...", flush=True)
            rows.append(measure_run(model, tokenizer, text, r, s, Path(tmp)))
    return {"provenance": provenance(argv), "settings": asdict(s), "runs": rows}


def write_page(report: dict[str, Any], s: DocumentBenchSettings) -> list[Path]:
    """<out_dir>/<name>.json, .md and .png (seconds to the first answer token, kept and fresh)."""
    rows = []
    for r in report["runs"]:
        fresh = r.get("fresh", {}).get("first_token_seconds")
        rows.append([
            r["label"], str(r["document_tokens"]), f"{r['read_seconds']:.1f}",
            f"{r['kept']['first_token_seconds']:.2f}",
            "-" if fresh is None else f"{fresh:.1f}",
            "-" if fresh is None else f"{r['speedup']:.0f}x",
            "-" if fresh is None else ("yes" if r["equal_to_fresh"] else "no"),
            *(x for kind in ("held", "narrow") for x in (
                f"{r[kind]['save_bytes'] / 2**20:.1f}", f"{r[kind]['save_seconds']:.2f}",
                f"{r[kind]['load_seconds']:.2f}", "yes" if r[kind]["loaded_equal"] else "no",
            )),
        ])  # fmt: skip
    q1, q2 = s.questions
    body = [
        "",
        f'- document: the first {s.tokens} tokens of {s.text}; questions: "{q1}" (first, '
        f'not timed), then "{q2}" (timed); greedy, at most {s.max_new_tokens} tokens',
        "- first token, kept: seconds from the second question to its first answer token, "
        "from the kept read; fresh: from reading document and question again; speedup: "
        "fresh / kept; same answer: the kept read's answer equals the fresh read's, token for "
        "token; loaded: the answer of the saved and loaded read equals the kept read's; as held: "
        "the save keeps every tensor in its dtype; narrow: in the default "
        "(`kv_dtype` auto: keys and values in float16 for a float32 read, sums and counts as "
        "held)",
        "",
        *markdown_table(
            [
                "run",
                "tokens",
                "read s",
                "first token kept s",
                "fresh s",
                "speedup",
                "same answer",
                *(
                    f"{x} ({kind})"
                    for kind in ("as held", "narrow")
                    for x in ("save MiB", "save s", "load s", "loaded")
                ),
            ],
            rows,
            "<" + ">" * 14,
        ),
        "",
        *(f'- {r["label"]}: "{" ".join(r["kept"]["answer"].split())}"' for r in report["runs"]),
    ]
    out = Path(s.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_report(
        out / s.name, "A kept read against reading again", report, body,
        lambda png: plot_first_tokens(report, png, s),
    )  # fmt: skip


def plot_first_tokens(report: dict[str, Any], png: Path, s: DocumentBenchSettings) -> None:
    """Seconds to the first answer token, kept read and read again, per method run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    timed = [r for r in report["runs"] if "fresh" in r]
    x = range(len(timed))
    kept = [r["kept"]["first_token_seconds"] for r in timed]
    fresh = [r["fresh"]["first_token_seconds"] for r in timed]
    ax.bar([i - 0.2 for i in x], fresh, 0.4, label="read again")
    ax.bar([i + 0.2 for i in x], kept, 0.4, label="kept read")
    ax.set_xticks(list(x), [r["label"] for r in timed])
    ax.set_yscale("log")
    ax.set_ylabel("seconds to the first answer token")
    ax.legend()
    finish_figure(fig, png, f"{s.tokens} tokens of {s.text}: a second question")
