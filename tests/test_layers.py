"""nn.Module layers: wiring against the functional references, streaming, ablations, gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, assert_same_state
from longkv.attention import (
    AttentionConfig,
    BlockSlidingWindowAttention,
    FullAttention,
    SlidingWindowAttention,
    naive_block_sliding_window_attention,
    naive_full_attention,
    naive_sliding_window_attention,
)
from longkv.attention.rope import apply_rope
from longkv.kvm import ABLATIONS, KVMAttention, KVMConfig, kvm_attention_naive

SHELL = AttentionConfig(d_model=16, n_heads=4, n_kv_heads=2, head_dim=8)
KVM = KVMConfig(
    chunk_len=4, window_chunks=2, sink_len=1, budget="power_law", state_min_len=4,
    growth_factor=3.0, max_state_chunks=None, rope_dim=4,
)  # fmt: skip


def randomized(layer: torch.nn.Module) -> torch.nn.Module:
    """Float64 layer with every parameter perturbed; those initialised to 1 stay near 1."""
    layer = layer.double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (p == 1).double())
    return layer


def by_hand(layer: KVMAttention | FullAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v written out from the layer's parameters: project, LayerNorm, RoPE."""
    c = layer.config
    B, T, _ = x.shape
    pos = torch.arange(T)

    def heads(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.view(B, T, n, c.dim).transpose(1, 2)

    def ln(t: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
        return F.layer_norm(t, (c.dim,), norm.weight, norm.bias, eps=norm.eps)

    q = ln(heads(x @ layer.q_proj.weight.T, c.n_heads), layer.q_norm)  # type: ignore[arg-type]
    k = ln(heads(x @ layer.k_proj.weight.T, c.kv_heads), layer.k_norm)  # type: ignore[arg-type]
    v = heads(x @ layer.v_proj.weight.T, c.kv_heads)
    return apply_rope(q, pos, c.rotary), apply_rope(k, pos, c.rotary), v


def test_kvm_layer_is_the_reference_with_its_parameters() -> None:
    layer = randomized(KVMAttention(SHELL, KVM))
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    y, state = layer(x)
    q, k, v = by_hand(layer, x)
    gate = (1 + F.elu(x @ layer.gate_proj.weight.T + layer.gate_proj.bias)).transpose(1, 2)
    ref, ref_state = kvm_attention_naive(
        q, k, v, KVM, gate=gate.unsqueeze(-1),
        norm_weight=layer.state_norm.weight, norm_bias=layer.state_norm.bias,
        window_temp=layer.window_temp, state_temp=layer.state_temp,
    )  # fmt: skip
    assert_close(y, ref.transpose(1, 2).reshape(2, 30, -1) @ layer.o_proj.weight.T)
    assert_same_state(state, ref_state)


@pytest.mark.parametrize(
    ("make", "naive"),
    [
        (lambda: FullAttention(SHELL), naive_full_attention),
        (
            lambda: SlidingWindowAttention(SHELL, 5),
            lambda q, k, v: naive_sliding_window_attention(q, k, v, 5),
        ),
        (
            lambda: BlockSlidingWindowAttention(SHELL, 4, 2),
            lambda q, k, v: naive_block_sliding_window_attention(q, k, v, 4, 2),
        ),
    ],
)
def test_baseline_layers_are_their_references(make, naive) -> None:  # type: ignore[no-untyped-def]
    layer = randomized(make())
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    y, _ = layer(x)
    ref = naive(*by_hand(layer, x))
    assert_close(y, ref.transpose(1, 2).reshape(2, 30, -1) @ layer.o_proj.weight.T)


@pytest.mark.parametrize("kind", ["kvm", "full", "swa", "bswa"])
def test_layers_stream_with_positions_continuing(kind: str) -> None:
    make = {
        "kvm": lambda: KVMAttention(SHELL, KVM),
        "full": lambda: FullAttention(SHELL),
        "swa": lambda: SlidingWindowAttention(SHELL, 5),
        "bswa": lambda: BlockSlidingWindowAttention(SHELL, 4, 2),
    }[kind]
    layer = randomized(make())
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    whole, _ = layer(x)
    parts, state = [], None
    for a, b in [(0, 11), *((t, t + 1) for t in range(11, 30))]:
        y, state = layer(x[:, a:b], state)
        parts.append(y)
    assert_close(torch.cat(parts, dim=1), whole)


@pytest.mark.parametrize("ablation", ABLATIONS)
def test_each_ablation_switches_one_thing(ablation: str) -> None:
    base = randomized(KVMAttention(SHELL, KVM))
    layer = KVMAttention.ablated(SHELL, KVM, ablation).double()
    layer.load_state_dict(base.state_dict(), strict=False)
    changed = {
        "no_vlens": layer.kvm.use_vlens is False,
        "no_sink": layer.kvm.sink_len == 0,
        "no_append_gate": layer.kvm.gate_appends is False,
        "no_merge_gate": layer.gate_proj is None,
        "no_head_temps": layer.window_temp is None and layer.state_temp is None,
    }
    assert [name for name, on in changed.items() if on] == [ablation]
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    assert (layer(x)[0] - base(x)[0]).abs().max() > 1e-6


@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize("kind", ["kvm", "full"])
def test_token_shift_and_value_residual_follow_their_formulas(kind: str, rank: int) -> None:
    shell = replace(SHELL, token_shift=True, value_residual=True, value_residual_rank=rank)
    make = {"kvm": lambda c: KVMAttention(c, KVM), "full": FullAttention}[kind]
    layer = randomized(make(shell))
    plain = make(SHELL).double()
    plain.load_state_dict(layer.state_dict(), strict=False)  # the same weights, no extras
    x, x_prev = torch.randn(2, 2, 30, 16, dtype=torch.float64)
    v_first = torch.randn(2, 2, 30, 8, dtype=torch.float64)
    y, state, v = layer.forward_with_values(x, x_prev=x_prev, v_first=v_first)
    assert layer.shift_k is not None and layer.shift_v is not None
    assert layer.value_mix is not None
    q, _, _ = plain.project(x, 0)
    _, k, _ = plain.project(x + layer.shift_k * (x_prev - x), 0)
    _, _, v_own = plain.project(x + layer.shift_v * (x_prev - x), 0)
    if rank:  # per channel: sigmoid(v0 + x A B), (B, T, Hkv * D) -> (B, Hkv, T, D)
        assert layer.value_gate is not None and layer.value_mix.shape == (16,)
        A, B = (m.weight.T for m in layer.value_gate)
        lam = torch.sigmoid(layer.value_mix + x @ A @ B).view(2, 30, 2, 8).transpose(1, 2)
    else:  # per KV head
        lam = torch.sigmoid(layer.value_mix).view(1, 2, 1, 1)
    out, ref_state = plain.mix(q, k, (1 - lam) * v_own + lam * v_first, x, None)
    assert_close(v, v_own)
    assert_close(y, plain.o_proj(out.transpose(1, 2).reshape(2, 30, -1)))
    if kind == "kvm":
        assert_same_state(state, ref_state)
    else:  # the cache holds the mixed values
        assert_close(state.v, ref_state.v)
    with pytest.raises(ValueError, match="x_prev: a token_shift layer needs the input one token"):
        layer.forward_with_values(x, v_first=v_first)
    with pytest.raises(ValueError, match="v_first: a value_residual layer needs the first layer"):
        layer.forward_with_values(x, x_prev=x_prev)


def test_gradients_reach_every_parameter() -> None:
    shell = replace(SHELL, token_shift=True, value_residual=True)
    layer = KVMAttention(shell, KVM, merge_gate=True, head_temperatures=True)
    x, x_prev = torch.randn(2, 2, 30, 16)
    y, state, _ = layer.forward_with_values(x, x_prev=x_prev, v_first=torch.randn(2, 2, 30, 8))
    (y.square().mean() + state.slot_v.square().mean()).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_layer_config_errors() -> None:
    with pytest.raises(ValueError, match=r"AttentionConfig\.n_kv_heads: must divide"):
        AttentionConfig(d_model=16, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match=r"AttentionConfig\.head_dim: is None"):
        AttentionConfig(d_model=10, n_heads=4)
    with pytest.raises(ValueError, match=r"AttentionConfig\.rope_dim: must be an even"):
        AttentionConfig(d_model=16, n_heads=4, rope_dim=5)
    with pytest.raises(ValueError, match=r"AttentionConfig\.rope_dim: 2 differs"):
        KVMAttention(AttentionConfig(d_model=16, n_heads=4, rope_dim=2), KVM)
    with pytest.raises(ValueError, match=r"KVMConfig\.rope_dim: 8 >= key head dim 8"):
        KVMAttention(SHELL, KVMConfig(chunk_len=4, rope_dim=8))
    with pytest.raises(ValueError, match="ablations: unknown"):
        KVMAttention.ablated(SHELL, KVM, "no_state")
    with pytest.raises(ValueError, match="window: must be an int >= 1"):
        SlidingWindowAttention(SHELL, 0)
    with pytest.raises(ValueError, match=r"x: expected \(batch, tokens, d_model=16\)"):
        FullAttention(SHELL)(torch.randn(2, 30, 8))
