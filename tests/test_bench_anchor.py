"""`longkv bench anchor`: its longkv worker against the library's own read, continuation and
NLL on a tiny random Llama; its llama.cpp worker's scoring against a fake llama.cpp; the page
from fake results; the run without llama-cpp-python; resuming; refusals."""

from __future__ import annotations

import ctypes
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import over_tokenizer, saved_model, tiny_hf_config
from longkv.bench import anchor, anchor_llamacpp, anchor_longkv, anchor_page
from longkv.caches.methods import read_and_answer
from longkv.checks import SettingError
from longkv.cli.main import main
from longkv.data.corpus import text_tokens
from longkv.document.read import read
from longkv.fold.fold import kv_fold
from longkv.models.int8 import quantize_model
from longkv.models.pretrained import load_pretrained
from longkv.train.tokenizer import gpt2_tokenizer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with a 1-layer random Llama (512 positions) and the GPT-2 tokenizer."""
    config = tiny_hf_config(**over_tokenizer(gpt2_tokenizer()), max_position_embeddings=512)
    return saved_model(tmp_path_factory, "tiny", config, LlamaForCausalLM)


def spec(model: str, method: str, ids: list[int], **changes: Any) -> dict[str, Any]:
    s = anchor.AnchorSettings(
        model=model, tokens=(len(ids),), nll_tokens=40, continue_tokens=6,
        threads=torch.get_num_threads(), budget=128, methods=(method,),
    )  # fmt: skip
    return {**anchor.worker_spec(s, method, ids, True), **changes}


# rows the read's cache holds: those read, and a packed cache's room for questions (LEAF_ROOM)
@pytest.mark.parametrize(("method", "rows"), [("fold", 199), ("full", 199), ("fold/fp32", 1223)])
def test_the_longkv_worker_reads_continues_and_scores_as_the_library_does(
    tiny_model: str, method: str, rows: int
) -> None:
    model, tokenizer = load_pretrained(tiny_model)
    ids = text_tokens(tokenizer, 200, "mobydick.txt.gz")
    got = anchor_longkv.run(spec(tiny_model, method, ids))
    tensor = torch.tensor([ids])
    with torch.inference_mode():
        want = read_and_answer(model, tensor, "full", 6, eos_token_id=tokenizer.eos_token_id)
        nll = kv_fold(model, tensor, len(ids)).nll[0, -40:].double().mean()
    assert got["continuation"] == [t for t in want[0].tolist() if t != tokenizer.eos_token_id]
    assert got["nll"] == pytest.approx(float(nll), abs=1e-5)
    # keys and values of every id but the last (and room): 1 layer, 1 KV head, head 8
    assert got["cache_bytes"] == 2 * rows * 8 * 4
    held = [*model.parameters(), *model.buffers()]  # buffers: RoPE's inverse frequencies
    assert got["weight_bytes"] == sum(t.numel() * t.element_size() for t in held)
    stages = got["stages"]
    assert list(stages) == ["start", "imports", "loaded", "read", "decoded"]
    assert got["peak_bytes"] == stages["decoded"]["peak"] >= stages["read"]["rss"]


def test_a_worker_runs_in_a_process_of_its_own_and_gives_what_it_gives_in_this_one(
    tiny_model: str,
) -> None:
    ids = text_tokens(load_pretrained(tiny_model)[1], 120, "mobydick.txt.gz")
    there = anchor.run_worker(spec(tiny_model, "fold", ids), torch.get_num_threads())
    here = anchor_longkv.run(spec(tiny_model, "fold", ids))
    assert there["continuation"] == here["continuation"] and there["nll"] == here["nll"]
    assert there["stages"]["start"]["rss"] < there["stages"]["imports"]["rss"]  # a fresh one


def test_the_longkv_worker_packs_the_folds_cache_in_16_bits(tiny_model: str) -> None:
    model, tokenizer = load_pretrained(tiny_model)
    ids = text_tokens(tokenizer, 200, "mobydick.txt.gz")
    got = anchor_longkv.run(spec(tiny_model, "fold/fp16", ids))
    # storage for the ids read and 1024 more for questions, and the float32 rows a forward
    # widens them into (the 199 rows of the one chunk and 256 to grow into)
    assert got["cache_bytes"] == 2 * (199 + 1024) * 8 * 2 + 2 * (199 + 256) * 8 * 4
    with torch.inference_mode():
        nll = kv_fold(model, torch.tensor([ids]), 1024, cache_dtype=torch.float16).nll
    assert got["nll"] == pytest.approx(float(nll[0, -40:].double().mean()), abs=1e-6)
    assert "fold/fp16" in got["engine"]


def test_the_longkv_worker_reads_with_int8_weights(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LONGKV_CACHE", str(tmp_path))
    model, tokenizer = load_pretrained(tiny_model)
    quantize_model(model)
    ids = text_tokens(tokenizer, 200, "mobydick.txt.gz")
    got = anchor_longkv.run(spec(tiny_model, "fold/fp16+int8", ids))
    with torch.inference_mode():
        doc = read(model, tokenizer, ids[:-1], "fold", chat=False, cache_dtype="fp16")
        want = doc.answer(ids[-1:], 6, stop_at_repeat=False).tokens
    assert got["continuation"] == want
    held = [*model.parameters(), *model.buffers()]
    assert got["weight_bytes"] == sum(t.numel() * t.element_size() for t in held)
    assert "int8 weights" in got["engine"] and "fold/fp16" in got["engine"]


def test_the_longkv_worker_reads_streaming_at_its_budget(tiny_model: str) -> None:
    ids = text_tokens(load_pretrained(tiny_model)[1], 300, "mobydick.txt.gz")
    got = anchor_longkv.run(spec(tiny_model, "streaming", ids, nll_tokens=0))
    assert got["nll"] is None
    # 128 entries of 1 KV head of 8 dims, keys and values, float32, held twice (the runner's
    # sinks and window, and the cache its last forward filled), and 4 float64 of its own
    assert got["cache_bytes"] == 2 * 2 * 128 * 8 * 4 + 4 * 8
    assert "streaming@128" in got["engine"]


class FakeLlama:
    """What the llama.cpp worker uses of llama-cpp-python's Llama: logits after each token that
    depend on every token evaluated (their sum), so a scoring that reads the wrong row fails."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ctx = self
        self.rows: list[Any] = []

    def n_vocab(self) -> int:
        return 11

    def reset(self) -> None:
        self.tokens = []

    def eval(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def logits(self) -> np.ndarray:
        return -((np.arange(11) - sum(self.tokens) % 11) ** 2) / 7.0


def fake_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    def logits_ith(llm: FakeLlama, i: int) -> Any:
        assert i == -1
        row = (ctypes.c_float * 11)(*llm.logits())
        llm.rows.append(row)  # kept alive while read
        return ctypes.cast(row, ctypes.POINTER(ctypes.c_float))

    module = types.SimpleNamespace(llama_get_logits_ith=logits_ith)
    monkeypatch.setitem(sys.modules, "llama_cpp", module)


def test_the_llamacpp_workers_nll_scores_each_token_by_the_logits_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_llama_cpp(monkeypatch)
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    want = []
    for j in range(6, 10):
        logits = (-((np.arange(11) - sum(ids[:j]) % 11) ** 2) / 7.0).astype(np.float32)
        logits = logits.astype(np.float64)
        want.append(np.log(np.exp(logits).sum()) - logits[ids[j]])
    llm = FakeLlama()
    llm.eval([7, 7])  # a read before: the scoring starts from a reset context
    assert anchor_llamacpp.tail_nll(llm, ids, 4) == pytest.approx(np.mean(want), abs=1e-12)


def fake_run(tokens: int, seconds: float, peak: int, nll: float, continuation: list[int],
             **extra: Any) -> dict[str, Any]:  # fmt: skip
    mib = 2**20
    stages = {
        "start": {"rss": 10 * mib, "peak": 10 * mib},
        "imports": {"rss": 100 * mib, "peak": 100 * mib},
        "loaded": {"rss": 300 * mib, "peak": 300 * mib},
        "read": {"rss": 400 * mib, "peak": peak * mib},
        "decoded": {"rss": 410 * mib, "peak": peak * mib},
    }
    return {
        "seconds": seconds, "decode_seconds": 0.8, "continuation": continuation,
        "continuation_text": "x", "peak_bytes": peak * mib, "stages": stages, "nll": nll,
        "engine": "fake", **extra,
    }  # fmt: skip


def test_the_page_sets_each_reader_against_llamacpp_and_the_target(tmp_path: Path) -> None:
    s = anchor.AnchorSettings(
        tokens=(100,), nll_tokens=50, out_dir=str(tmp_path), name="a",
        methods=("llama.cpp", "fold", "full", "fold/fp16+int8"),
    )  # fmt: skip
    parts = {
        "100/llama.cpp/0": fake_run(100, 80.0, 400, 3.70, [1, 2, 3, 4]),
        "100/llama.cpp/1": fake_run(100, 90.0, 420, 3.70, [1, 2, 3, 4]),
        "100/fold/0": fake_run(
            100, 40.0, 1000, 3.75, [1, 2, 9, 4], cache_bytes=2**20 * 50, weight_bytes=2**20 * 200
        ),
        "100/fold/1": fake_run(100, 44.0, 1000, 3.75, [1, 2, 9, 4]),
        "100/full/0": fake_run(100, 60.0, 700, 3.76, [1, 2, 3, 4]),
        "100/full/1": fake_run(100, 62.0, 700, 3.76, [1, 2, 3, 4]),
        "100/fold/fp16+int8/0": fake_run(100, 66.0, 800, 3.7601, [1, 2, 3, 4]),
    }
    report = {"parts": parts, "skipped": {}}
    payload = {"provenance": {"command": "c", "commit": "x", "date": "d", "machine": {
        "platform": "p", "processor": "q", "cpu_count": 2, "torch_threads": 2, "torch": "t",
        "python": "3", "cuda_device": None}}, **report}  # fmt: skip
    paths = anchor_page.write_page(report, s, payload)
    page = paths[1].read_text()
    assert paths[2].is_file()
    # medians: llama.cpp 85 s and 410 MiB; the fold 42 s and 1000 MiB
    assert "| fold | 40.0 / 44.0 | 42.0 | 0.49 | 1000 | 2.44 | 0.200 |" in page
    assert (
        "- fold: peak 2.44x llama.cpp's (target <= 2.0x): missed; "
        "read time 0.49x llama.cpp's (target <= 0.8x): met\n"
    ) in page  # the float32 fold: no NLL against itself
    assert (
        "- fold/fp16+int8: peak 1.95x llama.cpp's (target <= 2.0x): met; "
        "read time 0.78x llama.cpp's (target <= 0.8x): met; "
        "NLL +0.0101 from the fold's (target within 0.01): missed"
    ) in page
    assert "- full:" not in page  # the targets are the fold's
    assert "| fold | 3.7500 | +0.0500 | +0.0000 | 2 of 4 | x |" in page
    assert "| full | 3.7600 | +0.0600 | +0.0100 | 4 of 4 | x |" in page
    # runtime 100, weights 200, kept by the read 100, the peak 600 above the read's end
    assert "| fold | 100 | 200 | 100 | 600 | 1000 | 200 | 50 |" in page
    assert "| llama.cpp | 100 | 200 | 100 | 0 | 400 | - | - |" in page


def test_without_llamacpp_the_bench_says_so_runs_the_rest_and_resumes(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setattr(anchor, "llama_cpp_missing", lambda: "llama-cpp-python is not installed")
    calls: list[str] = []

    def worker(spec: dict[str, Any], threads: int) -> dict[str, Any]:
        calls.append(spec["method"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fake_run(len(spec["ids"]), 1.0, 500, 3.0, [5], cache_bytes=0, weight_bytes=0)

    monkeypatch.setattr(anchor, "run_worker", worker)
    argv = ["bench", "anchor", "--model", tiny_model, "--tokens", "50", "--repeats", "1",
            "--nll-tokens", "10", "--out-dir", str(tmp_path), "--name", "a"]  # fmt: skip
    assert main(argv) == 130  # Ctrl-C in the second run
    assert "the finished measurements are beside the page" in capsys.readouterr().err
    calls.clear()
    assert main(argv) == 0
    assert calls == ["full"]  # the fold's run was kept; llama.cpp never ran
    out = capsys.readouterr()
    assert "llama.cpp: skipped, llama-cpp-python is not installed" in out.err
    assert "- llama.cpp: skipped, llama-cpp-python is not installed" in out.out
    data = json.loads((tmp_path / "a.json").read_text())
    assert sorted(data["parts"]) == ["50/fold/0", "50/full/0"]
    assert not (tmp_path / "a.partial.json").exists()


def test_settings_that_cannot_run_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingError, match="nll_tokens: must be >= 0 and fewer than the"):
        anchor.AnchorSettings(tokens=(512, 100), nll_tokens=100)
    s = anchor.AnchorSettings(model=str(tmp_path))
    with pytest.raises(SettingError, match=r"llama\.cpp reads a GGUF file and --model"):
        anchor.gguf_of(s)
    room = types.SimpleNamespace(max_position_embeddings=8192)
    anchor.check_room(anchor.AnchorSettings(tokens=(8177,)), room)  # 8192 positions: fits
    with pytest.raises(SettingError, match="take 8193 positions and the model has 8192: pass "
                       "--tokens 8177 or fewer"):  # fmt: skip
        anchor.check_room(anchor.AnchorSettings(tokens=(8178,)), room)
