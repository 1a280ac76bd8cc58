"""Bounded caches on models whose layers differ: Gemma 3's sliding-window layers keep their own
window while the method bounds its global layers, each layer type rotated by its own RoPE table;
Qwen2 beside them."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from conftest import tiny_hf
from longkv.attention.rope import angles_at, rotate
from longkv.caches.bounded import bounded_fold
from longkv.caches.methods import BOUNDED, BoundedOptions, make_runner
from longkv.caches.streaming import StreamingRunner
from longkv.fold import kv_fold
from longkv.fold.attention import AttentionHooks, hooked

T, W = 90, 16  # tokens read; the tiny Gemma 3's sliding window


def ids_of(n: int = T) -> Tensor:
    return torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(7))


def test_longkv_attention_keeps_a_sliding_layers_window() -> None:
    """The model's own forward and longkv's attention (`hooked`) agree on a hybrid model read
    past its sliding window, in one forward and folded through its cache."""
    model, ids = tiny_hf("gemma3", torch.float64), ids_of()
    with torch.no_grad():
        own = model(ids).logits
        with hooked(model, AttentionHooks()):
            ours = model(ids).logits
    assert (own - ours).abs().max().item() <= 1e-10
    with hooked(model, AttentionHooks()):
        folded = kv_fold(model, ids, 7, return_logits=True).logits
    assert folded is not None and (own - folded).abs().max().item() <= 1e-10


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_every_bounded_method_reads_a_long_input_within_its_budget(arch: str) -> None:
    model, ids = tiny_hf(arch), ids_of()
    options = BoundedOptions(budgets=(20,), sinks=2, window=10, stream_chunk=5, kvm_open=(0, 2))
    for label, config in options.bounded_configs(BOUNDED).items():
        runner = make_runner(model, config)
        run = bounded_fold(runner, ids, 5)
        assert torch.isfinite(run.nll).all(), label
        for i, w in enumerate(runner.windows):
            held = runner.sink_k[i].shape[2] + runner.window_k[i].shape[2]
            if w is None:  # a bounded layer: sinks and window (and the middle) in the budget
                assert held + runner.middle_count <= 20, label
            else:  # a sliding layer: the last w - 1 tokens before the next chunk, no sinks
                assert runner.sink_k[i].shape[2] == 0 and held == w - 1, label
    assert runner.windows == ([W, None, W] if arch == "gemma3" else [None, None])


def test_a_sliding_layer_and_the_global_layer_after_it_see_what_the_model_sees() -> None:
    """StreamingLLM on the hybrid Gemma 3 (sliding, global, sliding): the sliding layer 0
    attends its own window, so the global layer 1 gets the exact fold's keys; the runner keeps
    both un-rotated, each with its own layer type's RoPE table (bases 10^4 and 10^6)."""
    model, ids = tiny_hf("gemma3", torch.float64), ids_of()
    exact = kv_fold(model, ids, 10).cache
    runner = StreamingRunner(model, sinks=2, window=12)
    bounded_fold(runner, ids, 4)
    rotary = model.model.rotary_emb
    tables = [rotary.sliding_attention_inv_freq, rotary.full_attention_inv_freq]
    assert not torch.allclose(tables[0], tables[1])
    for layer, table in enumerate(tables):
        kept = runner.window_k[layer]  # un-rotated, the newest tokens last
        n = kept.shape[2]
        assert n == (W - 1 if layer == 0 else 12)
        positions = torch.arange(T - n, T)
        cos, sin = angles_at(-positions, table.double())
        want = rotate(exact.layers[layer].keys[:, :, -n:], cos, sin)
        # the model takes its angles in float32 (transformers' rotary embedding)
        assert (kept - want).abs().max().item() <= 1e-5, layer
