"""Retrieval attention over units of exact tokens (`longkv.caches.routed`): per-token and
per-block routing and the fused attention against the per-query reference in float64, its two
ends (every unit opened: the exact softmax; none: the read-outs with the count bias), and the
block's opened units against the per-row reference."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from conftest import TOL
from longkv.caches.leaves import Gathered, make_leaves
from longkv.caches.naive import (
    block_units_naive,
    routed_attention_naive,
    row_units_naive,
    top_units_naive,
)
from longkv.caches.routed import (
    Part,
    attended_entries,
    block_units,
    grouped,
    query_units,
    routed_attention,
    row_units,
    top_units,
)

B, H, HKV, T, D, DV = 2, 4, 2, 3, 6, 5
G = H // HKV
SINKS, UNITS, LEAVES, WINDOW = 2, 5, 14, 4
SCALE = D**-0.5
Entries = dict[str, tuple[Tensor, Tensor]]


def case(seed: int) -> tuple[Tensor, Entries, Tensor, Tensor]:
    """Random queries and entries in float64; every unit owns at least one leaf, and its count
    is the number of leaves it owns (as a state's slots count their tokens)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q = rand(B, H, T, D)
    sizes = {"sinks": SINKS, "slots": UNITS, "leaves": LEAVES, "window": WINDOW, "chunk": T}
    entries = {name: (rand(B, HKV, n, D), rand(B, HKV, n, DV)) for name, n in sizes.items()}
    owner = torch.randint(0, UNITS, (B, HKV, LEAVES), generator=g)
    owner[..., :UNITS] = torch.arange(UNITS)  # no unit without a leaf
    count = torch.zeros(B, HKV, UNITS, dtype=torch.float64).scatter_add(
        -1, owner, torch.ones(B, HKV, LEAVES, dtype=torch.float64)
    )
    return q, entries, count, owner


def rank_of(q: Tensor, entries: Entries, count: Tensor) -> Tensor:
    """(B, Hkv, G * T, U): each row's score of the units, logit + log count."""
    slot_k = entries["slots"][0]
    return SCALE * (grouped(q, HKV) @ slot_k.transpose(-1, -2)) + count.log().unsqueeze(2)


def fast(
    q: Tensor, entries: Entries, count: Tensor | None, owner: Tensor, opened: Tensor,
    q_mem: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """routed_attention over the bounded part (sinks, read-outs, window), the chunk and the
    leaves of the opened units, gathered from a leaf store."""
    sinks, window, chunk = (Part(*entries[n]) for n in ("sinks", "window", "chunk"))
    readouts = None if count is None else Part(*entries["slots"])
    leaf_k, leaf_v = entries["leaves"]
    store = make_leaves("exact", leaf_k, leaf_v)
    store.append(leaf_k, leaf_v, owner)
    got = store.gather(opened.any(2), torch.float64)
    return routed_attention(q, sinks, readouts, window, chunk, count, opened, got, SCALE, q_mem)


def per_head(opened: Tensor) -> Tensor:
    """(B, Hkv, R, U) as (B, H, T, U): each query head's and query's opened units."""
    if opened.shape[2] == 1:
        return opened.repeat_interleave(G, dim=1).expand(B, H, T, -1)
    return opened.reshape(B, H, T, -1)


@pytest.mark.parametrize("k", [0, 1, 2, UNITS, UNITS + 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_rows_own_units_attend_as_the_per_query_reference(k: int, seed: int) -> None:
    q, entries, count, owner = case(seed)
    opened = top_units(rank_of(q, entries, count), k)
    assert opened.shape == (B, HKV, G * T, UNITS)
    want = routed_attention_naive(q, entries, count, owner, per_head(opened), SCALE)
    torch.testing.assert_close(fast(q, entries, count, owner, opened), want, rtol=0, atol=TOL)


@pytest.mark.parametrize("budget", [None, 1, 6, 9])
@pytest.mark.parametrize("seed", [2, 3])
def test_a_blocks_shared_units_attend_as_the_per_query_reference(
    budget: int | None, seed: int
) -> None:
    q, entries, count, owner = case(seed)
    opened = block_units(rank_of(q, entries, count), count, budget)
    assert opened.shape == (B, HKV, 1, UNITS)
    want = routed_attention_naive(q, entries, count, owner, per_head(opened), SCALE)
    torch.testing.assert_close(fast(q, entries, count, owner, opened), want, rtol=0, atol=TOL)


@pytest.mark.parametrize("k", [1, 3])
def test_without_read_outs_a_query_sees_only_its_units_leaves(k: int) -> None:
    q, entries, count, owner = case(4)
    opened = top_units(rank_of(q, entries, count), k)
    want = routed_attention_naive(q, entries, None, owner, per_head(opened), SCALE)
    torch.testing.assert_close(fast(q, entries, None, owner, opened), want, rtol=0, atol=TOL)


@pytest.mark.parametrize("readouts", [True, False])
@pytest.mark.parametrize("k", [0, 2, UNITS])
def test_a_decoded_token_attends_as_the_per_query_reference(readouts: bool, k: int) -> None:
    """A chunk of one query (decoding) sees its own token within the one key set."""
    q, entries, count, owner = case(7)
    q = q[:, :, -1:]  # (B, H, 1, D)
    entries["chunk"] = (entries["chunk"][0][:, :, -1:], entries["chunk"][1][:, :, -1:])
    opened = top_units(SCALE * (grouped(q, HKV) @ entries["slots"][0].transpose(-1, -2)), k)
    kept = count if readouts else None
    want = routed_attention_naive(q, entries, kept, owner, opened.reshape(B, H, 1, -1), SCALE)
    torch.testing.assert_close(fast(q, entries, kept, owner, opened), want, rtol=0, atol=TOL)


@pytest.mark.parametrize("readouts", [True, False])
@pytest.mark.parametrize(("routing", "k"), [("token", 0), ("token", 2), ("block", 3), ("block", 6)])
@pytest.mark.parametrize("L", [T, 1])
def test_memory_queries_meet_the_read_outs_and_leaves_as_the_per_query_reference(
    readouts: bool, routing: str, k: int, L: int
) -> None:
    """Where the read-outs and leaves are placed apart (positions inside), their own queries
    meet them; with no sinks and no read-outs, a KV head that opens no unit sees no memory at
    all (block routing within 3 leaves: the fused kernel's row that sees no key of a set)."""
    q, entries, count, owner = case(8)
    q_mem = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=q.dtype)
    if L == 1:  # a decoded token
        q, q_mem = q[:, :, -1:], q_mem[:, :, -1:]
        entries["chunk"] = (entries["chunk"][0][:, :, -1:], entries["chunk"][1][:, :, -1:])
    if not readouts:
        entries["sinks"] = (entries["sinks"][0][:, :, :0], entries["sinks"][1][:, :, :0])
    rank = rank_of(q_mem, entries, count)
    opened = top_units(rank, k) if routing == "token" else block_units(rank, count, k)
    if routing == "block" and k == 3:  # every KV head fits a unit in 3 leaves: all but one none
        opened = opened & torch.tensor([[False, False], [True, False]]).view(B, HKV, 1, 1)
    heads = opened.repeat_interleave(G, 1).expand(B, H, L, -1) if opened.shape[2] == 1 else (
        opened.reshape(B, H, L, -1)
    )  # fmt: skip
    kept = count if readouts else None
    want = routed_attention_naive(q, entries, kept, owner, heads, SCALE, q_mem)
    got = fast(q, entries, kept, owner, opened, q_mem)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    if routing == "block" and k == 3:  # some KV heads opened a unit, some none
        assert opened.any(-1).flatten().tolist() == [False, False, True, False]


def softmax_over(
    q: Tensor, parts: list[tuple[Tensor, Tensor]], bias: Tensor | None = None
) -> Tensor:
    """Plain causal softmax attention of q over the concatenated parts (keys, values (B, Hkv,
    n, *)), the last T keys the queries' own; bias (B, Hkv, n) added per key."""
    keys = torch.cat([k for k, _ in parts], dim=2).repeat_interleave(G, dim=1)
    values = torch.cat([v for _, v in parts], dim=2).repeat_interleave(G, dim=1)
    logits = SCALE * (q @ keys.transpose(-1, -2))
    if bias is not None:
        logits = logits + bias.repeat_interleave(G, dim=1).unsqueeze(2)
    n = keys.shape[2]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    logits[..., n - T :] = logits[..., n - T :].masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1) @ values


def test_opening_every_unit_is_softmax_over_sinks_leaves_and_window() -> None:
    q, entries, count, owner = case(5)
    exact = softmax_over(q, [entries[n] for n in ("sinks", "leaves", "window", "chunk")])
    every = torch.ones(B, HKV, 1, UNITS, dtype=torch.bool)
    torch.testing.assert_close(fast(q, entries, count, owner, every), exact, rtol=0, atol=TOL)


def test_opening_no_unit_is_the_read_outs_with_the_count_bias() -> None:
    q, entries, count, owner = case(6)
    parts = [entries[n] for n in ("sinks", "slots", "window", "chunk")]
    zeros = count.new_zeros
    bias = torch.cat([zeros(B, HKV, SINKS), count.log(), zeros(B, HKV, WINDOW + T)], dim=-1)
    coarse = softmax_over(q, parts, bias)
    none = torch.zeros(B, HKV, G * T, UNITS, dtype=torch.bool)
    torch.testing.assert_close(fast(q, entries, count, owner, none), coarse, rtol=0, atol=TOL)


def test_block_routing_equals_token_routing_where_every_row_opens_the_same_units() -> None:
    """Every row ranks the units alike (queries of one direction against read-outs whose
    logits are ordered the same for all of them) and every unit holds 2 leaves: a block within
    4 leaves opens exactly each row's own 2 best."""
    q, entries, _, _ = case(7)
    q = (q[..., :1].abs() + 1.0).expand(B, H, T, D).contiguous()  # along (1, ..., 1) ...
    slot_k = torch.arange(UNITS, dtype=torch.float64).view(1, 1, UNITS, 1).expand(B, HKV, UNITS, D)
    entries["slots"] = (3 * slot_k.contiguous(), entries["slots"][1])  # ... ranking them alike
    leaf_k, leaf_v = entries["leaves"]
    entries["leaves"] = (leaf_k[:, :, : 2 * UNITS], leaf_v[:, :, : 2 * UNITS])
    owner = (torch.arange(2 * UNITS) % UNITS).expand(B, HKV, -1)
    count = torch.full((B, HKV, UNITS), 2.0, dtype=torch.float64)
    rank = rank_of(q, entries, count)
    token = top_units(rank, 2)
    block = block_units(rank, count, 4)
    assert torch.equal(token, block.expand_as(token))
    got = fast(q, entries, count, owner, block)
    torch.testing.assert_close(got, fast(q, entries, count, owner, token), rtol=0, atol=TOL)
    want = routed_attention_naive(q, entries, count, owner, per_head(token), SCALE)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_each_row_opens_its_top_units_the_earlier_on_ties() -> None:
    rank = torch.tensor([[2.0, 0.0, 0.0, 1.5], [0.0, 1.0, 1.0, 0.5]])
    assert top_units(rank, 2).tolist() == [[True, False, False, True], [False, True, True, False]]
    assert top_units(rank, 1)[1].tolist() == [False, True, False, False]  # 1 and 2 tie: the earlier
    assert top_units(rank, 9).all() and not top_units(rank, 0).any()
    for row in rank:
        for k in range(5):
            assert top_units(row, k).nonzero().flatten().tolist() == sorted(top_units_naive(row, k))


@pytest.mark.parametrize("budget", [None, 0, 3, 7, 100])
def test_a_block_opens_the_units_of_largest_share_within_the_leaf_budget(
    budget: int | None,
) -> None:
    g = torch.Generator().manual_seed(8)
    rank = torch.randn(B, HKV, 6, 9, generator=g, dtype=torch.float64)
    rank[0, 0, :, 3] = rank[0, 0, :, 5]  # equal shares: the earlier unit first
    count = torch.randint(1, 5, (B, HKV, 9), generator=g).double()
    got = block_units(rank, count, budget)
    assert torch.equal(got, block_units_naive(rank, count, budget))
    if budget is None:
        assert got.all()
    else:
        assert ((got[:, :, 0] * count).sum(-1) <= budget).all()
        opened, every = int(got.sum()), got.numel()
        if budget == 0:
            assert opened == 0
        elif budget == 100:  # every unit: at most 9 x 4 leaves per KV head
            assert opened == every
        else:
            assert 0 < opened < every


def test_a_unit_that_does_not_fit_is_skipped_and_the_next_ones_still_open() -> None:
    """A giant unit ranked first does not close the set (block and per row): the units after it
    that fit what is left open, and a budget it alone fits takes it first."""
    rank = torch.tensor([[[[5.0, 4.0, 3.0, 2.0, 1.0]]]], dtype=torch.float64)  # (1, 1, 1, 5)
    count = torch.tensor([[[2.0, 9.0, 3.0, 4.0, 1.0]]], dtype=torch.float64)
    assert block_units(rank, count, 6).flatten().tolist() == [True, False, True, False, True]
    assert row_units(rank, count, 5, 6).flatten().tolist() == [True, False, True, False, True]
    assert row_units(rank, count, 2, 6).flatten().tolist() == [True, False, True, False, False]
    assert block_units(rank, count, 11).flatten().tolist() == [True, True, False, False, False]
    assert not block_units(rank, count, 0).any()


@pytest.mark.parametrize("budget", [None, 0, 3, 7, 100])
@pytest.mark.parametrize("k", [1, 3, 9])
def test_each_row_opens_its_best_units_within_the_leaf_budget(budget: int | None, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    rank = torch.randn(B, HKV, 6, 9, generator=g, dtype=torch.float64)
    rank[0, 0, 2, 4] = rank[0, 0, 2, 7]  # a tie: the earlier unit first
    count = torch.randint(1, 5, (B, HKV, 9), generator=g).double()
    got = row_units(rank, count, k, budget)
    assert torch.equal(got, row_units_naive(rank, count, k, budget))
    assert (got.sum(-1) <= k).all()
    if budget is None:
        assert torch.equal(got, top_units(rank, k))
    else:
        assert ((got * count.unsqueeze(2)).sum(-1) <= budget).all()


@pytest.mark.parametrize("shared", [True, False])
def test_the_attended_entries_are_the_finite_entries_each_query_sees(shared: bool) -> None:
    q, entries, count, owner = case(9)
    rank = rank_of(q, entries, count)
    opened = block_units(rank, count, 6) if shared else top_units(rank, 2)
    got = attended_entries(opened, count, SINKS, WINDOW, T, readouts=True)
    want = torch.zeros(B, H, T, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                units = per_head(opened)[b, h, t]
                leaves = int(units[owner[b, h // G]].sum())
                want[b, h, t] = SINKS + int((~units).sum()) + leaves + WINDOW + t + 1
    if shared:
        assert got.shape == (B, HKV, 1, T)
        want = want[:, ::G]
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=0, atol=0)


def test_a_gather_pads_a_kv_head_with_fewer_leaves_and_the_padding_is_never_attended() -> None:
    q, entries, count, owner = case(10)
    opened = torch.zeros(B, HKV, 1, UNITS, dtype=torch.bool)
    opened[0, 0, 0, :3] = True  # KV head 0 of row 0 opens three units, every other one
    opened[:, :, 0, 4] = True
    got = fast(q, entries, count, owner, opened)
    want = routed_attention_naive(q, entries, count, owner, per_head(opened), SCALE)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    leaf_k, leaf_v = entries["leaves"]
    store = make_leaves("exact", leaf_k, leaf_v)
    store.append(leaf_k, leaf_v, owner)
    gathered: Gathered = store.gather(opened.any(2), torch.float64)
    assert gathered.valid is not None and not bool(gathered.valid.all())


def test_query_units_is_each_heads_last_row_and_keeps_no_other() -> None:
    """Kept per layer between forwards: a view would keep every query's row alive (the score
    matrix of a chunk, growing with the units)."""
    L, U = 3, 7
    rows = torch.randn(B, HKV, G * L, U, dtype=torch.float64)  # heads first
    last = query_units(rows, G, L)  # (B, H, U)
    want = torch.stack([rows[:, h // G, (h % G) * L + L - 1] for h in range(H)], dim=1)
    assert torch.equal(last, want)
    assert last.untyped_storage().nbytes() == last.numel() * last.element_size()
    one = torch.randn(B, HKV, 1, U, dtype=torch.float64)  # one row for every head and query
    assert torch.equal(query_units(one, G, L), one.expand(B, HKV, G, U).reshape(B, H, U))
