"""KVM-Fold and SnapKV: bounded caches for frozen models, on tiny random Llama and Qwen2."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import TINY_HF, tiny_hf
from longkv.attention.rope import angles_at, rotate
from longkv.caches.bounded import STREAM_CHUNK, bounded_fold, bounded_generate
from longkv.caches.eviction import SnapKVConfig, SnapKVRunner, keep_best, pooled
from longkv.caches.kvm_fold import KVMFoldConfig, KVMFoldRunner
from longkv.caches.kvm_state import DROPPED, FoldState, empty_state, read_slots, update_state
from longkv.caches.methods import run_bounded
from longkv.caches.naive import update_state_naive
from longkv.checks import SettingError
from longkv.fold import kv_fold
from longkv.fold.attention import AttentionHooks, bounded_attention, hooked

V, T = TINY_HF["vocab_size"], 100


def ids_of(T: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


# the state update ----------------------------------------------------------------------------


def random_state(B: int, H: int, S: int, D: int, seed: int) -> FoldState:
    """A float64 state of S slots built by appending random tokens (counts 1)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, D + 1, generator=g, dtype=torch.float64)
    state, _ = update_state(empty_state(k, v), k, v, 0, S, k[:, :, :0])
    return state


@pytest.mark.parametrize("target", [3, 6, 8, 11])  # merge all, some appended, all appended
@pytest.mark.parametrize("threshold", [None, 0.2])
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("cap", [None, 1.0, 1.5])
def test_state_update_equals_the_per_token_reference(
    target: int, threshold: float | None, sinks: int, cap: float | None
) -> None:
    B, H, D, m = 2, 3, 6, 5
    g = torch.Generator().manual_seed(target + 7 * sinks)
    state = random_state(B, H, 3, D, seed=4)
    # one merge-only update first, so slots hold several tokens
    k0 = torch.randn(B, H, m, D, generator=g, dtype=torch.float64)
    v0 = torch.randn(B, H, m, D + 1, generator=g, dtype=torch.float64)
    sink_keys = torch.randn(B, H, sinks, D, generator=g, dtype=torch.float64)
    state, _ = update_state(state, k0, v0, 3, 3, sink_keys)
    k = torch.randn(B, H, m, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, m, D + 1, generator=g, dtype=torch.float64)
    fast, fast_dest = update_state(state, k, v, 8, target, sink_keys, threshold, cap=cap)
    slow, slow_dest = update_state_naive(state, k, v, 8, target, sink_keys, threshold, cap)
    assert torch.equal(fast_dest, slow_dest)
    assert torch.equal(fast.founder, slow.founder)
    for name in ("key_sum", "value_sum", "count", "key_norm", "value_norm"):
        torch.testing.assert_close(getattr(fast, name), getattr(slow, name), rtol=0, atol=1e-10)
    assert fast.num_slots == max(3, min(target, 3 + m))
    if threshold is not None:  # some merges dropped, counts say how many joined
        dropped = (fast_dest == DROPPED).sum().item()
        assert fast.count.sum().item() == state.count.sum().item() + B * H * m - dropped
    if cap is not None:  # no token joins a slot above the bound
        closed = state.count > cap * state.count.mean(dim=-1, keepdim=True)
        assert closed.any() or cap > 1  # 8 tokens in 3 slots: one is above the mean
        joined = (fast_dest.unsqueeze(-1) == torch.arange(3)).any(dim=2)  # (B, H, 3)
        assert not (joined & closed).any()


def test_a_first_block_with_nothing_to_compare_founds_its_earliest_tokens() -> None:
    """No sinks and no slots yet, room for 2 of 5: every token is equally novel, so the first
    two found slots and the other three merge into them (the reference agrees)."""
    g = torch.Generator().manual_seed(9)
    k = torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64)
    fast, dest = update_state(empty_state(k, v), k, v, 10, 2, k[:, :, :0])
    slow, slow_dest = update_state_naive(empty_state(k, v), k, v, 10, 2, k[:, :, :0])
    assert torch.equal(dest, slow_dest) and (dest[..., :2] == torch.tensor([0, 1])).all()
    assert fast.founder.tolist() == [[[10, 11]] * 2] * 2
    assert fast.count.sum().item() == 2 * 2 * 5
    torch.testing.assert_close(fast.key_sum, slow.key_sum, rtol=0, atol=1e-10)


def test_the_most_novel_tokens_found_slots_and_the_rest_merge() -> None:
    """A hand-built block: two tokens along existing slots merge into them, the two along new
    directions become slots."""
    e = torch.eye(4, dtype=torch.float64)
    state, _ = update_state(
        empty_state(e[None, None, :1], e[None, None, :1]),
        e[None, None, :2] * 2, e[None, None, :2], 0, 2, e[None, None, :0],
    )  # fmt: skip
    keys = torch.stack([e[0] + 0.1 * e[1], e[2], e[1], e[3] * 3])[None, None]
    values = torch.arange(16.0, dtype=torch.float64).view(1, 1, 4, 4)
    new, dest = update_state(state, keys, values, 2, 4, e[None, None, :0])
    assert dest.tolist() == [[[0, 2, 1, 3]]]
    assert new.founder.tolist() == [[[0, 1, 3, 5]]]
    assert new.count.tolist() == [[[2.0, 2.0, 1.0, 1.0]]]
    keys_read, values_read = read_slots(new, "founder")
    torch.testing.assert_close(keys_read[0, 0, 3], 3 * e[3], rtol=0, atol=1e-15)
    torch.testing.assert_close(values_read[0, 0, 2], values[0, 0, 1], rtol=0, atol=1e-15)
    # founder read-out keeps the founder's norm; mean read-out averages
    torch.testing.assert_close(keys_read[0, 0, 0].norm(), torch.tensor(2.0, dtype=torch.float64))
    mean_k, _ = read_slots(new)
    torch.testing.assert_close(mean_k[0, 0, 0], (2 * e[0] + keys[0, 0, 0]) / 2)


# the bounded caches --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("chunk", [1, 7, 30, 50])
@pytest.mark.parametrize(
    "config",
    [
        KVMFoldConfig(budget=T, window=50),
        KVMFoldConfig(budget=T, state="sqrt", growth_factor=20.0, count_bias=True),
        KVMFoldConfig(budget=2 * T, window=50, readout="mean", merge_threshold=0.5),
        SnapKVConfig(budget=T),
    ],
    ids=["fixed", "sqrt-bias", "mean-threshold", "snapkv"],
)
def test_a_budget_of_the_whole_input_equals_the_exact_fold(
    arch: str, chunk: int, config: KVMFoldConfig | SnapKVConfig
) -> None:
    model, ids = tiny_hf(arch), ids_of()
    exact = kv_fold(model, ids, T, return_logits=True)
    runner = (KVMFoldRunner if isinstance(config, KVMFoldConfig) else SnapKVRunner)(
        model,
        config,  # type: ignore[arg-type]
    )
    run = bounded_fold(runner, ids, chunk, return_logits=True)
    assert run.logits is not None and exact.logits is not None
    assert (run.logits - exact.logits).abs().max().item() <= 1e-5
    assert (run.nll - exact.nll).abs().max().item() <= 1e-5


@pytest.mark.parametrize("chunk", [1, 3, 8, 16])
@pytest.mark.parametrize("state", ["fixed", "sqrt"])
def test_entries_never_exceed_the_budget_and_slots_follow_the_state_budget(
    chunk: int, state: str
) -> None:
    config = KVMFoldConfig(budget=40, sinks=3, window=16, state=state, growth_factor=1.5)
    runner = KVMFoldRunner(tiny_hf("llama"), config)
    ids, slots = ids_of(T), 0
    with torch.inference_mode():
        for t in range(0, T, chunk):
            read = runner.seen  # tokens read before this chunk: the budget's context
            runner.forward(ids[:, t : t + chunk])
            assert all(layer.keys.shape[2] <= 40 for layer in runner.cache.layers)
            left = max(runner.seen - 3 - 16, 0)  # tokens that left the window so far
            if left:
                grown = 21 if state == "fixed" else max(math.floor(1.5 * math.sqrt(read)), 1)
                slots = max(slots, min(grown, left, 21))
            assert runner.middle_count == slots
            assert all(s is None or s.num_slots == slots for s in runner.states)
    assert slots == 21 if state == "fixed" else 0 < slots < 21


def test_a_one_token_slot_is_that_token_rotated_at_its_cache_index() -> None:
    """With merges refused (threshold 1), slots are single tokens: each reads back as the
    token's key rotated at the slot's cache index, not at its input position."""
    model = tiny_hf("llama", torch.float64)
    config = KVMFoldConfig(
        budget=40, sinks=2, window=8, state="sqrt", growth_factor=2.0, merge_threshold=1.0
    )
    runner = KVMFoldRunner(model, config)
    ids = ids_of(60)
    exact = kv_fold(model, ids, 60)
    bounded_fold(runner, ids, 4)
    inv_freq = model.model.rotary_emb.inv_freq.double()
    moved = 0
    # the first layer's keys depend on the token alone (deeper ones on what it attended to)
    layer, state = runner.cache.layers[0], runner.states[0]
    assert all(s is not None and (s.count == 1).all() for s in runner.states)
    assert state is not None
    for b in range(2):
        for h in range(2):
            for slot in range(state.num_slots):
                token = state.founder[b, h, slot].item()
                x = exact.cache.layers[0].keys[b, h, token]  # (D,) rotated at position token
                # channels (j, j + D/2) as one complex number, turned by (2 + slot - token) steps
                half = x.shape[0] // 2
                z = torch.complex(x[:half], x[half:]) * torch.polar(
                    torch.ones_like(inv_freq), (2 + slot - token) * inv_freq
                )
                expected = torch.cat([z.real, z.imag])
                got = layer.keys[b, h, 2 + slot]
                # transformers computes RoPE angles in float32 even for a float64 model, and the two
                # keys were rotated at different positions (the fold's and the bounded cache's)
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
                assert (got - x).abs().max() > 1e-3 or token == 2 + slot
                moved += token != 2 + slot
    assert moved > 0  # some slots sit at a cache index other than their input position


def test_undoing_and_redoing_the_rotation_returns_the_key() -> None:
    runner = KVMFoldRunner(tiny_hf("llama"), KVMFoldConfig(budget=64))
    key = torch.randn(2, 2, 5, 8, dtype=torch.float64)
    positions = torch.tensor([0, 3, 17, 64, 1000])
    there = rotate(key, *angles_at(positions, runner.inv_freqs[0]))
    back = rotate(there, *angles_at(-positions, runner.inv_freqs[0]))
    torch.testing.assert_close(back, key, rtol=0, atol=1e-13)
    assert (there - key).abs().max() > 0.1


def test_the_log_count_bias_weighs_a_slot_like_its_tokens() -> None:
    """bounded_attention with log(n) on a key equals plain attention with that key n times."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 3, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    layer = torch.nn.Module()
    layer.layer_idx = 0
    n = torch.tensor([1.0, 3.0, 1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    bias = n.log().expand(1, 2, 6)
    from longkv.fold import attention

    token = attention._ACTIVE.set(AttentionHooks(bias=[bias], observe=3))
    try:
        out, _ = bounded_attention(layer, q, k, v, None, scaling=0.3)
        weighted = attention._ACTIVE.get().seen[0]  # type: ignore[union-attr]
        attention._ACTIVE.set(AttentionHooks(observe=3))
        rep = n.long()
        # keys 0..2 are before the queries' diagonal block; the queries are the last 3
        k_rep, v_rep = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        plain, _ = bounded_attention(layer, q, k_rep, v_rep, None, scaling=0.3)
        seen = attention._ACTIVE.get().seen[0]  # type: ignore[union-attr]
    finally:
        attention._ACTIVE.reset(token)
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-12)
    # what the observed queries give a slot is what they give its copies together
    ends = rep.cumsum(0)
    grouped = torch.stack([seen[..., e - r : e].sum(-1) for e, r in zip(ends, rep, strict=True)])
    torch.testing.assert_close(weighted, grouped.permute(1, 2, 0).float(), rtol=0, atol=1e-6)


def test_hooked_attention_restores_the_model() -> None:
    model = tiny_hf("llama")
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"), hooked(model, AttentionHooks()):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == before


# SnapKV ----------------------------------------------------------------------------------------


def test_keep_best_keeps_the_highest_scores_in_time_order() -> None:
    scores = torch.tensor([[[0.1, 0.5, 0.3, 0.5, 0.0], [0.9, 0.0, 0.0, 0.2, 0.8]]])
    assert keep_best(scores, 2).tolist() == [[[1, 3], [0, 4]]]
    assert keep_best(scores, 9).tolist() == [[[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]]
    assert pooled(torch.tensor([[[3.0, 0.0, 0.0, 6.0]]]), 3).tolist() == [[[1.5, 1.0, 2.0, 3.0]]]


def test_snapkv_evicts_the_lowest_scored_of_the_leaving_and_kept_entries() -> None:
    model = tiny_hf("llama")
    config = SnapKVConfig(budget=14, sinks=1, window=8, pool=1)
    runner = SnapKVRunner(model, config)
    with torch.inference_mode():
        runner.forward(ids_of(9)[:1, :1])  # the sink
        runner.forward(ids_of(9)[:1, 1:])  # 8 in the window: nothing left yet
    assert runner.middle_count == 0 and runner.window_count == 8
    # hand-set scores of the 8 window entries, then make room for 8 more tokens: the 8 leave
    # the window, and the 5 best scored of them stay
    scores = torch.tensor([0.3, 0.9, 0.1, 0.8, 0.2, 0.7, 0.0, 0.6])
    keys = [k.clone() for k in runner.window_k]
    for i in range(len(runner.scores)):
        runner.scores[i] = scores.expand(1, 2, 8).clone()
    runner.make_room(8)
    for i, kept in enumerate(runner.kept_k):
        assert kept is not None
        torch.testing.assert_close(kept, keys[i][:, :, [0, 1, 3, 5, 7]], rtol=0, atol=0)
    assert runner.window_count == 0


def test_bounded_caches_generate_within_their_budget() -> None:
    model = tiny_hf("qwen2")
    ids = ids_of(80)
    for config, runner_class in (
        (SnapKVConfig(budget=24, window=8), SnapKVRunner),
        (KVMFoldConfig(budget=24, state="sqrt", count_bias=True), KVMFoldRunner),
    ):
        runner = runner_class(model, config)  # type: ignore[arg-type]
        out = bounded_generate(runner, ids, 8, 6)
        assert out.shape == (2, 6)
        assert all(layer.keys.shape[2] <= 24 for layer in runner.cache.layers)
        # decoding fed every answer token but the last through the same bounded cache
        assert runner.seen == 80 + 5 and runner.position == 24
        assert runner.middle_count == config.middle_len


def test_bad_configs_are_refused() -> None:
    with pytest.raises(SettingError, match="leave no entries of the budget"):
        KVMFoldConfig(budget=8, sinks=4, window=4)
    with pytest.raises(SettingError, match="merge_threshold"):
        KVMFoldConfig(merge_threshold=1.5)
    with pytest.raises(SettingError, match="growth_factor"):
        KVMFoldConfig(state="sqrt", growth_factor=0.0)
    with pytest.raises(SettingError, match="pool"):
        SnapKVConfig(pool=4)
    with pytest.raises(ValueError, match="budget of 300 cache positions exceeds"):
        KVMFoldRunner(tiny_hf("llama"), KVMFoldConfig(budget=300))
    with pytest.raises(ValueError, match="chunk_size: 60 exceeds the window 50"):
        run_bounded(tiny_hf("llama"), ids_of(), KVMFoldConfig(budget=100), 60)


def test_without_a_chunk_a_bounded_read_takes_the_default_at_most_the_window() -> None:
    """STREAM_CHUNK tokens a chunk, or the window's where it is smaller (not a refusal)."""
    model, ids = tiny_hf("llama"), ids_of(150)
    small = KVMFoldConfig(budget=40, sinks=2, window=8)
    run = run_bounded(model, ids, small)
    assert len(run.chunk_seconds) == math.ceil(150 / 8)
    assert torch.equal(run.nll, run_bounded(model, ids, small, 8).nll)
    wide = KVMFoldConfig(budget=140, sinks=2, window=100)
    assert len(run_bounded(model, ids, wide).chunk_seconds) == math.ceil(150 / STREAM_CHUNK)


def test_fates_say_which_tokens_founded_slots_and_which_were_dropped() -> None:
    config = KVMFoldConfig(
        budget=40, sinks=2, window=8, state="sqrt", growth_factor=2.0, merge_threshold=1.0
    )
    runner = KVMFoldRunner(tiny_hf("llama"), config, track=True)
    bounded_fold(runner, ids_of(60), 4)
    assert runner.fates(0, 2)["exact"] == 1.0  # the sinks
    assert runner.fates(52, 60)["exact"] == 1.0  # the window
    fate = runner.fates(2, 52)
    states = [s for s in runner.states if s is not None]
    founders = sum(int(s.founder.numel()) for s in states)
    joined = sum(int(s.count.sum()) for s in states) - founders  # only a key equal to the
    # slot's (the same token id, in the first layer) reaches the threshold of 1
    total = 2 * 2 * 2 * 50  # layers x rows x heads x tokens
    assert fate["founded"] == founders / total and fate["merged"] == joined / total
    assert fate["exact"] == 0 and fate["dropped"] == pytest.approx(1 - (founders + joined) / total)
    assert fate["dropped"] > 0.5
    with pytest.raises(ValueError, match="track=True"):
        KVMFoldRunner(tiny_hf("llama"), config).fates(0, 1)
