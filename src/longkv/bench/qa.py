"""`longkv bench qa`: questions with known answers about a shipped novel, answered by each method
with each prompt, scored by string match.

The document is the first `tokens` tokens of Pride and Prejudice; each of `QUESTIONS` has
answers that a correct reply contains (any of them, case-insensitive), each found in those
tokens. Prompts: "after", the question after the document alone (what a kept read answers:
one read, then every question); "both", the question stated before the document too (as
long-context QA prompts do), which needs a read per question. Each answer is greedy and
decoded to `max_new_tokens` in full, then scored twice: whole, and cut where it starts to
repeat itself (`document.repeat`: what `Document.ask` returns with stop_at_repeat, which stops
decoding there). Answers are deterministic given the read, so the scores need no quiet machine; the
seconds are reported only as what the run took.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn

from longkv.bench.document import document_text
from longkv.caches.bounded import STREAM_CHUNK
from longkv.caches.kvm_fold import KVMFoldConfig
from longkv.checks import require_at_least, require_known, setting
from longkv.document.prompt import document_ids
from longkv.document.read import read_ids, read_settings
from longkv.document.repeat import AnswerWatch
from longkv.dtypes import DTYPES
from longkv.fold.fold import FOLD_CHUNK
from longkv.results import OUT_DIR, OUT_DIR_HELP, markdown_table, provenance, write_report

TEXT = "austen/prideprejudice.txt.gz"
# (question, answers a correct reply contains), each answer within the novel's first 7800 tokens
QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Who has taken Netherfield Park?", ("bingley",)),
    ("Who told Mrs. Bennet that Netherfield is taken?", ("mrs. long",)),
    ("How did Mr. Bingley come down to see Netherfield?", ("chaise",)),
    ("How much does Mr. Darcy have a year?", ("ten thousand", "10,000", "10000")),
    ("In which county is Mr. Darcy's large estate?", ("derbyshire",)),
    ("Who is Mr. Bingley's brother-in-law?", ("hurst",)),
    ("Which of the Bennet sisters keeps coughing?", ("kitty",)),
    ("What is the name of the village where the Bennets live?", ("longbourn",)),
    ("What is the name of Sir William Lucas's house?", ("lucas lodge",)),
    ("How old is Charlotte Lucas?", ("twenty-seven", "27")),
    ("What word did Mr. Darcy use for Elizabeth's looks at the ball?", ("tolerable",)),
    ("How did Sir William Lucas get his knighthood?", ("address", "mayor")),
)
PROMPTS = ("after", "both")
METHODS = ("full", "fold", "two-level")


@dataclass(frozen=True)
class QABenchSettings:
    """`longkv bench qa`: the document's length, the methods, the prompts."""

    tokens: int = setting(7800, "tokens of Pride and Prejudice the document holds")
    methods: tuple[str, ...] = setting(METHODS, "method runs", choices=METHODS)
    prompts: tuple[str, ...] = setting(
        PROMPTS, "after: the question after the document; both: before it too", choices=PROMPTS
    )
    budget: int = setting(1024, "two-level: entries per layer and KV head")
    kvm_open: int = setting(8, "two-level: slots each query head opens")
    chunk_size: int = setting(FOLD_CHUNK, "fold: chunk (tokens)")
    stream_chunk: int = setting(STREAM_CHUNK, "two-level: chunk (tokens)")
    max_new_tokens: int = setting(48, "answer tokens")
    dtype: str = setting("fp32", "weights and activations", choices=sorted(DTYPES))
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    name: str = setting("qa_bench", "stem of the result files")

    def __post_init__(self) -> None:
        require_at_least(1, self, "tokens", "budget", "kvm_open", "chunk_size", "stream_chunk",
                         "max_new_tokens")  # fmt: skip
        require_known(self, "methods", self.methods, METHODS)
        require_known(self, "prompts", self.prompts, PROMPTS)


def correct(answer: str, accepted: tuple[str, ...]) -> bool:
    """Whether the answer contains any of the accepted strings (case-insensitive)."""
    return any(a in answer.lower() for a in accepted)


def answer_all(
    model: nn.Module, tokenizer: Any, text: str, method: str, prompt: str, s: QABenchSettings
) -> list[dict[str, Any]]:
    """Every question's answer by one method and prompt, scored whole and cut at a repeat."""
    name, config = method, None
    if method == "two-level":
        name, config = "kvm-fold", KVMFoldConfig(budget=s.budget, open=s.kvm_open)
    settings = read_settings(name, config, chunk_size=s.chunk_size, stream_chunk=s.stream_chunk)
    kept = None
    out = []
    for question, accepted in QUESTIONS:
        start = time.perf_counter()
        if kept is None or prompt == "both":
            first = question if prompt == "both" else None
            ids = document_ids(tokenizer, text, question=first)
            kept = read_ids(model, tokenizer, ids, settings, progress=False)
        answer = kept.ask(question, s.max_new_tokens, stop_at_repeat=False)
        cut, used = AnswerWatch.of_prompt(tokenizer, chat=True).cut(answer.tokens)
        out.append({
            "question": question, "answer": answer.text, "correct": correct(answer.text, accepted),
            "answer_at_repeat": cut, "correct_at_repeat": correct(cut, accepted),
            "tokens": len(answer.tokens), "tokens_at_repeat": used,
            "seconds": time.perf_counter() - start,
        })  # fmt: skip
        print(f"{method} {prompt}: {question} -> {cut[:60]!r}", flush=True)
    return out


def run(
    model: nn.Module, tokenizer: Any, s: QABenchSettings, argv: list[str] | None = None
) -> dict[str, Any]:
    """Every method x prompt (`answer_all`), with the provenance."""
    text = document_text(tokenizer, TEXT, s.tokens)
    runs = [
        {"method": m, "prompt": p, "answers": answer_all(model, tokenizer, text, m, p, s)}
        for m in s.methods
        for p in s.prompts
    ]
    return {"provenance": provenance(argv), "settings": asdict(s), "runs": runs}


def write_page(report: dict[str, Any], s: QABenchSettings) -> list[Path]:
    """<out_dir>/<name>.json and .md: the scores per method and prompt, then every answer."""
    n = len(QUESTIONS)
    rows = []
    for r in report["runs"]:
        a = r["answers"]
        rows.append([
            r["method"], r["prompt"], f"{sum(x['correct'] for x in a)}/{n}",
            f"{sum(x['correct_at_repeat'] for x in a)}/{n}",
            f"{sum(x['tokens'] for x in a) / n:.0f}",
            f"{sum(x['tokens_at_repeat'] for x in a) / n:.0f}",
            f"{sum(x['seconds'] for x in a):.0f}",
        ])  # fmt: skip
    body = [
        "",
        f"- document: the first {s.tokens} tokens of {TEXT}; {n} questions, each answer "
        "correct when it contains an accepted string (case-insensitive); greedy, "
        f"{s.max_new_tokens} tokens",
        "- after: the question after the document (a kept read answers every question from one "
        "read); both: the question before the document too (a read per question)",
        "- correct: the whole answer; at repeat: the answer cut where it starts to repeat "
        "itself (`document.repeat`: 8 tokens or a line said again) "
        "(where `ask` stops by default); tokens: mean answer tokens decoded, whole and up to "
        "the stop",
        "",
        *markdown_table(
            [
                "method",
                "prompt",
                "correct",
                "correct at repeat",
                "tokens",
                "tokens at repeat",
                "seconds",
            ],
            rows,
            "<<>>>>>",
        ),
        "",
        "## Answers (cut where they repeat)",
        "",
    ]
    for r in report["runs"]:
        body += [f"### {r['method']}, question {r['prompt']}", ""]
        body += [
            f"- {'yes' if x['correct_at_repeat'] else 'no '} {x['question']} "
            f'"{" ".join(x["answer_at_repeat"].split())[:120]}"'
            for x in r["answers"]
        ]
        body.append("")
    out = Path(s.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_report(out / s.name, "Questions about a novel: methods and prompts", report, body)
