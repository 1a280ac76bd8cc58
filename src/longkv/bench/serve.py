"""`longkv bench serve`: `longkv serve` as its clients meet it, over HTTP.

A server process is started (`python -m longkv serve`, the method auto: the exact fold while a
request fits the model's trained positions) and asked about a document of `tokens` tokens of a
shipped novel, each question a chat request "{document}\n\n{question}" streamed: the first
question reads the document, the second is answered from the kept read; the seconds from
sending each to its first answer token are set against each other. Then `clients` at once (each
a thread asking `rounds` questions in turn, about the same document) give the requests answered
per minute at each load. The server answers one request at a time, so more clients queue. Time
it alone: nothing else running.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from longkv.checks import require, require_at_least, setting
from longkv.data.corpus import text_tokens
from longkv.models.pretrained import DEFAULT_MODEL, load_tokenizer, resolve_model
from longkv.results import (
    OUT_DIR,
    OUT_DIR_HELP,
    finish_figure,
    markdown_table,
    provenance,
    pyplot,
    write_report,
)

QUESTIONS = (
    "Who has taken Netherfield Park?", "How old is Charlotte Lucas?", "Who is Mr. Darcy?",
    "Where does the Bennet family live?", "How many daughters do the Bennets have?",
    "Who is Mr. Collins?", "What is Jane's opinion of Mr. Bingley?", "Who is Lady Lucas?",
)  # fmt: skip


@dataclass(frozen=True)
class ServeBenchSettings:
    """`longkv bench serve`: the server's model, the document, the questions and the loads."""

    model: str = setting(DEFAULT_MODEL, "the model the server loads (as `longkv serve --model`)")
    text: str = setting("austen/prideprejudice.txt.gz", "the shipped novel the document opens")
    tokens: int = setting(
        7900, "tokens of the novel the document holds (with the template, question and answer "
        "within SmolLM2's 8192 positions: the fold reads it)",
    )  # fmt: skip
    questions: tuple[str, ...] = setting(QUESTIONS, "the questions, asked in turn")
    clients: tuple[int, ...] = setting((1, 4, 8), "clients at once, one load after another")
    rounds: int = setting(2, "questions each client asks at each load")
    max_tokens: int = setting(24, "answer tokens at most")
    threads: int = setting(2, "the server's torch threads (OMP_NUM_THREADS)")
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    name: str = setting("serve_bench", "the page's file name")

    def __post_init__(self) -> None:
        for name in ("tokens", "rounds", "max_tokens", "threads"):
            require_at_least(1, self, name)
        require(len(self.questions) >= 2, self, "questions", "give at least two")
        require(all(c >= 1 for c in self.clients), self, "clients", "each must be >= 1")


def free_port() -> int:
    """A port of 127.0.0.1 that no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `longkv serve` process on a free port of 127.0.0.1, and streamed chat requests to it."""

    def __init__(self, s: ServeBenchSettings):
        self.port = free_port()
        argv = [sys.executable, "-m", "longkv", "serve", "--model", s.model, "--name", "bench",
                "--port", str(self.port), "--max-tokens", str(s.max_tokens)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(s.threads)}
        start = time.perf_counter()
        self.process = subprocess.Popen(argv, env=env)
        while not self.healthy():
            require(self.process.poll() is None, s, "model", "the server did not start (above)")
            time.sleep(0.2)
        self.start_seconds = time.perf_counter() - start

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                return True
        except OSError:
            return False

    def ask(self, document: str, question: str) -> dict[str, Any]:
        """A streamed chat request: seconds to the first answer token and in all, the answer,
        the prompt's tokens and those a kept read had read."""
        body = {"model": "bench", "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"{document}\n\n{question}"}]}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        start = time.perf_counter()
        first, text, usage = None, "", {}
        with urllib.request.urlopen(request, timeout=3600) as response:
            for line in response:
                data = line.decode().removeprefix("data: ").strip()
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if piece and first is None:
                    first = time.perf_counter() - start
                text += piece or ""
                usage = chunk.get("usage") or usage
        return {
            "question": question, "first_token_seconds": first,
            "seconds": time.perf_counter() - start, "answer": text,
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        }  # fmt: skip

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=600)


def run(s: ServeBenchSettings, argv: list[str]) -> dict[str, Any]:
    """The first and second questions' first tokens, then requests per minute per load."""
    tokenizer = load_tokenizer(resolve_model(s.model))
    document = tokenizer.decode(text_tokens(tokenizer, s.tokens, s.text))
    server = Served(s)
    try:
        first = server.ask(document, s.questions[0])
        second = server.ask(document, s.questions[1])
        loads = [load(server, document, s, clients) for clients in s.clients]
    finally:
        server.stop()
    ratio = (first["first_token_seconds"] or 0) / (second["first_token_seconds"] or 1)
    return {
        "provenance": provenance(argv), "settings": asdict(s),
        "start_seconds": server.start_seconds, "first": first,
        "second": second, "first_token_ratio": ratio, "loads": loads,
    }  # fmt: skip


def load(server: Served, document: str, s: ServeBenchSettings, clients: int) -> dict[str, Any]:
    """`clients` threads at once, each asking `rounds` questions in turn: requests per minute."""
    answers: list[dict[str, Any]] = []
    failed: list[str] = []

    def client(i: int) -> None:
        for r in range(s.rounds):
            try:
                answers.append(server.ask(document, s.questions[(i + r) % len(s.questions)]))
            except OSError as err:  # told on the page, not lost with the thread
                failed.append(str(err))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    print(f"{clients} clients: {len(answers)} answers in {wall:.1f} s", file=sys.stderr)
    return {
        "clients": clients, "requests": len(answers), "seconds": wall,
        "failed": failed, "per_minute": 60 * len(answers) / wall,
        "mean_seconds": sum(a["seconds"] for a in answers) / len(answers),
        "all_from_kept": all(a["cached_tokens"] > 0 for a in answers),
    }  # fmt: skip


def write_page(report: dict[str, Any], s: ServeBenchSettings) -> list[Path]:
    """<out_dir>/<name>.json, .md and .png (first tokens; requests per minute by clients)."""
    first, second = report["first"], report["second"]
    body = [
        "",
        f"- server: `longkv serve --model {s.model} --max-tokens {s.max_tokens}` (method auto), "
        f"OMP_NUM_THREADS={s.threads}, started in {report['start_seconds']:.1f} s; document: "
        f"the first {s.tokens} tokens of {s.text}, each question a streamed chat request "
        '"{document}\\n\\n{question}", greedy, at most '
        f"{s.max_tokens} answer tokens",
        "",
        *markdown_table(
            ["question", "prompt tokens", "from a kept read", "first token s", "all s", "answer"],
            [
                [
                    q["question"],
                    str(q["prompt_tokens"]),
                    str(q["cached_tokens"]),
                    f"{q['first_token_seconds']:.2f}",
                    f"{q['seconds']:.2f}",
                    " ".join(q["answer"].split()),
                ]
                for q in (first, second)
            ],
            "<>>>><",
        ),
        "",
        f"The second question's first token came {report['first_token_ratio']:.0f}x sooner "
        "than the first's, which read the document.",
        "",
        *markdown_table(
            [
                "clients",
                "requests",
                "seconds",
                "requests per minute",
                "mean s per request",
                "all from the kept read",
                "failed",
            ],
            [
                [
                    str(r["clients"]),
                    str(r["requests"]),
                    f"{r['seconds']:.1f}",
                    f"{r['per_minute']:.1f}",
                    f"{r['mean_seconds']:.1f}",
                    "yes" if r["all_from_kept"] else "no",
                    str(len(r["failed"])),
                ]
                for r in report["loads"]
            ],
            ">>>>>>>",
        ),
        "",
        "One request runs at a time (2 cores): more clients wait in the queue, so requests per "
        "minute stay about the same and each request's seconds grow with the clients.",
    ]
    out = Path(s.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_report(
        out / s.name, "longkv serve over HTTP", report, body, lambda png: plot(report, png, s)
    )


def plot(report: dict[str, Any], png: Path, s: ServeBenchSettings) -> None:
    """First-token seconds of the two questions, and requests per minute by clients."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    seconds = [report[k]["first_token_seconds"] for k in ("first", "second")]
    left.bar(["first question\n(reads the document)", "second question\n(kept read)"], seconds)
    left.set_yscale("log")
    left.set_ylabel("seconds to the first answer token")
    loads = report["loads"]
    right.bar([str(r["clients"]) for r in loads], [r["per_minute"] for r in loads])
    right.set_xlabel("clients at once")
    right.set_ylabel("requests per minute")
    finish_figure(fig, png, f"longkv serve, {s.model}: {s.tokens}-token document")
