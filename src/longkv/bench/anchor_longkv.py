"""`longkv bench anchor`'s longkv worker: one read of token ids by one of `longkv.read`'s
methods, in a process of its own, as a user's script would make it.

`python -m longkv.bench.anchor_longkv SPEC OUT`: SPEC a JSON file (`anchor.worker_spec`), OUT
where the result JSON goes. The read takes every token but the last (`longkv.read`, timed);
then `Document.answer` reads the last and decodes `continue_tokens` greedy tokens (timed
apart). The resident memory is read at each stage (`stages`: before torch is imported, after
the imports, with the weights loaded and read once, after the read, after decoding); its
high-water mark after decoding is the run's peak. The read's keys and values (`cache_bytes`,
leaves included) and the weights' bytes are counted from their tensors. Then, where
`nll_tokens` > 0 and after the peak is taken, the NLL of the last nll_tokens tokens from a
scoring run of the same method over all the ids.
"""

from __future__ import annotations

import sys
from typing import Any

from longkv.bench.process import resident, worker_main


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """The read SPEC describes (`anchor.worker_spec`): seconds, tokens and memory by stage."""
    stages = {"start": resident()}
    import torch

    from longkv.bench.anchor import reader_parts
    from longkv.bench.memory import load_weights
    from longkv.caches.methods import BoundedOptions
    from longkv.document.read import read
    from longkv.document.save import held_bytes
    from longkv.models.pretrained import load_pretrained

    torch.set_num_threads(spec["threads"])
    stages["imports"] = resident()
    method, dtype, int8 = reader_parts(spec["method"])  # fold/fp16+int8: packed, int8 weights
    weights = "int8" if int8 else "fp32"
    model, tokenizer = load_pretrained(spec["model"], torch.float32, "cpu", None, weights)
    load_weights(model)
    stages["loaded"] = resident()
    ids: list[int] = spec["ids"]
    config = None  # two-level reads with its default (TWO_LEVEL), 2048 entries
    if method == "streaming":
        options = BoundedOptions(budgets=(spec["budget"],))
        ((_, config),) = options.bounded_configs(("streaming",)).items()
    with torch.inference_mode():
        doc = read(
            model, tokenizer, ids[:-1], method, config=config, progress=False, chat=False,
            cache_dtype=dtype or None,
        )  # fmt: skip
        stages["read"] = resident()
        answer = doc.answer(ids[-1:], spec["continue_tokens"], stop_at_repeat=False)
        stages["decoded"] = resident()
        n = spec["nll_tokens"]
        nll = tail_nll(doc, ids, n) if n else None
    held = [*model.parameters(), *model.buffers()]
    return {
        "seconds": doc.read_seconds, "decode_seconds": answer.seconds,
        "continuation": answer.tokens, "peak_bytes": stages["decoded"]["peak"],
        "stages": stages, "nll": nll, "cache_bytes": held_bytes(doc.runner),
        "weight_bytes": sum(t.numel() * t.element_size() for t in held),
        "engine": f"longkv {doc.settings.label}{dtype and '/' + dtype}, {weights} weights "
        f"(torch {torch.__version__})",
    }  # fmt: skip


def tail_nll(doc: Any, ids: list[int], n: int) -> float:
    """Mean NLL of the last n of ids, from a scoring run over all of them by the method and
    settings of `doc`'s read."""
    import torch

    from longkv.caches.methods import run_bounded
    from longkv.fold.compat import input_device
    from longkv.fold.fold import kv_fold

    s = doc.settings
    tensor = torch.tensor([ids], device=input_device(doc.model))
    if s.config is None:
        chunk = len(ids) if s.method == "full" else s.chunk_size
        result = kv_fold(doc.model, tensor, chunk, cache_dtype=s.packed)
    else:
        result = run_bounded(doc.model, tensor, s.config, s.stream_chunk)
    return float(result.nll[0, -n:].double().mean())


if __name__ == "__main__":
    sys.exit(worker_main(run, sys.argv[1:]))
