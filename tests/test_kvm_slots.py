"""The slot arithmetic that the KVM layer and KVM-Fold share, on hand-built blocks."""

from __future__ import annotations

import torch

from longkv.kvm.slots import read_founder, read_mean, route, take


def block(*rows: list[float]) -> torch.Tensor:
    """(1, 1, len(rows), D) in float64."""
    return torch.tensor(rows, dtype=torch.float64)[None, None]


def test_a_block_founds_its_least_novel_tokens_and_merges_the_rest_winner_take_all() -> None:
    """Slots: a sink along x, then y and z. Novelty, the highest similarity to any of them, is
    1, 1, 0, -1, 0: the least novel token and -y (before -z among equals) found slots 3 and 4
    in time order, and -y stays the founder of slot 3 though more similar to slot 4. The token
    along x is most similar to the sink, which takes no merges: it goes to y, the first of its
    equally similar non-sink slots, and stays there although slot 3 is as similar; -z is more
    similar to slot 4 than to any older slot and joins it."""
    known = block([1, 0, 0], [0, 1, 0], [0, 0, 1])
    tokens = block([1, 0, 0], [0, 1, 0], [0, -1, 0], [-1, -3, -3], [0, 0, -1])
    to = route(tokens, known, 1, 2, lambda picked: take(tokens, picked))
    assert to.picked.tolist() == [[[2, 3]]]
    assert to.dest.tolist() == [[[1, 1, 3, 4, 4]]]
    assert to.merges.tolist() == [[[True, True, False, False, True]]]
    assert [to.best[0, 0, j].item() for j in (0, 1, 4)] == [0.0, 1.0, 3.0]


def test_a_first_block_with_nothing_to_compare_founds_its_earliest_tokens() -> None:
    tokens = block([1, 0], [0, 1], [1, 1])
    to = route(tokens, tokens[:, :, :0], 0, 2, lambda picked: take(tokens, picked))
    assert to.picked.tolist() == [[[0, 1]]]
    assert to.dest.tolist() == [[[0, 1, 0]]]  # equally similar to both: the first


def test_slots_read_out_as_their_mean_or_their_direction_at_the_founders_norm() -> None:
    sums = block([3, 4], [0, -2])  # two slots
    count, norm = block([2, 10], [1, 1]).unbind(-1)  # (1, 1, 2) each
    assert read_mean(sums, count).tolist() == [[[[1.5, 2.0], [0.0, -2.0]]]]
    assert read_founder(sums, norm).tolist() == [[[[6.0, 8.0], [0.0, -1.0]]]]


def test_a_tracked_state_keeps_the_position_that_founded_each_slot() -> None:
    """With the value-norm read-out a slot's r is its founder's value norm (gate 1), and merges
    leave it: so the founder positions the state keeps must point at tokens of exactly that
    norm. They do in one call, token by token and across a beam reorder; untracked states
    keep none."""
    from conftest import make_inputs
    from longkv.kvm import KVMConfig, kvm_attention

    config = KVMConfig(
        chunk_len=4, window_chunks=2, budget="power_law", state_min_len=4, growth_factor=2.0,
        max_state_chunks=None,
    )  # fmt: skip
    inp = make_inputs(T=70, gate=False)
    _, whole = kvm_attention(inp.q, inp.k, inp.v, config, track_founders=True, **inp.extras)
    assert whole.founders is not None and 4 < whole.num_slots < 70 - 8  # merges happened
    at = whole.founders.tensor[..., 0]  # (B, Hkv, S)
    founders_norm = inp.v.norm(dim=-1).gather(2, at)
    assert torch.allclose(whole.slot_r, founders_norm, rtol=0, atol=1e-12)
    assert all(len(set(row.tolist())) == len(row) for row in at.flatten(0, 1))  # distinct
    state = None
    for t in range(70):
        q, k, v, extras = inp.span(t, t + 1)
        _, state = kvm_attention(q, k, v, config, state=state, track_founders=True, **extras)
    assert state is not None and state.founders is not None
    assert torch.equal(state.founders.tensor, whole.founders.tensor)
    flipped = whole.select_rows(torch.tensor([1, 0]))
    assert flipped.founders is not None and torch.equal(
        flipped.founders.tensor[0], at[1, ..., None]
    )
    assert kvm_attention(inp.q, inp.k, inp.v, config, **inp.extras)[1].founders is None
