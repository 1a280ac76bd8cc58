"""StreamingLLM: bounded cache, and equality with a from-scratch recomputation on a tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import tiny_hf
from longkv.caches.streaming import StreamingRunner, streaming_generate, streaming_llm

V = 61


def tiny_llama() -> LlamaForCausalLM:
    """The tiny Llama in float64, over V tokens, with a narrower MLP and 64 positions."""
    return tiny_hf(
        dtype=torch.float64, vocab_size=V, intermediate_size=48, max_position_embeddings=64
    )


def naive_streaming(
    model: LlamaForCausalLM, ids: list[int], sinks: int, window: int, chunk: int
) -> torch.Tensor:
    """Logits (T, V) written out from the weights, one token at a time.

    Keys are stored un-rotated and rotated at their cache index on every step; before each chunk
    the oldest non-sink entries are dropped so the chunk fits in sinks + window.
    """
    c, m = model.config, model.model
    H, Hkv = c.num_attention_heads, c.num_key_value_heads
    D = c.hidden_size // H
    inv_freq = m.rotary_emb.inv_freq.double()

    def rope(x: torch.Tensor, pos: int) -> torch.Tensor:  # x (..., D) rotate-half
        ang = torch.cat([pos * inv_freq, pos * inv_freq])
        rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1)
        return x * ang.cos() + rot * ang.sin()

    def rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return norm.weight * x / torch.sqrt(x.square().mean() + norm.variance_epsilon)

    keys: list[list[torch.Tensor]] = [[] for _ in m.layers]  # un-rotated, (Hkv, D) each
    values: list[list[torch.Tensor]] = [[] for _ in m.layers]
    out = []
    for t, token in enumerate(ids):
        if t % chunk == 0:
            excess = len(keys[0]) + min(chunk, len(ids) - t) - (sinks + window)
            for store in (*keys, *values):
                del store[sinks : sinks + max(excess, 0)]
        x = m.embed_tokens.weight[token]
        for layer, ks, vs in zip(m.layers, keys, values, strict=True):
            a = layer.self_attn
            h = rms(x, layer.input_layernorm)
            ks.append((a.k_proj.weight @ h).view(Hkv, D))
            vs.append((a.v_proj.weight @ h).view(Hkv, D))
            n = len(ks) - 1  # the query's cache index
            q = rope((a.q_proj.weight @ h).view(H, D), n)
            K = torch.stack([rope(k, i) for i, k in enumerate(ks)])  # (n+1, Hkv, D)
            Vs = torch.stack(vs)
            heads = []
            for head in range(H):
                g = head // (H // Hkv)
                w = torch.softmax(K[:, g] @ q[head] / math.sqrt(D), dim=0)
                heads.append(w @ Vs[:, g])
            x = x + a.o_proj.weight @ torch.cat(heads)
            h = rms(x, layer.post_attention_layernorm)
            mlp = layer.mlp
            x = x + mlp.down_proj.weight @ (
                torch.nn.functional.silu(mlp.gate_proj.weight @ h) * (mlp.up_proj.weight @ h)
            )
        out.append(model.lm_head.weight @ rms(x, m.norm))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("sinks", "window", "chunk"), [(2, 9, 1), (0, 6, 1), (3, 8, 4), (1, 12, 5)]
)
def test_streaming_equals_naive_recomputation(sinks: int, window: int, chunk: int) -> None:
    model = tiny_llama()
    ids = torch.randint(0, V, (1, 40), generator=torch.Generator().manual_seed(1))
    run = streaming_llm(
        model,
        ids,
        sinks=sinks,
        window=window,
        chunk_size=chunk,
        return_logits=True,
    )
    ref = naive_streaming(model, ids[0].tolist(), sinks, window, chunk)
    assert run.logits is not None
    # transformers computes RoPE angles and RMSNorm in float32 even for a float64 model
    assert (run.logits[0] - ref).abs().max().item() <= 1e-6
    assert run.cache.get_seq_length() == sinks + window


def test_cache_never_exceeds_sinks_plus_window() -> None:
    model = tiny_llama()
    runner = StreamingRunner(model, sinks=4, window=10)
    ids = torch.randint(0, V, (2, 50))
    lengths = []
    with torch.inference_mode():
        for t in range(0, 50, 3):
            runner.forward(ids[:, t : t + 3])
            lengths.append(runner.position)
            assert all(layer.keys.shape[2] <= 14 for layer in runner.cache.layers)
    assert max(lengths) == 14


def test_each_query_attends_the_cache_and_its_chunk_as_a_share_of_full_attention() -> None:
    runner = StreamingRunner(tiny_llama(), sinks=4, window=10)
    ids = torch.randint(0, V, (2, 50))
    with torch.inference_mode():
        for t in range(0, 50, 3):
            runner.forward(ids[:, t : t + 3])
    # the last forward reads tokens 48 and 49 after 14 - 2 entries
    last = runner.attention_share(since=48)
    assert last == pytest.approx({"mean": (13 / 49 + 14 / 50) / 2, "max": 14 / 50}, abs=1e-12)
    assert runner.attention_share()["max"] == 1.0  # the first chunks see every token
    with pytest.raises(ValueError, match="since: no forward began at position 50"):
        runner.attention_share(since=50)


def test_the_sinks_stay_and_the_middle_leaves() -> None:
    model = tiny_llama()
    ids = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(2))
    runner = StreamingRunner(model, sinks=2, window=5)
    with torch.inference_mode():
        runner.forward(ids[:, :2])
        sink_keys = [layer.keys.clone() for layer in runner.cache.layers]
        for t in range(2, 30):
            runner.forward(ids[:, t : t + 1])
    for layer, before in zip(runner.cache.layers, sink_keys, strict=True):
        # stored un-rotated, rotated again at the same index for every forward (float64)
        torch.testing.assert_close(layer.keys[:, :, :2], before, rtol=0, atol=1e-15)
    assert runner.tokens == [0, 1, 25, 26, 27, 28, 29]


def test_generation_continues_the_stream() -> None:
    model = tiny_llama()
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(3))
    out = streaming_generate(model, ids, 5, sinks=2, window=8, chunk_size=1)
    assert out.shape == (2, 5)
    # the same tokens fed one by one through the stream give the same next-token choices
    run = streaming_llm(
        model,
        torch.cat([ids, out[:, :-1]], 1),
        sinks=2,
        window=8,
        chunk_size=1,
        return_logits=True,
    )
    assert run.logits is not None
    assert torch.equal(run.logits[:, 29:].argmax(-1), out)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings = 64"):
        StreamingRunner(tiny_llama(), sinks=4, window=61)
    with pytest.raises(
        ValueError,
        match=r"BoundedConfig\.window: must be None \(half the budget\) or an int >= 1, got 0",
    ):
        StreamingRunner(tiny_llama(), window=0)
    with pytest.raises(ValueError, match="chunk_size: 9 exceeds the window 8"):
        streaming_llm(tiny_llama(), torch.zeros(1, 20, dtype=torch.long), window=8, chunk_size=9)
