"""The fused attention over key sets, the growable row buffers behind every cache, and decoding
with donated KVM states: equal results, no copies where none are needed."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, assert_same_state, make_inputs
from longkv.attention.core import KeySet, _attend_concatenated, attend_key_sets, attend_key_sets_lse
from longkv.attention.state import Rows
from longkv.kvm import KVMConfig, KVMDecoder, decode_attend, kvm_attention


def key_sets(G: int, Lq: int, Dk: int, Dv: int, seed: int = 0) -> list[KeySet]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return [
        KeySet(randn(2, 3, G, Lq, Dk), randn(2, 3, 7, Dk), randn(2, 3, 7, Dv)),
        KeySet(randn(2, 3, G, Lq, Dk), randn(2, 3, 5 + Lq, Dk), randn(2, 3, 5 + Lq, Dv), True),
    ]


@pytest.mark.parametrize(("G", "Lq", "Dk", "Dv"), [(1, 6, 8, 8), (2, 5, 8, 6), (3, 1, 4, 9)])
def test_fused_key_sets_equal_one_concatenated_softmax(G: int, Lq: int, Dk: int, Dv: int) -> None:
    sets = key_sets(G, Lq, Dk, Dv)
    with torch.no_grad():
        fused, fused_lse = attend_key_sets_lse(sets)
    # the same logits written out: one softmax over both sets, the future keys at -inf
    logits = [s.q @ s.k.unsqueeze(2).transpose(-1, -2) for s in sets]
    future = torch.ones(Lq, Lq, dtype=torch.bool).triu(1)
    logits[1][..., -Lq:] = logits[1][..., -Lq:].masked_fill(future, float("-inf"))
    every = torch.cat(logits, dim=-1)  # (2, 3, G, Lq, Lk)
    probs = torch.softmax(every, dim=-1)
    values = torch.cat([s.v for s in sets], dim=2).unsqueeze(2)
    lse = every.logsumexp(-1).reshape(2, 3, G * Lq)
    concatenated, concatenated_lse = _attend_concatenated(sets)
    for out, at in ((fused, fused_lse), (concatenated, concatenated_lse)):
        assert_close(out, probs @ values)
        assert_close(at, lse)


def test_key_sets_keep_gradients() -> None:
    sets = key_sets(2, 4, 8, 8)
    q = sets[0].q.requires_grad_()
    attend_key_sets(sets).sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def rows(n: int, width: int = 3) -> torch.Tensor:
    return torch.arange(2 * n * width, dtype=torch.float64).view(1, 2, n, width)


def test_rows_append_in_place_while_newest_and_copy_for_a_branch() -> None:
    base = Rows.of(rows(4))
    grown = base.append(rows(1))  # a caller's tensor is never written: a new store
    assert grown.store is not base.store and grown.store.capacity == 10
    again = grown.append(rows(2))
    assert again.store is grown.store  # newest rows, room left: in place
    assert_close(grown.tensor, torch.cat([rows(4), rows(1)], dim=2), 0.0)  # unchanged
    branch = grown.append(-rows(1))  # grown is no longer the newest: copy, again unchanged
    assert branch.store is not grown.store
    assert_close(again.tensor, torch.cat([rows(4), rows(1), rows(2)], dim=2), 0.0)
    assert_close(branch.tensor, torch.cat([rows(4), rows(1), -rows(1)], dim=2), 0.0)


def test_donated_rows_move_within_their_store_and_dropped_rows_are_freed() -> None:
    r = Rows.of(rows(2)).append(rows(2))  # store of 8 rows, 4 used
    r = r.drop_front(2).append(rows(2))  # rows 2..6
    ptr = r.store.data.data_ptr()
    moved = r.drop_front(2).append(rows(3), own=True)  # 2 rows at 4..6 move to the front
    assert moved.store.data.data_ptr() == ptr and (moved.lo, moved.hi) == (0, 5)
    assert_close(moved.tensor, torch.cat([rows(2), rows(3)], dim=2), 0.0)
    long = Rows.of(rows(40)).drop_front(38)  # under a quarter of its store: copied out
    assert long.store.capacity == 4 and len(long) == 2


def test_rows_add_at_sums_repeated_rows_and_changes_the_given_rows_only_when_owned() -> None:
    r = Rows.of(rows(2)).append(rows(1))
    before = r.tensor.clone()
    index = torch.tensor([[[0, 2, 0], [1, 1, 1]]])
    src = torch.ones(1, 2, 3, 3, dtype=torch.float64)
    added = r.add_at(index, src)
    expect = before.clone()
    expect[0, 0, 0] += 2
    expect[0, 0, 2] += 1
    expect[0, 1, 1] += 3
    assert_close(added.tensor, expect, 0.0)
    assert_close(r.tensor, before, 0.0)
    owned = r.add_at(index, src, own=True)
    assert owned.store is r.store
    assert_close(r.tensor, expect, 0.0)


def test_rows_made_in_inference_mode_are_copied_not_written_outside_it() -> None:
    with torch.inference_mode():
        r = Rows.of(rows(2)).append(rows(1))  # a store with room, of inference tensors
    grown = r.append(rows(1), own=True)
    added = r.add_at(torch.zeros(1, 2, 1, dtype=torch.long), torch.ones_like(rows(1)), own=True)
    assert grown.store is not r.store and added.store is not r.store
    assert_close(grown.tensor, torch.cat([rows(2), rows(1), rows(1)], dim=2), 0.0)
    expect = torch.cat([rows(2), rows(1)], dim=2)
    expect[:, :, 0] += 1
    assert_close(added.tensor, expect, 0.0)


CONFIG = KVMConfig(chunk_len=4, window_chunks=2, sink_len=1, state_min_len=6, max_state_chunks=2)


def test_a_donated_decode_equals_one_call_and_reuses_its_buffers() -> None:
    inp = make_inputs(T=60, Dk=8, Dv=8)
    whole, whole_state = kvm_attention(inp.q, inp.k, inp.v, CONFIG, **inp.extras)
    q, k, v, extras = inp.span(0, 13)
    with torch.no_grad():
        out, state = kvm_attention(q, k, v, CONFIG, **extras)
        outs, pointers = [out], set()
        for t in range(13, 60):
            q, k, v, extras = inp.span(t, t + 1)
            out, state = kvm_attention(q, k, v, CONFIG, state=state, donate=True, **extras)
            outs.append(out)
            if t >= 30:  # the buffers have grown to their size by then
                pointers.add((state.window.rows_k.store.data.data_ptr(),
                              state.slots.store.data.data_ptr()))  # fmt: skip
    assert_close(torch.cat(outs, dim=2), whole)
    assert_same_state(state, whole_state)
    assert len(pointers) == 1


def test_the_kept_read_out_follows_the_norm_parameters() -> None:
    inp = make_inputs(T=20, Dk=8, Dv=8)
    _, state = kvm_attention(inp.q, inp.k, inp.v, CONFIG, **inp.extras)
    assert state.read is not None
    weight = inp.extras["norm_weight"]
    assert state.read.matches(weight, inp.extras["norm_bias"])
    assert not state.read.matches(weight.clone(), inp.extras["norm_bias"])
    with torch.no_grad():
        weight.mul_(2.0)  # an optimizer step changes the parameter in place
    assert not state.read.matches(weight, inp.extras["norm_bias"])


@pytest.mark.parametrize("budget", ["fixed", "sqrt"])
def test_the_fixed_shape_decoder_continues_a_state_as_kvm_attention_does(budget: str) -> None:
    config = CONFIG if budget == "fixed" else KVMConfig(
        chunk_len=4, window_chunks=2, sink_len=1, budget="power_law", state_min_len=4,
        growth_factor=3.0, max_state_chunks=None,
    )  # fmt: skip
    inp = make_inputs(T=50)  # Dk 8, Dv 6, two query heads per key head, gates and temperatures
    whole, whole_state = kvm_attention(inp.q, inp.k, inp.v, config, **inp.extras)
    q, k, v, extras = inp.span(0, 2)  # from inside the first chunk
    _, state = kvm_attention(q, k, v, config, **extras)
    decoder = KVMDecoder(state)
    with torch.no_grad():
        outs = [
            decoder.step(*inp.span(t, t + 1)[:3], **inp.span(t, t + 1)[3]) for t in range(2, 50)
        ]
    assert_close(torch.cat(outs, dim=2), whole[:, :, 2:])
    assert_same_state(decoder.to_state(), whole_state)


def test_a_compiled_decode_step_equals_the_eager_one() -> None:
    inp = make_inputs(T=40)
    _, state = kvm_attention(*inp.span(0, 21)[:3], CONFIG, **inp.span(0, 21)[3])
    eager, compiled = KVMDecoder(state), KVMDecoder(state, attend=torch.compile(decode_attend))
    with torch.no_grad():
        for t in range(21, 40):
            q, k, v, extras = inp.span(t, t + 1)
            assert_close(compiled.step(q, k, v, **extras), eager.step(q, k, v, **extras))


def test_the_decoder_refuses_what_kvm_attention_refuses() -> None:
    inp = make_inputs(T=12)
    _, state = kvm_attention(*inp.span(0, 10)[:3], CONFIG, **inp.span(0, 10)[3])
    decoder = KVMDecoder(state)
    q, k, v, extras = inp.span(10, 12)
    with pytest.raises(ValueError, match=r"KVMDecoder\.step takes one token, got 2"):
        decoder.step(q, k, v, **extras)
    q, k, v, extras = inp.span(10, 11)
    with pytest.raises(ValueError, match="gate: merge gates must be > 0"):
        decoder.step(q, k, v, **{**extras, "gate": -extras["gate"]})
    with pytest.raises(ValueError, match=r"window_temp: expected shape \(4,\)"):
        decoder.step(q, k, v, **{**extras, "window_temp": extras["window_temp"][:2]})
