"""Shared helpers for the tests: random attention inputs, tiny longkv models in float64, tiny
random Llama and Qwen2 models, and what the tests need beyond the data shipped with longkv (the
full corpus, the default model), skipped when absent.

The full public-domain corpus is looked for in `shared/data/corpus` beside the checkout, or under
$LONGKV_TEST_SHARED when it is set (`LONGKV_TEST_SHARED=/nonexistent` runs the suite as a
clone without it would). Tests marked `smollm2` need the default model: converted in the cache,
or its GGUF package and `gguf` installed to convert it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2TokenizerFast,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from longkv.data.corpus import GPT2_DIR
from longkv.kvm import KVMState
from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.models.pretrained import SMOLLM2_FOLDER, cache_dir, is_converted, smollm2_gguf

SHARED_ENV = "LONGKV_TEST_SHARED"
SHARED = Path(os.environ.get(SHARED_ENV) or Path(__file__).resolve().parents[2] / "shared")
SHARED_CORPUS = SHARED / "data" / "corpus"

TOL = 1e-10


@dataclass
class Inputs:
    """q (B, H, T, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv) and the optional KVM arguments."""

    q: Tensor
    k: Tensor
    v: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)

    def span(self, a: int, b: int) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
        """Tokens [a, b): q, k, v and the extras with a token axis (the gate) sliced."""
        extras = {n: (t[:, :, a:b] if n == "gate" else t) for n, t in self.extras.items()}
        return self.q[:, :, a:b], self.k[:, :, a:b], self.v[:, :, a:b], extras


def make_inputs(
    *,
    B: int = 2,
    H: int = 4,
    Hkv: int = 2,
    T: int = 40,
    Dk: int = 8,
    Dv: int = 6,
    gate: bool = True,
    norm: bool = True,
    temps: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Inputs:
    """Random inputs; gates in (0.5, 1.5), LN affine near identity, temperatures near 1."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    def rand(*shape: int) -> Tensor:
        return torch.rand(*shape, generator=g, dtype=dtype)

    extras: dict[str, Tensor] = {}
    q, k, v = randn(B, H, T, Dk), randn(B, Hkv, T, Dk), randn(B, Hkv, T, Dv)
    if gate:
        extras["gate"] = 0.5 + rand(B, Hkv, T, 1)
    if norm:
        extras["norm_weight"] = 1 + 0.2 * randn(Dk)
        extras["norm_bias"] = 0.2 * randn(Dk)
    if temps:
        extras["window_temp"] = 0.7 + 0.6 * rand(H)
        extras["state_temp"] = 0.7 + 0.6 * rand(H)
    return Inputs(q, k, v, extras)


def assert_close(a: Tensor, b: Tensor, tol: float = TOL) -> None:
    """Same shape and max abs difference <= tol."""
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"max abs difference {err:.3g} > {tol:.0e}"


def assert_same_state(a: KVMState, b: KVMState, tol: float = TOL) -> None:
    """Two KVM states hold the same slots, window and token count."""
    assert a.config == b.config
    assert a.seen == b.seen
    assert a.num_slots == b.num_slots
    assert a.window.start == b.window.start
    for name in ("slot_k", "slot_v", "slot_r"):
        assert_close(getattr(a, name), getattr(b, name), tol)
    assert_close(a.window.k, b.window.k, tol)
    assert_close(a.window.v, b.window.v, tol)
    assert a.window.g is not None and b.window.g is not None
    assert_close(a.window.g, b.window.g, tol)


TINY_KVM = dict(chunk_len=4, window_chunks=2, sink_len=1, state_min_len=4, rope_dim=4)
TINY_OVQ = dict(chunk_len=4, max_centroids=6)
BUDGETS = {
    "fixed": dict(budget="fixed", max_state_chunks=2, state_min_len=6),
    "sqrt": dict(budget="power_law", growth_factor=3.0, max_state_chunks=None),
    "saturation": dict(
        budget="saturation", saturation_n=16, state_min_len=1, max_state_chunks=None
    ),
}


def tiny_longkv(
    layout: list[str],
    budget: str = "sqrt",
    extras: bool = False,
    vocab_size: int = 53,
    **overrides: Any,
) -> LongKVForCausalLM:
    """A float64 longkv LM, d_model 32, C = 4 (extras: token shift and value residual on);
    grouped keys (2 KV heads) unless a layer is rwkv7, which needs one key head per head."""
    kv_heads = 4 if "rwkv7" in layout else 2
    config = LongKVConfig(**{
        **dict(
            vocab_size=vocab_size, d_model=32, n_layers=len(layout), n_heads=4,
            n_kv_heads=kv_heads, rwkv_chunk_len=4,
            layout=layout, kvm={**TINY_KVM, **BUDGETS[budget]}, ovq=TINY_OVQ, swa_window=6,
            bswa_chunk_len=4,
            bswa_window_chunks=2, token_shift=extras, value_residual=extras,
        ),
        **overrides,
    })  # fmt: skip
    torch.manual_seed(0)
    model = LongKVForCausalLM(config).double().eval()
    with torch.no_grad():  # LayerNorms, temperatures and mixes off their init
        for name, p in model.named_parameters():
            if any(part in name for part in ("norm", "temp", "shift", "value_mix", "beta")):
                p.add_(0.2 * torch.randn_like(p))
    return model


# a tiny Hugging Face decoder: 2 layers, d 32, 4 query heads over 2 KV heads
TINY_HF = dict(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


def gemma3_config(**kwargs: Any) -> Gemma3TextConfig:
    """A Gemma 3 config whose layers alternate sliding (window 16) and global attention,
    sliding first, with Gemma 3's two RoPE bases (10^4 sliding, 10^6 global) and head 8."""
    types = ["full_attention" if i % 2 else "sliding_attention" for i in range(3)]
    defaults = dict(num_hidden_layers=3, head_dim=8, sliding_window=16, layer_types=types)
    return Gemma3TextConfig(**{**kwargs, **defaults})


HF_ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "gemma3": (gemma3_config, Gemma3ForCausalLM),  # hybrid: sliding, global, sliding
}


def loss_and_grads(
    model: torch.nn.Module, ids: Tensor, **kwargs: Any
) -> tuple[float, list[Tensor]]:
    """The next-token loss of ids (B, T) (labels ids; kwargs go to the forward, e.g. a cache)
    and every parameter's gradient after its backward."""
    loss = model(ids, labels=ids, **kwargs).loss
    assert loss is not None
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def assert_same_training(
    a: tuple[float, list[Tensor]], b: tuple[float, list[Tensor]], tol: float
) -> None:
    """Two `loss_and_grads` results agree within tol, loss and every gradient."""
    assert abs(a[0] - b[0]) <= tol, (a[0], b[0])
    for x, y in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=tol)


def tiny_hf_config(arch: str = "llama", **overrides: Any) -> Any:
    """A Llama, Qwen2 or Gemma 3 config of TINY_HF's shape, with overrides."""
    return HF_ARCHS[arch][0](**{**TINY_HF, **overrides})


def tiny_hf(arch: str = "llama", dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """A random Llama, Qwen2 or Gemma 3 (seed 0) of `tiny_hf_config(arch, **overrides)`, in eval
    mode."""
    torch.manual_seed(0)
    return HF_ARCHS[arch][1](tiny_hf_config(arch, **overrides)).to(dtype).eval()


def over_tokenizer(tokenizer: Any) -> dict[str, Any]:
    """The overrides of TINY_HF for a model saved with a tokenizer, as the commands load one:
    one layer of d 16 (2 query heads over 1 KV head), the tokenizer's vocabulary, BOS and EOS."""
    return dict(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip


@functools.cache
def bos_gpt2() -> Any:
    """The GPT-2 tokenizer made to put its BOS (50256) before every text, as Gemma's does."""
    tokenizer = GPT2TokenizerFast.from_pretrained(GPT2_DIR, add_bos_token=True)
    assert tokenizer("x")["input_ids"] == [50256, 87]
    return tokenizer


def saved_model(factory: pytest.TempPathFactory, name: str, config: Any, cls: Any) -> str:
    """A folder holding a random model of `cls` built from `config` (seed 0), and the GPT-2
    tokenizer."""
    from longkv.train.tokenizer import gpt2_tokenizer

    folder = factory.mktemp(name)
    torch.manual_seed(0)
    cls(config).save_pretrained(folder)
    gpt2_tokenizer().save_pretrained(folder)
    return str(folder)


def unmapped(model: LongKVForCausalLM) -> LongKVForCausalLM:
    """The model with every parameter copied out of the checkpoint it was memory-mapped from.

    A model loaded from safetensors keeps its tensors at their offsets in the file (here 40
    bytes past a 64-byte boundary), and on AMD CPUs MKL's float64 GEMM computes such operands
    along another path, one ulp away; fresh tensors are 64-byte aligned like a built model's,
    so a save/load round trip can be compared bit for bit."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def shared_corpus() -> Path:
    """The full corpus (283 documents); the test is skipped when it is not there."""
    if not SHARED_CORPUS.is_dir():
        pytest.skip(
            f"needs the full corpus, not found at {SHARED_CORPUS} "
            f"(set {SHARED_ENV} to the folder holding data/corpus)"
        )
    return SHARED_CORPUS


@functools.cache
def smollm2_missing() -> str | None:
    """Why the default model cannot be loaded here, or None when it can."""
    if is_converted(cache_dir() / SMOLLM2_FOLDER):
        return None
    try:
        smollm2_gguf()
    except FileNotFoundError as err:
        return f"needs the default model SmolLM2-135M-Instruct: {err}"
    if importlib.util.find_spec("gguf") is None:
        return "needs the gguf package to convert the default model: pip install 'longkv[smollm2]'"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "smollm2: needs the default model SmolLM2-135M-Instruct (skipped without it)"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("smollm2") is not None and (reason := smollm2_missing()):
        pytest.skip(reason)
