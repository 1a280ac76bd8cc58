"""`longkv bench anchor`'s llama.cpp worker: one read of token ids by llama.cpp (through
llama-cpp-python) in a process of its own, which imports no torch.

`python -m longkv.bench.anchor_llamacpp SPEC OUT`: SPEC a JSON file (`anchor.worker_spec`),
OUT where the result JSON goes. The read evaluates every token but the last (timed), then the
last and `continue_tokens` greedy tokens (decoding, timed apart); the resident memory is read
at each stage (`stages`) and its high-water mark after decoding is the run's peak. Then, where
`nll_tokens` > 0 and after the peak is taken, the NLL of the last nll_tokens tokens: the tokens
before them in one evaluation, then one token at a time, each scored by the logits before it
(llama-cpp-python keeps every position's logits only with logits_all, (n_ctx, n_vocab) floats).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from longkv.bench.process import resident, worker_main


def last_logits(llm: Any) -> Any:
    """(V,) float64 logits of the last token evaluated."""
    import llama_cpp
    import numpy as np

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float64)


def tail_nll(llm: Any, ids: list[int], n: int) -> float:
    """Mean NLL of the last n of ids (n < len(ids)), read from a reset context."""
    import numpy as np

    llm.reset()
    llm.eval(ids[:-n])
    total = 0.0
    for j in range(len(ids) - n, len(ids)):
        logits = last_logits(llm)
        top = logits.max()
        total += float(top + np.log(np.exp(logits - top).sum()) - logits[ids[j]])
        if j < len(ids) - 1:
            llm.eval([ids[j]])
    return total / n


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """The read SPEC describes (`anchor.worker_spec`): seconds, tokens and memory by stage."""
    stages = {"start": resident()}
    import llama_cpp
    import numpy as np

    stages["imports"] = resident()
    ids: list[int] = spec["ids"]
    threads, batch = spec["threads"], spec["llama_batch"]
    llm = llama_cpp.Llama(
        model_path=spec["gguf"], n_ctx=len(ids) + spec["continue_tokens"], n_threads=threads,
        n_threads_batch=threads, n_batch=batch, n_ubatch=batch, flash_attn=True, verbose=False,
    )  # fmt: skip
    stages["loaded"] = resident()
    start = time.perf_counter()
    llm.eval(ids[:-1])
    seconds = time.perf_counter() - start
    stages["read"] = resident()
    start = time.perf_counter()
    llm.eval(ids[-1:])
    tokens: list[int] = []
    while (token := int(np.argmax(last_logits(llm)))) != llm.token_eos():
        tokens.append(token)
        if len(tokens) == spec["continue_tokens"]:
            break
        llm.eval([token])
    decode_seconds = time.perf_counter() - start
    stages["decoded"] = resident()
    n = spec["nll_tokens"]
    return {
        "seconds": seconds, "decode_seconds": decode_seconds, "continuation": tokens,
        "peak_bytes": stages["decoded"]["peak"], "stages": stages,
        "nll": tail_nll(llm, ids, n) if n else None,
        "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(worker_main(run, sys.argv[1:]))
