"""KV-Fold on tiny random Hugging Face models: the fold equals one full forward."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)

from conftest import HF_ARCHS, TINY_HF, tiny_hf
from longkv.fold import compat, fold_generate, kv_fold
from longkv.fold import fold as fold_module

V, T = TINY_HF["vocab_size"], 100


def tiny(arch: str) -> PreTrainedModel:
    """A randomly initialised float32 model of the given family (no download)."""
    if arch in HF_ARCHS:
        return tiny_hf(arch)
    torch.manual_seed(0)
    if arch == "mistral":  # a sliding window shorter than the input
        model = MistralForCausalLM(MistralConfig(**TINY_HF, sliding_window=24))
    elif arch == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=256)
        )
    else:
        raise KeyError(arch)
    return model.eval()


ARCHS = ["llama", "qwen2", "mistral", "gemma3", "gpt2"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [1, 7, 64, 30])
def test_fold_equals_full_forward(arch: str, chunk: int) -> None:
    model = tiny(arch)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
    fold = kv_fold(model, ids, chunk, return_logits=True)
    assert fold.logits is not None
    assert (fold.logits - full).abs().max().item() <= 1e-5
    nll = F.cross_entropy(full[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    assert (fold.nll - nll).abs().max().item() <= 1e-5
    assert (fold.last_logits - full[:, -1]).abs().max().item() <= 1e-5
    assert len(fold.chunk_seconds) == -(-T // chunk)
    assert fold.cache.get_seq_length() == T


def test_a_fold_continues_from_its_cache() -> None:
    model = tiny("llama")
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
    first = kv_fold(model, ids[:, :37], 10, return_logits=True)
    rest = kv_fold(model, ids[:, 37:], 16, cache=first.cache, return_logits=True)
    assert first.logits is not None and rest.logits is not None
    assert (torch.cat([first.logits, rest.logits], 1) - full).abs().max().item() <= 1e-5
    assert rest.next_position == T


def test_prefix_is_inserted_before_every_chunk() -> None:
    """With a per-chunk prefix the fold is the full forward over [p, c0, p, c1, ...]."""
    model = tiny("qwen2")
    ids = torch.randint(2, V, (2, 45), generator=torch.Generator().manual_seed(3))
    bos = torch.tensor([1])
    stream = torch.cat([torch.cat([bos.expand(2, 1), c], 1) for c in ids.split(20, 1)], 1)
    with torch.no_grad():
        full = model(stream).logits
    nll = F.cross_entropy(full[:, :-1].transpose(1, 2), stream[:, 1:], reduction="none")
    real = torch.ones(stream.shape[1], dtype=torch.bool)
    real[[0, 21, 42]] = False  # where the prefix sits in the stream
    scored = real[1:].clone()
    scored[0] = False  # input token 0 is never scored
    fold = kv_fold(model, ids, 20, prefix_ids=bos, return_logits=True)
    assert (fold.nll - nll[:, scored]).abs().max().item() <= 1e-5
    assert fold.logits is not None and (fold.logits - full[:, real]).abs().max().item() <= 1e-5
    assert fold.next_position == stream.shape[1]


def recording(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The `output` of every model forward the fold makes, in order."""
    outputs: list[str] = []
    plain = compat.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        outputs.append(args[4] if len(args) > 4 else kwargs.get("output", "logits"))
        return plain(*args, **kwargs)

    monkeypatch.setattr(compat, "forward", forward)
    return outputs


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize(("chunk", "variant"), [(T, "exact"), (30, "exact"), (30, "bos")])
def test_long_forwards_score_from_logits_made_a_block_at_a_time(
    monkeypatch: pytest.MonkeyPatch, arch: str, chunk: int, variant: str
) -> None:
    """A forward longer than LOGIT_ROWS never holds all its logits: its NLL, logits and last
    logits, made from its hidden states 7 rows at a time, are those of its whole logits."""
    model = tiny(arch)
    model.config.bos_token_id = 1  # GPT-2's own is past the tiny vocabulary
    ids = torch.randint(2, V, (2, T), generator=torch.Generator().manual_seed(9))
    whole = kv_fold(model, ids, chunk, return_logits=True, variant=variant)
    monkeypatch.setattr(fold_module, "LOGIT_ROWS", 7)
    outputs = recording(monkeypatch)
    blocks = kv_fold(model, ids, chunk, return_logits=True, variant=variant)
    assert outputs == ["hidden"] * -(-T // chunk)
    assert whole.logits is not None and blocks.logits is not None
    assert blocks.nll.shape == whole.nll.shape == (2, T - 1)
    assert (blocks.nll - whole.nll).abs().max().item() <= 1e-5
    assert (blocks.logits - whole.logits).abs().max().item() <= 1e-5
    assert (blocks.last_logits - whole.last_logits).abs().max().item() <= 1e-5


def test_a_read_to_decode_from_makes_its_last_chunks_last_logits_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny("gemma3")
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, V, (1, 40), generator=torch.Generator().manual_seed(10))
    ref = fold_generate(model, ids, 16, max_new_tokens=5)
    scored = kv_fold(model, ids, 16)
    outputs = recording(monkeypatch)
    assert torch.equal(fold_generate(model, ids, 16, max_new_tokens=5), ref)
    # 3 chunks read (the first two without the output layer), 4 tokens fed back
    assert outputs == ["hidden", "hidden", "last"] + ["logits"] * 4
    read = kv_fold(model, ids, 16, score=False)
    assert read.nll.shape == (1, 0)
    torch.testing.assert_close(read.last_logits, scored.last_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_generation_from_a_folded_cache_equals_generate(arch: str) -> None:
    model = tiny(arch)
    model.generation_config.eos_token_id = None  # compare 12 free greedy tokens
    ids = torch.randint(0, V, (2, 60), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    out = fold_generate(model, ids, 7, max_new_tokens=12)
    assert torch.equal(out, ref[:, 60:])


def test_generation_stops_rows_at_eos() -> None:
    model = tiny("llama")
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(5))
    free = fold_generate(model, ids, 8, max_new_tokens=6)
    eos = int(free[0, 2])
    out = fold_generate(model, ids, 8, max_new_tokens=6, eos_token_id=eos)
    assert torch.all(out[0, 2:] == eos)


def test_chunk_times_and_chunk_nll_are_reported() -> None:
    model = tiny("llama")
    ids = torch.randint(0, V, (1, T))
    fold = kv_fold(model, ids, 25)
    assert len(fold.chunk_seconds) == 4 and fold.seconds == sum(fold.chunk_seconds) > 0
    # chunk c holds input tokens 25c..25c+24; token 0 is never scored, nll[:, i] is token i + 1
    by_hand = [fold.nll[:, 25 * c - 1 if c else 0 : 25 * c + 24].mean() for c in range(4)]
    assert torch.allclose(fold.chunk_nll(), torch.stack(by_hand), rtol=0, atol=1e-12)


def test_models_and_inputs_that_cannot_be_folded_are_refused() -> None:
    gpt2, llama = tiny("gpt2"), tiny("llama")
    long = torch.randint(0, V, (1, 300))
    with pytest.raises(
        ValueError,
        match=r"300 positions .* max_position_embeddings = 256; its positions are not rotary",
    ):
        kv_fold(gpt2, long, 64, allow_extrapolation=True)
    with pytest.raises(ValueError, match="allow_extrapolation=True"):
        kv_fold(llama, long, 64)
    assert kv_fold(llama, long, 64, allow_extrapolation=True).nll.shape == (
        1,
        299,
    )
    with pytest.raises(ValueError, match="chunk_size: must be an int >= 1"):
        kv_fold(llama, long, 0)
    with pytest.raises(ValueError, match="260 positions"):  # 250 + 11 - 1 positions
        fold_generate(llama, long[:, :250], 64, max_new_tokens=11)
    assert fold_generate(llama, long[:, :250], 64, max_new_tokens=7).shape == (1, 7)
    with pytest.raises(ValueError, match=r"input_ids: expected \(batch, tokens\)"):
        kv_fold(llama, long[0], 8)
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=V, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    )
    with pytest.raises(ValueError, match="encoder-decoder"):
        kv_fold(t5, long[:, :10], 4)


def test_drift_is_numerical_for_an_exact_fold_and_structural_with_a_prefix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from longkv.fold.drift import drift_table, measure_drift, plot_drift

    model = tiny("llama")
    ids = torch.randint(2, V, (2, T), generator=torch.Generator().manual_seed(6))
    exact = measure_drift(model, ids, 16)
    bos = measure_drift(model, ids, 16, variant="bos")
    assert len(exact.drift) == len(bos.drift) == 7
    assert max(abs(d) for d in exact.drift) <= 1e-5
    assert abs(exact.drift[0]) <= 1e-6  # the first chunk is the same computation
    assert max(abs(d) for d in bos.drift[1:]) > 1e-3  # the inserted tokens change the context
    table = drift_table([exact, bos])
    assert "| 16 | float32 | bos | 7 |" in table
    plot_drift([exact, bos], tmp_path / "drift.png", "tiny llama")
    assert (tmp_path / "drift.png").read_bytes()[:4] == b"\x89PNG"


def test_cache_offloading_is_refused_on_the_cpu() -> None:
    with pytest.raises(ValueError, match="offload_cache: the cache already lives in CPU memory"):
        kv_fold(tiny("llama"), torch.zeros(1, 8, dtype=torch.long), 4, offload_cache=True)


def test_fold_and_streaming_leave_the_process_alone() -> None:
    """No allocator options, heap trims or RSS resets: the memory probe is never imported."""
    script = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from longkv.fold import kv_fold, fold_generate
from longkv.caches import streaming_llm
config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 50, (1, 12))
kv_fold(model, ids, 5)
streaming_llm(model, ids, sinks=1, window=4, chunk_size=2)
fold_generate(model, ids, 5, 3)
print(sorted(m for m in sys.modules if m.startswith("longkv.bench")))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
