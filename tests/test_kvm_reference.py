"""The chunk-parallel fast path equals the token-by-token reference in float64."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from conftest import assert_close, assert_same_state, make_inputs
from longkv.attention import naive_block_sliding_window_attention
from longkv.kvm import KVMConfig, desired_state_len, kvm_attention, kvm_attention_naive

C = 4  # small chunks so that T = 45 crosses eleven chunk boundaries


def small_config(budget: str, **overrides: object) -> KVMConfig:
    """Budgets sized for C = 4 so that updates append all, some and none of a block."""
    per_budget: dict[str, dict[str, object]] = {
        "fixed": dict(state_min_len=6, max_state_chunks=2),
        "power_law": dict(
            state_min_len=4, growth_factor=3.0, growth_exponent=0.5, max_state_chunks=None
        ),
        "saturation": dict(state_min_len=1, saturation_n=16, max_state_chunks=None),
    }
    return KVMConfig(chunk_len=C, budget=budget, **{**per_budget[budget], **overrides})  # type: ignore[arg-type]


def append_counts(config: KVMConfig, T: int) -> list[int]:
    """Slots appended by each update of a T-token sequence, from the budget function alone."""
    W, S, counts = config.window_len, C, []
    for cov in range(C, max(0, -(-T // C) * C - W), C):
        n = min(max(desired_state_len(config, W + cov, cov + C, S) - S, 0), C)
        counts.append(n)
        S += n
    return counts


GRID = list(itertools.product(["fixed", "power_law", "saturation"], [0, 1, 2], [1, 2, 3]))
SWITCHES = ("vlens", "gate", "gate_appends", "temps", "rope", "gqa")


def switches(i: int) -> dict[str, bool]:
    """On/off for each switch in grid case i: a seeded draw, so combinations vary case to case."""
    rng = random.Random(1000 + i)
    return {name: rng.random() < 0.5 for name in SWITCHES}


@pytest.mark.parametrize(
    ("i", "case"), list(enumerate(GRID)), ids=[f"{b}-s{s}-N{n}" for b, s, n in GRID]
)
def test_fast_equals_reference(i: int, case: tuple[str, int, int]) -> None:
    budget, sink, N = case
    on = switches(i)
    config = small_config(
        budget,
        sink_len=sink,
        window_chunks=N,
        use_vlens=on["vlens"],
        gate_appends=on["gate_appends"],
        rope_dim=4 if on["rope"] else 0,
    )
    inp = make_inputs(Hkv=2 if on["gqa"] else 4, T=45, gate=on["gate"], temps=on["temps"], seed=i)
    out, state = kvm_attention(inp.q, inp.k, inp.v, config, **inp.extras)
    ref, ref_state = kvm_attention_naive(inp.q, inp.k, inp.v, config, **inp.extras)
    assert_close(out, ref)
    assert_same_state(state, ref_state)


def test_grid_turns_every_switch_both_ways_under_every_budget() -> None:
    for budget in ("fixed", "power_law", "saturation"):
        cases = [switches(i) for i, case in enumerate(GRID) if case[0] == budget]
        for name in SWITCHES:
            assert {c[name] for c in cases} == {True, False}, (budget, name)


def test_grid_exercises_every_kind_of_update() -> None:
    """The grid's budgets append all, some and none of a block (else ranking goes untested)."""
    kinds = set()
    for budget, _, N in GRID:
        for n in append_counts(small_config(budget, window_chunks=N), 45):
            kinds.add("all" if n == C else "none" if n == 0 else "some")
    assert kinds == {"all", "some", "none"}


@pytest.mark.parametrize("use_vlens", [True, False])
def test_state_changes_the_output_beyond_the_window(use_vlens: bool) -> None:
    """Past the first W tokens KVM is not BSWA: the slots take part in the softmax."""
    config = small_config("power_law", use_vlens=use_vlens)
    inp = make_inputs(Hkv=4, T=30, gate=False, norm=False, temps=False)
    out, _ = kvm_attention(inp.q, inp.k, inp.v, config)
    bswa = naive_block_sliding_window_attention(inp.q, inp.k, inp.v, C, config.window_chunks)
    W = config.window_len
    assert_close(out[:, :, :W], bswa[:, :, :W])
    assert (out[:, :, W:] - bswa[:, :, W:]).abs().amin(dim=-1).gt(1e-6).all()


def test_count_mode_counts_tokens_per_slot() -> None:
    """In count mode r is the number of tokens in each slot, and the counts add up to covered."""
    config = small_config("saturation", use_vlens=False, sink_len=1)
    inp = make_inputs(T=45)
    _, state = kvm_attention(inp.q, inp.k, inp.v, config, **inp.extras)
    covered = max(C, -(-45 // C) * C - config.window_len)
    assert torch.all(state.slot_r.sum(dim=-1) == covered)
    assert torch.all(state.slot_r[..., :1] == 1)  # the sink never takes merges
    assert torch.all(state.slot_r == state.slot_r.round())


def test_sinks_never_change() -> None:
    config = small_config("fixed", sink_len=2)
    inp = make_inputs(T=45)
    _, state = kvm_attention(inp.q, inp.k, inp.v, config, **inp.extras)
    _, first = kvm_attention(*inp.span(0, 2)[:3], config, **inp.span(0, 2)[3])
    assert_close(state.slot_k[:, :, :2], first.slot_k, 0.0)
    assert_close(state.slot_v[:, :, :2], first.slot_v, 0.0)


def test_float32_matches_float64() -> None:
    """The fast path in float32 stays near its float64 result (no silent precision loss)."""
    config = small_config("power_law")
    inp = make_inputs(T=45)
    out64, _ = kvm_attention(inp.q, inp.k, inp.v, config, **inp.extras)
    f32 = {n: t.float() for n, t in inp.extras.items()}
    out32, state32 = kvm_attention(inp.q.float(), inp.k.float(), inp.v.float(), config, **f32)
    assert out32.dtype == torch.float32 and state32.slot_k.dtype == torch.float32
    assert_close(out32.double(), out64, 1e-4)
