"""Segmentation invariance, the T <= W limit, the state object and input errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import Inputs, assert_close, assert_same_state, make_inputs
from longkv.kvm import KVMConfig, KVMState, kvm_attention
from longkv.kvm.state import window_start

CONFIGS = {
    "fixed": KVMConfig(
        chunk_len=4, window_chunks=2, sink_len=1, state_min_len=6, max_state_chunks=2
    ),
    "sqrt": KVMConfig(
        chunk_len=4,
        window_chunks=1,
        sink_len=2,
        budget="power_law",
        state_min_len=4,
        growth_factor=3.0,
        max_state_chunks=None,
        rope_dim=2,
    ),
    "saturation-count": KVMConfig(
        chunk_len=5,
        window_chunks=3,
        sink_len=0,
        budget="saturation",
        state_min_len=1,
        saturation_n=16,
        max_state_chunks=None,
        use_vlens=False,
        gate_appends=False,
    ),
}


def run_segments(inp: Inputs, config: KVMConfig, cuts: list[int]) -> tuple[torch.Tensor, KVMState]:
    """kvm_attention over the pieces [cuts[i], cuts[i+1]), carrying the state."""
    state, outs = None, []
    for a, b in itertools.pairwise(cuts):
        q, k, v, extras = inp.span(a, b)
        out, state = kvm_attention(q, k, v, config, state=state, **extras)
        outs.append(out)
    assert state is not None
    return torch.cat(outs, dim=2), state


def segmentations(T: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), 9))
    return {
        "random": [0, *cuts, T],
        "tokens": list(range(T + 1)),
        "prefill-decode": [0, *range(23, T + 1)],
        "chunk-aligned": [0, 8, 16, 24, T],
    }


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("split", ["random", "tokens", "prefill-decode", "chunk-aligned"])
def test_any_segmentation_equals_one_call(name: str, split: str) -> None:
    config, T = CONFIGS[name], 47
    inp = make_inputs(T=T, seed=len(name))
    whole, whole_state = kvm_attention(inp.q, inp.k, inp.v, config, **inp.extras)
    out, state = run_segments(inp, config, segmentations(T, seed=len(split))[split])
    assert_close(out, whole)
    assert_same_state(state, whole_state)


def test_state_is_not_modified_by_a_later_call() -> None:
    config, inp = CONFIGS["fixed"], make_inputs(T=30)
    q, k, v, extras = inp.span(0, 20)
    _, state = kvm_attention(q, k, v, config, **extras)
    snapshot = (state.seen, state.slot_k.clone(), state.window.k.clone())
    q, k, v, extras = inp.span(20, 30)
    kvm_attention(q, k, v, config, state=state, **extras)
    assert state.seen == snapshot[0]
    assert_close(state.slot_k, snapshot[1], 0.0)
    assert_close(state.window.k, snapshot[2], 0.0)


@pytest.mark.parametrize("T", [1, 5, 12])
def test_within_the_window_kvm_is_causal_softmax_attention(T: int) -> None:
    config = KVMConfig(chunk_len=4, window_chunks=3, state_min_len=4)  # W = 12
    inp = make_inputs(H=4, Hkv=2, T=T)
    out, state = kvm_attention(inp.q, inp.k, inp.v, config, **inp.extras)
    tau_w = inp.extras["window_temp"].view(1, 4, 1, 1)
    k = inp.k.repeat_interleave(2, dim=1) * tau_w
    ref = F.scaled_dot_product_attention(
        inp.q, k, inp.v.repeat_interleave(2, dim=1), is_causal=True
    )
    assert_close(out, ref)
    assert state.num_slots == min(T, 4)


def test_state_reports_slots_seen_bytes_and_moves() -> None:
    config, inp = CONFIGS["sqrt"], make_inputs(T=47, Dk=8, Dv=6)
    _, state = kvm_attention(inp.q, inp.k, inp.v, config, **inp.extras)
    assert state.seen == 47
    assert state.num_slots == state.slot_k.shape[2] == state.slot_v.shape[2]
    L = 47 - window_start(config, 47)
    assert state.window.k.shape[2] == L
    S, B, Hkv = state.num_slots, 2, 2
    assert state.nbytes == 8 * (B * Hkv * (S * (8 + 6 + 1) + L * (8 + 6 + 1)))
    half = state.to(dtype=torch.float32)
    assert half.slot_k.dtype == half.window.k.dtype == torch.float32
    assert half.nbytes == state.nbytes // 2
    assert half.seen == state.seen and half.config == state.config
    assert state.to("cpu").slot_k.device.type == "cpu"
    # a moved state continues the sequence
    q, k, v, extras = make_inputs(T=3, seed=5).span(0, 3)
    f32 = {n: t.float() for n, t in extras.items()}
    out, _ = kvm_attention(q.float(), k.float(), v.float(), config, state=half, **f32)
    assert out.dtype == torch.float32


def test_bad_inputs_raise_clear_errors() -> None:
    config, inp = CONFIGS["fixed"], make_inputs(T=10)
    q, k, v = inp.q, inp.k, inp.v

    def fails(match: str, **kwargs: object) -> None:
        args = {"q": q, "k": k, "v": v, "config": config, **kwargs}
        with pytest.raises(ValueError, match=match):
            kvm_attention(**args)  # type: ignore[arg-type]

    fails("q: expected 4 dims", q=q[0])
    fails("k: shape", k=k[:, :, :5])
    fails("v: shape", v=v[:1])
    fails(
        "do not divide",
        k=torch.randn(2, 3, 10, 8, dtype=q.dtype),
        v=torch.randn(2, 3, 10, 6, dtype=q.dtype),
    )
    fails("k: dtype/device", k=k.float())
    fails("v: dtype/device", v=v.to("meta"))
    fails("q: expected a floating dtype", q=q.long())
    fails("no tokens", q=q[:, :, :0], k=k[:, :, :0], v=v[:, :, :0])
    fails("gate: expected shape", gate=torch.ones(2, 2, 10, dtype=q.dtype))
    fails("gate: merge gates must be > 0", gate=torch.zeros(2, 2, 10, 1, dtype=q.dtype))
    fails("norm_weight: expected shape", norm_weight=torch.ones(7, dtype=q.dtype))
    fails("window_temp: dtype/device", window_temp=torch.ones(4))
    fails("rope_dim: 8 >= key head dim 8", config=KVMConfig(chunk_len=4, rope_dim=8))
    _, state = kvm_attention(q, k, v, config)
    fails("state: was made with", state=state, config=KVMConfig(chunk_len=4, state_min_len=5))
    fails("state: holds", state=state, q=q[:1], k=k[:1], v=v[:1])
    fails("state: dtype/device", state=state.to(dtype=torch.float32))
    fails("state: expected a KVMState", state=state.window)
