"""KVMConfig validation, presets, and slot counts against spec section 6."""

from __future__ import annotations

import pytest
import torch

from longkv.kvm import KVMConfig, desired_state_len, kvm_attention

LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 131072]
SPEC_TABLE = {  # docs/kvm.md section 6, C = 256, N = 2
    "paper_fixed": [256, 256, 256, 256, 256, 256, 256],
    "paper_sqrt": [443, 677, 991, 1425, 2031, 2884, 5786],
    "paper_saturation": [438, 651, 808, 906, 962, 992, 1016],
}


def slots_after(config: KVMConfig, T: int) -> int:
    """Slots after T tokens, by running the budget function through every update."""
    C, W = config.chunk_len, config.window_len
    S = min(T, C)
    for cov in range(C, max(0, -(-T // C) * C - W), C):
        S += min(max(desired_state_len(config, W + cov, cov + C, S) - S, 0), C)
    return S


@pytest.mark.parametrize("preset", list(SPEC_TABLE))
def test_budget_function_reproduces_the_spec_table(preset: str) -> None:
    config = getattr(KVMConfig, preset)()
    assert [slots_after(config, T) for T in LENGTHS] == SPEC_TABLE[preset]


@pytest.mark.parametrize("preset", list(SPEC_TABLE))
def test_a_real_run_to_8k_tokens_has_the_spec_slot_counts(preset: str) -> None:
    config = getattr(KVMConfig, preset)(rope_dim=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1, 1, 8192, 8, generator=g)
    state, done = None, 0
    for T, want in zip(LENGTHS[:4], SPEC_TABLE[preset][:4], strict=True):
        _, state = kvm_attention(
            x[0, :, :, done:T], x[1, :, :, done:T], x[2, :, :, done:T], config, state=state
        )
        done = T
        assert (state.seen, state.num_slots) == (T, want)


def test_presets_carry_the_paper_values() -> None:
    f, s, t = KVMConfig.paper_fixed(), KVMConfig.paper_sqrt(), KVMConfig.paper_saturation()
    for c in (f, s, t):
        assert (c.chunk_len, c.window_chunks, c.sink_len, c.rope_dim) == (256, 2, 1, 64)
    assert (f.budget, f.state_min_len, f.max_state_chunks) == ("fixed", 256, 1)
    assert (s.budget, s.growth_factor, s.growth_exponent, s.state_min_len) == (
        "power_law",
        16.0,
        0.5,
        256,
    )
    assert s.max_state_chunks is None
    assert (t.budget, t.saturation_n, t.state_min_len, t.max_state_chunks) == (
        "saturation",
        1024,
        1,
        None,
    )
    assert KVMConfig.paper_fixed(rope_dim=32).rope_dim == 32


def test_budget_rules() -> None:
    pl = KVMConfig(
        budget="power_law", chunk_len=4, growth_factor=16.0, state_min_len=1, max_state_chunks=None
    )
    assert desired_state_len(pl, 768, 10_000, 0) == 443
    assert desired_state_len(pl, 768, 100, 0) == 100  # never above the tokens available
    assert desired_state_len(pl, 768, 10_000, 500) == 500  # never shrinks
    rounded = KVMConfig(
        budget="power_law", chunk_len=4, round_down=64, state_min_len=1, max_state_chunks=None
    )
    assert desired_state_len(rounded, 768, 10_000, 0) == 384
    capped = KVMConfig(budget="power_law", chunk_len=4, state_min_len=1, max_state_chunks=3)
    assert desired_state_len(capped, 768, 10_000, 0) == 12
    floor = KVMConfig(
        budget="saturation", chunk_len=4, saturation_n=8, state_min_len=20, max_state_chunks=None
    )
    assert desired_state_len(floor, 1000, 10_000, 0) == 20


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chunk_len", 0),
        ("chunk_len", -3),
        ("window_chunks", 0),
        ("sink_len", -1),
        ("sink_len", 256),
        ("budget", "linear"),
        ("state_min_len", 0),
        ("growth_factor", 0.0),
        ("growth_exponent", 1.5),
        ("saturation_n", 0),
        ("max_state_chunks", 0),
        ("round_down", 0),
        ("rope_dim", 3),
        ("rope_dim", -2),
        ("use_vlens", 1),
    ],
)
def test_invalid_fields_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"KVMConfig\.{field}: must"):
        KVMConfig(**{field: value})  # type: ignore[arg-type]


def test_rope_dim_must_leave_a_state_channel() -> None:
    with pytest.raises(ValueError, match=r"rope_dim: 64 >= key head dim 64.*use rope_dim < 64"):
        KVMConfig.paper_fixed().check_head_dim(64)
    KVMConfig.paper_fixed().check_head_dim(128)
