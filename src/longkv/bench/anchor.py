"""`longkv bench anchor`: longkv's reads against llama.cpp's on the same token ids.

The ids are the first `tokens` tokens of a shipped novel (the model's tokenizer; llama.cpp
reads the same GGUF longkv converted the model from). Each read runs in a process of its own
(`anchor_llamacpp`, which imports no torch, and `anchor_longkv`, a user's script through
`longkv.read`), on `threads` threads, the methods interleaved in rounds and each round
repeated `repeats` times; a run records its read's seconds, its decoding's, its greedy
continuation, its resident memory at each stage and its peak, and in the first round the NLL
of the last `nll_tokens` tokens. The finished runs are kept beside the page (.partial.json) and
an interrupted benchmark resumes. Time it alone: nothing else running.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from longkv.checks import require, require_at_least, require_known, setting
from longkv.data.corpus import text_tokens
from longkv.document.read import PACKED_METHODS
from longkv.models.pretrained import (
    PACKAGED,
    causal_lm_config,
    load_tokenizer,
    quantized,
    resolve_model,
)
from longkv.results import OUT_DIR, OUT_DIR_HELP, load_partial, save_partial

LLAMA_CPP = "llama.cpp"
# longkv's full and fold reads may keep their cache packed in a dtype (`ReadSettings.cache_dtype`)
PACKED = tuple(f"{m}/{d}" for m in PACKED_METHODS for d in ("fp32", "fp16", "bf16"))
READERS = ("full", "fold", "streaming", "two-level", *PACKED)
INT8 = "+int8"  # a longkv reader's weights in int8 (`load_model`'s weights)
METHODS = (LLAMA_CPP, *READERS, *(r + INT8 for r in READERS))


def reader_parts(name: str) -> tuple[str, str, bool]:
    """A longkv reader's (method, cache dtype or "", int8 weights): fold/fp16+int8 ->
    ("fold", "fp16", True)."""
    reader, plus, _ = name.partition("+")
    method, _, dtype = reader.partition("/")
    return method, dtype, bool(plus)


WORKERS = {LLAMA_CPP: "longkv.bench.anchor_llamacpp"}  # the rest: anchor_longkv
LONGKV_WORKER = "longkv.bench.anchor_longkv"
INSTALL = "pip install 'longkv[anchor]'"


@dataclass(frozen=True)
class AnchorSettings:
    """`longkv bench anchor`: the model, the ids, the methods and the rounds."""

    model: str = setting(
        "smollm2",
        "the model longkv loads (as --model: smollm2, gemma3, a GGUF file or a folder)",
    )
    gguf: str | None = setting(
        None,
        "the GGUF llama.cpp reads (default: the packaged model's for smollm2 and gemma3, or "
        "--model where it is a .gguf file)",
    )
    text: str = setting("mobydick.txt.gz", "the shipped text the ids open")
    tokens: tuple[int, ...] = setting(
        (8176,),
        "ids per read, one length after another (with the continuation within the model's "
        "positions: SmolLM2's 8192)",
    )
    methods: tuple[str, ...] = setting(
        (LLAMA_CPP, "fold", "full"),
        "readers: llama.cpp (llama-cpp-python, flash attention, its f16 cache) or one of "
        "longkv.read's methods at its own settings; full/DTYPE and fold/DTYPE keep the cache "
        "packed in DTYPE (longkv.fold.packed), and +int8 holds the weights in int8 "
        "(longkv.models.int8)",
        choices=METHODS,
    )
    budget: int = setting(
        2048, "streaming: its entries (4 sinks and the recent rest; as many as two-level reads)"
    )
    repeats: int = setting(2, "rounds: every method once per round, interleaved")
    continue_tokens: int = setting(16, "greedy tokens each reader decodes after the ids")
    nll_tokens: int = setting(
        1024, "the last ids whose mean NLL each reader gives, in the first round (0: none)"
    )
    threads: int = setting(2, "threads of each reader (torch's, llama.cpp's)")
    llama_batch: int = setting(512, "llama.cpp: tokens per batch (n_batch = n_ubatch)")
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    name: str = setting("vs_llamacpp", "the page's file name")

    def __post_init__(self) -> None:
        for name in ("budget", "repeats", "continue_tokens", "threads", "llama_batch"):
            require_at_least(1, self, name)
        require_known(self, "methods", self.methods, METHODS)
        require(bool(self.methods), self, "methods", "give at least one")
        require(all(n >= 2 for n in self.tokens), self, "tokens", "each read needs >= 2 ids")
        require(
            0 <= self.nll_tokens < min(self.tokens), self, "nll_tokens",
            f"must be >= 0 and fewer than the shortest read's {min(self.tokens)} ids",
        )  # fmt: skip


def gguf_of(s: AnchorSettings) -> str:
    """The GGUF file llama.cpp reads (`AnchorSettings.gguf`)."""
    if s.gguf is not None:
        path = Path(s.gguf)
    elif s.model in PACKAGED:
        path = PACKAGED[s.model].gguf()
    else:
        require(
            s.model.endswith(".gguf"), s, "gguf",
            f"llama.cpp reads a GGUF file and --model {s.model} is not one; pass the GGUF "
            "of the same weights",
        )  # fmt: skip
        path = Path(s.model)
    require(path.is_file(), s, "gguf", f"{path} is not a file")
    return str(path)


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot run here (llama-cpp-python is not installed), None when it can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed ({INSTALL})"
    return None


def worker_spec(s: AnchorSettings, method: str, ids: list[int], first: bool) -> dict[str, Any]:
    """What one worker reads (`anchor_llamacpp.run`, `anchor_longkv.run`)."""
    spec = {
        "method": method, "ids": ids, "threads": s.threads, "model": s.model,
        "continue_tokens": s.continue_tokens, "nll_tokens": s.nll_tokens if first else 0,
        "budget": s.budget, "llama_batch": s.llama_batch,
    }  # fmt: skip
    if method == LLAMA_CPP:
        spec["gguf"] = gguf_of(s)
    return spec


def run_worker(spec: dict[str, Any], threads: int) -> dict[str, Any]:
    """Run one read in a fresh process (its worker module) and return its result."""
    module = WORKERS.get(spec["method"], LONGKV_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_file.write_text(json.dumps(spec))
        subprocess.run([sys.executable, "-m", module, str(spec_file), str(out)], env=env,
                       check=True)  # fmt: skip
        return json.loads(out.read_text())


def check_room(s: AnchorSettings, config: Any) -> None:
    """Refuse ids that, with the continuation, take more positions than the model of `config`
    (its `PretrainedConfig`) was trained on."""
    limit = getattr(config, "max_position_embeddings", None)
    longest = max(s.tokens) + s.continue_tokens - 1  # the last continuation token is not read
    require(
        limit is None or longest <= limit, s, "tokens",
        f"{max(s.tokens)} ids and {s.continue_tokens} continuation tokens take {longest} "
        f"positions and the model has {limit}: pass --tokens {limit - s.continue_tokens + 1} "
        "or fewer (or fewer --continue-tokens)",
    )  # fmt: skip


def run_key(tokens: int, method: str, repeat: int) -> str:
    """A run's key in the parts: ids, method, round."""
    return f"{tokens}/{method}/{repeat}"


def run(s: AnchorSettings, settings: dict[str, Any]) -> dict[str, Any]:
    """Every run of every round (resuming from the partial file of `settings`): the parts
    (`run_key` -> a worker's result, with its continuation's text) and what was skipped."""
    missing = llama_cpp_missing() if LLAMA_CPP in s.methods else None
    if missing:
        print(f"{LLAMA_CPP}: skipped, {missing}", file=sys.stderr)
    methods = [m for m in s.methods if not (m == LLAMA_CPP and missing)]
    path = resolve_model(s.model)
    check_room(s, causal_lm_config(path))
    if any(m.endswith(INT8) for m in s.methods):
        quantized(path)  # here, once: no reader's process holds the float32 weights
    partial = Path(s.out_dir) / f"{s.name}.partial.json"
    parts = load_partial(partial, settings)
    tokenizer = load_tokenizer(path)
    for n in s.tokens:
        ids = text_tokens(tokenizer, n, s.text)
        for repeat in range(s.repeats):
            for method in methods:
                key = run_key(n, method, repeat)
                if key in parts:
                    continue
                print(f"{key}: reading", file=sys.stderr, flush=True)
                r = parts[key] = run_worker(worker_spec(s, method, ids, repeat == 0), s.threads)
                r["continuation_text"] = tokenizer.decode(r["continuation"])
                print(f"{key}: {r['seconds']:.1f} s, peak {r['peak_bytes'] / 2**20:.0f} MiB",
                      file=sys.stderr, flush=True)  # fmt: skip
                save_partial(partial, settings, parts)
    return {"parts": parts, "skipped": {LLAMA_CPP: missing} if missing else {}}


def page_settings(s: AnchorSettings) -> dict[str, Any]:
    """What the runs depend on (not the folder, so runs may move with the page)."""
    return {k: v for k, v in asdict(s).items() if k != "out_dir"}
