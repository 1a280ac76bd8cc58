"""Two-level KVM-Fold: a frozen model through the two-level cache. Every slot opened is the exact
fold; a layer's attention is the per-query reference over its own cache and leaves; labels,
slot keys, needle routes and refusals. The routed attention itself: tests/test_routed.py."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from conftest import TOL, tiny_hf
from longkv.caches import (
    KVMFoldConfig,
    KVMFoldRunner,
    bounded_fold,
    bounded_generate,
    run_bounded,
)
from longkv.caches.bounded import BoundedConfig
from longkv.caches.eviction import SnapKVConfig, SnapKVRunner
from longkv.caches.infllm import InfLLMConfig, InfLLMRunner
from longkv.caches.methods import BoundedOptions, keeps_positions, make_runner
from longkv.caches.naive import (
    block_units_naive,
    bound_scores_naive,
    reranked_units_naive,
    routed_attention_naive,
    row_units_naive,
    slot_scores_naive,
)
from longkv.caches.quest import QuestConfig, QuestRunner
from longkv.caches.retrieval import RetrievalRunner
from longkv.caches.routed import bound_scores, query_units
from longkv.caches.streaming import StreamingRunner
from longkv.caches.two_level import TwoLevelRunner
from longkv.fold import fold_generate, kv_fold


def ids_of(n: int = 90) -> Tensor:
    return torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("chunk", [1, 7, 16])
@pytest.mark.parametrize("leaves", ["exact", "int8"])
def test_opening_every_slot_is_the_exact_fold(arch: str, chunk: int, leaves: str) -> None:
    """A small bounded part (2 sinks, 8 slots, a window of 16) over 90 tokens: with every slot
    open, the leaves stand for the slots and the logits are the exact fold's (int8 leaves: up
    to their rounding)."""
    model, ids = tiny_hf(arch), ids_of()
    exact = kv_fold(model, ids, ids.shape[1], return_logits=True)
    config = KVMFoldConfig(budget=26, sinks=2, window=16, open=8, leaves=leaves)
    runner = make_runner(model, config)
    assert isinstance(runner, TwoLevelRunner)
    run = bounded_fold(runner, ids, chunk, return_logits=True)
    assert run.logits is not None and exact.logits is not None
    gap = (run.logits - exact.logits).abs().max().item()
    assert gap <= (1e-5 if leaves == "exact" else 0.05), gap
    assert runner.attention_share() == {"mean": 1.0, "max": 1.0}  # what full attention attends
    leaves = runner.leaves[runner.ref]
    assert leaves is not None and len(leaves) == ids.shape[1] - 2 - 16  # all but sinks, window
    # the bounded part: 2 sinks, 8 read-outs, the window of 16, outside the model's cache
    assert [p.keys.shape[2] for p in runner.parts(runner.ref)] == [2, 8, 16]
    assert runner.cache.layers[runner.ref].keys.shape[2] <= chunk
    assert runner.resident_bytes()["leaves_file"] == 0


@pytest.mark.parametrize("routing", ["block", "token"])
def test_opening_fewer_slots_reads_less_and_differs_from_both_ends(routing: str) -> None:
    model, ids = tiny_hf("llama"), ids_of()
    exact = kv_fold(model, ids, ids.shape[1]).nll
    base = dict(budget=26, sinks=2, window=16)
    coarse = run_bounded(model, ids, KVMFoldConfig(**base), 8).nll
    config = KVMFoldConfig(**base, open=2, routing=routing, leaf_budget=10)
    runner = make_runner(model, config)
    two = bounded_fold(runner, ids, 8).nll
    assert not torch.allclose(two, exact) and not torch.allclose(two, coarse)
    share = runner.attention_share()  # some of 8 slots open: a part of what full attention reads
    assert 0.3 < share["mean"] < 1.0 and share["max"] <= 1.0, share
    assert isinstance(make_runner(model, KVMFoldConfig(**base)), KVMFoldRunner)


@pytest.mark.parametrize("store", ["exact", "file"])
@pytest.mark.parametrize("routing", ["block", "token"])
@pytest.mark.parametrize(
    ("score", "variance", "readouts", "rerank"),
    [
        ("mean", 0.0, True, 0), ("mean", 0.7, True, 0), ("box", 0.0, True, 0),
        ("mean", 0.0, False, 0), ("mean", 0.0, True, 30),
    ],
)  # fmt: skip
def test_a_layers_attention_is_the_per_query_reference_over_its_own_cache(
    store: str, routing: str, score: str, variance: float, readouts: bool, rerank: int
) -> None:
    """A layer's attention over the runner's cache and leaves (float64) equals the per-query
    reference opening the slots its routing opens by its slot score, written out from the
    leaves (1e-10): the mean key + log count, with or without the variance term, or the key
    bounds; per query head within the leaf budget (token), or per block; with or without the
    closed slots' read-outs; reranked by the candidates' exact mass."""
    model, ids = tiny_hf("llama", torch.float64), ids_of()
    config = KVMFoldConfig(
        budget=26, sinks=2, window=16, open=3, leaves=store, routing=routing, leaf_budget=10,
        slot_score=score, slot_variance=variance, readouts=readouts, rerank=rerank,
    )  # fmt: skip
    runner = make_runner(model, config)
    assert isinstance(runner, TwoLevelRunner)
    bounded_fold(runner, ids, 8)
    layer = runner.cache.layers[0]  # the last forward's chunk
    keys, values = layer.keys, layer.values
    state, leaves = runner.states[0], runner.leaves[0]
    assert state is not None and leaves is not None
    assert runner.routes()  # the model's cache holds the last chunk alone: 2 of 8 tokens
    S, L = state.num_slots, keys.shape[2]
    assert L == ids.shape[1] % 8
    q = torch.randn(2, 4, L, keys.shape[-1], generator=torch.Generator().manual_seed(1)).double()
    got = runner.attend(0)(q, keys, values, 0.3)
    count = state.count.double()
    sinks, slots, window = runner.parts(0)
    assert sinks.keys.shape[2] == 2 and slots.keys.shape[2] == S
    every = leaves.gather(None, torch.float64)
    if score == "mean":
        rank = slot_scores_naive(q, every.keys, every.owner, S, 0.3, variance)
    else:
        rank = bound_scores_naive(q, every.keys, every.owner, S, 0.3)
    rank = rank.reshape(2, 2, 2 * L, S)  # (B, H, L, S) -> each KV head's rows (B, Hkv, G * L, S)
    torch.testing.assert_close(runner.last_scores[0], query_units(rank, 2, L), rtol=0, atol=TOL)
    block = routing == "block"
    if rerank and not block:  # the candidates opened by their exact mass
        rows = q.reshape(2, 2, 2 * L, -1)
        args = (rows, every.keys, every.owner, rank, count, 0.3, rerank, 10, 3)
        opened = reranked_units_naive(*args)
        assert not torch.equal(opened, row_units_naive(rank, count, 3, 10))  # other slots
    else:  # a prefill chunk's block opens by score, rerank or not; token routing without it
        opened = (
            block_units_naive(rank, count, 10) if block else row_units_naive(rank, count, 3, 10)
        )
    opened = opened.repeat_interleave(2, dim=1) if block else opened.reshape(2, 4, L, S)
    opened = opened.expand(2, 4, L, S)
    entries = {"sinks": sinks, "slots": slots, "window": window, "chunk": (keys, values)}
    entries["leaves"] = (every.keys, every.values)
    want = routed_attention_naive(q, entries, count if readouts else None, every.owner, opened, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_each_config_makes_its_runner_and_only_retrieval_caches_keep_positions() -> None:
    model = tiny_hf("llama")
    cases = [
        (BoundedConfig(budget=24), StreamingRunner, False),
        (SnapKVConfig(budget=24, window=8), SnapKVRunner, False),
        (KVMFoldConfig(budget=24), KVMFoldRunner, False),
        (KVMFoldConfig(budget=24, open=2), TwoLevelRunner, True),
        (QuestConfig(budget=24), QuestRunner, True),
        (InfLLMConfig(budget=24), InfLLMRunner, True),
    ]
    for config, runner, keeps in cases:
        made = make_runner(model, config)
        assert type(made) is runner and keeps_positions(config) is keeps, config
        assert isinstance(made, RetrievalRunner) is keeps


def test_each_opening_and_store_is_a_run_labelled_with_what_differs_from_the_default() -> None:
    options = BoundedOptions(kvm_states=("fixed", "sqrt"), kvm_open=(0, 8), kvm_leaves=("int8",))
    assert options.labels(("kvm-fold",)) == [
        "kvm-fold/fixed@1024", "kvm-fold/fixed/open8/int8@1024",
        "kvm-fold/sqrt@1024", "kvm-fold/sqrt/open8/int8@1024",
    ]  # fmt: skip
    assert BoundedOptions(kvm_open=(4,)).labels(("kvm-fold",)) == ["kvm-fold/fixed/open4@1024"]
    centred = BoundedOptions(kvm_open=(0, 4), kvm_slot_key="centred")
    assert centred.labels(("kvm-fold",)) == [
        "kvm-fold/fixed@1024",
        "kvm-fold/fixed/open4/centred@1024",
    ]
    box = BoundedOptions(kvm_open=(0, 4), kvm_slot_score="box").bounded_configs(("kvm-fold",))
    assert list(box) == ["kvm-fold/fixed@1024", "kvm-fold/fixed/open4/box@1024"]
    assert [c.slot_score for c in box.values()] == ["mean", "box"]  # type: ignore[attr-defined]
    routed = BoundedOptions(
        kvm_open=(0, 4), kvm_slot_variance=0.5, kvm_rerank=64, kvm_readouts=False
    ).bounded_configs(("kvm-fold",))
    assert list(routed) == [
        "kvm-fold/fixed@1024", "kvm-fold/fixed/open4/var0.5/rerank64/noreadouts@1024"
    ]  # fmt: skip
    coarse, two = routed.values()  # the coarse state takes none of the two-level options
    assert isinstance(coarse, KVMFoldConfig) and isinstance(two, KVMFoldConfig)
    assert (coarse.slot_variance, coarse.rerank, coarse.readouts) == (0.0, 0, True)
    assert (two.slot_variance, two.rerank, two.readouts) == (0.5, 64, False)
    for field, value in (("slot_variance", 0.5), ("rerank", 64), ("readouts", False)):
        with pytest.raises(ValueError, match=f"{field}: only two-level KVM-Fold"):
            KVMFoldConfig(budget=26, sinks=2, window=16, **{field: value})  # type: ignore[arg-type]
    capped = BoundedOptions(kvm_open=(0, 4), kvm_slot_cap=2.5).bounded_configs(("kvm-fold",))
    assert list(capped) == ["kvm-fold/fixed/cap2.5@1024", "kvm-fold/fixed/cap2.5/open4@1024"]
    assert [c.slot_cap for c in capped.values()] == [2.5, 2.5]  # type: ignore[attr-defined]
    token = BoundedOptions(kvm_open=(0, 4), routing="token")
    assert token.labels(("kvm-fold", "quest")) == [
        "kvm-fold/fixed@1024", "kvm-fold/fixed/open4/token@1024", "quest/token@1024"
    ]  # fmt: skip
    stores = BoundedOptions(kvm_open=(0, 8), kvm_leaves=("exact", "int8"))
    configs = stores.bounded_configs(("kvm-fold",))
    assert list(configs) == [
        "kvm-fold/fixed@1024", "kvm-fold/fixed/open8@1024", "kvm-fold/fixed/open8/int8@1024"
    ]  # fmt: skip
    assert [c.leaves for c in configs.values()] == ["exact", "exact", "int8"]  # type: ignore[attr-defined]


def test_only_keeps_the_named_runs_and_refuses_a_label_the_options_do_not_make() -> None:
    options = BoundedOptions(
        kvm_states=("fixed", "sqrt"), kvm_open=(0, 8), kvm_leaves=("exact", "int8"),
        only=(
            "full", "streaming@1024", "kvm-fold/sqrt/open8@1024", "kvm-fold/fixed/open8/int8@1024"
        ),
    )  # fmt: skip
    methods = ("full", "fold", "streaming", "kvm-fold")
    assert options.labels(methods) == [
        "full", "streaming@1024", "kvm-fold/fixed/open8/int8@1024", "kvm-fold/sqrt/open8@1024"
    ]  # fmt: skip
    wrong = BoundedOptions(kvm_open=(8,), only=("kvm-fold/fixed/open4@1024",))
    with pytest.raises(ValueError, match=r"only: \['kvm-fold/fixed/open4@1024'\] are not runs"):
        wrong.labels(("kvm-fold",))


@pytest.mark.parametrize("slot_key", ["rotated", "centred"])
def test_a_slots_key_is_its_tokens_mean_rotated_key_or_their_centred_mean(slot_key: str) -> None:
    """Against the leaves, per slot in float64: the mean of the rotated keys it owns, or the
    mean of their un-rotated keys rotated at their mean position (leaf j is token 2 + j)."""
    from longkv.attention.rope import angles_at, rotate

    model, ids = tiny_hf("llama", torch.float64), ids_of()
    config = KVMFoldConfig(budget=26, sinks=2, window=16, open=2, slot_key=slot_key)
    runner = make_runner(model, config)
    assert isinstance(runner, TwoLevelRunner)
    bounded_fold(runner, ids, 8)
    leaves = runner.leaves[1]
    assert leaves is not None
    keys, _, owner, _ = leaves.gather(None, torch.float64)
    positions = torch.arange(2, 2 + len(leaves), dtype=torch.float64)
    cos, sin = angles_at(-positions, runner.inv_freqs[0])
    plain = rotate(keys, cos, sin)  # the leaves' un-rotated keys
    got = runner.middle(1)[0]
    S = got.shape[2]
    for b in range(2):
        for h in range(keys.shape[1]):
            for slot in range(S):
                mine = owner[b, h] == slot
                if slot_key == "rotated":
                    want = keys[b, h, mine].mean(0)
                else:
                    c, s_ = angles_at(positions[mine].mean().view(1), runner.inv_freqs[0])
                    want = rotate(plain[b, h, mine].mean(0, keepdim=True), c, s_)[0]
                torch.testing.assert_close(got[b, h, slot], want, rtol=0, atol=TOL)


@pytest.mark.parametrize(("field", "value"), [("slot_key", "centred"), ("slot_score", "box")])
def test_other_slot_keys_and_scores_still_open_to_the_exact_fold(field: str, value: str) -> None:
    model, ids = tiny_hf("qwen2"), ids_of()
    exact = kv_fold(model, ids, ids.shape[1], return_logits=True).logits
    config = KVMFoldConfig(budget=26, sinks=2, window=16, open=8, **{field: value})  # type: ignore[arg-type]
    run = bounded_fold(make_runner(model, config), ids, 7, return_logits=True).logits
    assert run is not None and exact is not None
    assert (run - exact).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match=f"{field}: only two-level KVM-Fold"):
        KVMFoldConfig(budget=26, sinks=2, window=16, **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"{field}: must be one of"):
        KVMFoldConfig(budget=26, sinks=2, window=16, open=8, **{field: "max"})  # type: ignore[arg-type]


def test_bounded_slots_are_more_even_and_still_open_to_the_exact_fold() -> None:
    """slot_cap 1: a slot above the mean count takes no token of the next leaving block, so the
    largest slot is smaller than without the bound; every slot open is still the exact fold."""
    model, ids = tiny_hf("llama"), ids_of(120)
    exact = kv_fold(model, ids, ids.shape[1], return_logits=True).logits
    largest = []
    for cap in (None, 1.0):
        config = KVMFoldConfig(budget=26, sinks=2, window=16, open=8, slot_cap=cap)
        runner = make_runner(model, config)
        run = bounded_fold(runner, ids, 4, return_logits=True).logits
        assert run is not None and exact is not None
        assert (run - exact).abs().max().item() <= 1e-5
        state = runner.states[runner.ref]
        assert state is not None and (state.count.sum(-1) == 120 - 2 - 16).all()  # none lost
        largest.append(state.count.amax().item())
    assert largest[1] < largest[0], largest
    with pytest.raises(ValueError, match="slot_cap: a bound below the mean count"):
        KVMFoldConfig(budget=26, sinks=2, window=16, slot_cap=0.5)


@pytest.mark.parametrize(
    ("config", "single"),
    [
        (QuestConfig(budget=26, sinks=2, window=16, page=1), "all"),
        (QuestConfig(budget=26, sinks=2, window=16, page=6), "none"),
        (KVMFoldConfig(budget=60, sinks=2, window=16, open=2, slot_score="box"), "some"),
    ],
    ids=["quest-page1", "quest-page6", "two-level-box"],
)
def test_a_units_bounds_hold_its_keys_and_its_score_bounds_every_logit_in_it(
    config: BoundedConfig, single: str
) -> None:
    """Per unit (Quest's page; two-level's slot under slot_score="box", 72 leaves in up to 42
    slots): the per-channel max and min of the rotated keys it owns (against the leaves,
    float64); its score bounds the logit of each of its keys and is the logit itself for a unit
    of one token."""
    model, ids = tiny_hf("llama", torch.float64), ids_of()
    runner = make_runner(model, config)
    assert isinstance(runner, (QuestRunner, TwoLevelRunner))
    bounded_fold(runner, ids, 8)
    leaves, bounds = runner.leaves[1], runner.bounds[1]
    assert leaves is not None and bounds is not None
    keys, _, owner, _ = leaves.gather(None, torch.float64)
    B, Hkv, _, D = keys.shape
    U = bounds[0].shape[2]
    count = torch.zeros(B, Hkv, U, dtype=torch.long).scatter_add_(2, owner, torch.ones_like(owner))
    assert (count >= 1).all()  # every unit owns a leaf
    for b in range(B):
        for h in range(Hkv):
            for unit in range(U):
                mine = keys[b, h, owner[b, h] == unit]
                torch.testing.assert_close(bounds[0][b, h, unit], mine.amax(0), rtol=0, atol=0)
                torch.testing.assert_close(bounds[1][b, h, unit], mine.amin(0), rtol=0, atol=0)
    q = torch.randn(B, Hkv, 7, D, generator=torch.Generator().manual_seed(3)).double()
    score = bound_scores(q, *bounds, 1.0)  # (B, Hkv, 7, U)
    logits = q @ keys.transpose(-1, -2)  # (B, Hkv, 7, n)
    of_leaf = score.gather(3, owner.unsqueeze(2).expand_as(logits))
    assert (of_leaf >= logits - 1e-12).all()
    alone = count.gather(2, owner) == 1  # (B, Hkv, n): the leaf is its unit's only token
    assert ("all" if alone.all() else "some" if alone.any() else "none") == single
    rows = alone.unsqueeze(2).expand_as(logits)
    torch.testing.assert_close(of_leaf[rows], logits[rows], rtol=0, atol=TOL)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("routing", ["token", "block"])
def test_the_needle_route_ranks_each_leaving_tokens_slot_for_the_query_units(
    k: int, routing: str
) -> None:
    """Against a per-token count: a token that left the window is routed by a query head when
    the head opened its slot (per token: fewer than k slots score above it, earlier slots
    first on ties); tokens still in the window count in `left` only."""
    model, ids = tiny_hf("llama", torch.float64), ids_of()
    budget = 6 if routing == "block" else None  # token: each query head's k best, unbounded
    config = KVMFoldConfig(
        budget=26, sinks=2, window=16, open=k, routing=routing, leaf_budget=budget
    )
    runner = make_runner(model, config)
    assert isinstance(runner, TwoLevelRunner)
    bounded_fold(runner, ids, 8)
    # the last chunk (88, 89) was read after a window of 74 .. 87: tokens 60 .. 73 had left it
    start, stop = 60, 80
    got = runner.needle_route(start, stop)
    ranks, routed = [], []
    for scores, opened, leaves in zip(
        runner.last_scores, runner.last_opened, runner.leaves, strict=True
    ):
        assert scores is not None and opened is not None and leaves is not None
        groups = scores.shape[1] // leaves.owner.tensor.shape[1]
        for b in range(2):
            for h in range(scores.shape[1]):
                order = sorted(range(scores.shape[2]), key=lambda i: (-float(scores[b, h, i]), i))
                for p in range(start, min(stop, 2 + len(leaves))):
                    slot = int(leaves.owner.tensor[b, h // groups, p - 2, 0])
                    ranks.append(order.index(slot))
                    routed.append(bool(opened[b, h, slot]))
    n_layers, H = len(runner.leaves), runner.last_scores[0].shape[1]
    assert got["left"] == pytest.approx(len(ranks) / (20 * 2 * H * n_layers))
    assert got["left"] == pytest.approx(14 / 20)
    assert got["routed"] == pytest.approx(sum(routed) / len(routed))
    if routing == "token":
        assert routed == [r < k for r in ranks]
    assert got["slot_rank"] == float(torch.tensor(ranks, dtype=torch.float64).median())
    assert runner.needle_route(80, 90) == {"left": 0.0}  # all still in the window


def test_a_read_past_the_models_positions_is_refused_before_the_first_chunk() -> None:
    model = tiny_hf("llama")  # 256 positions
    runner = make_runner(model, KVMFoldConfig(budget=26, sinks=2, window=16, open=2))
    ids = torch.randint(0, 64, (1, 250))
    with pytest.raises(ValueError, match="take 259 positions and the model has max_position"):
        bounded_generate(runner, ids, 8, 10)  # 250 read, 9 more to decode
    with pytest.raises(ValueError, match=r"or read it with a cache that places them so \(stream"):
        bounded_generate(runner, ids, 8, 10)
    assert runner.seen == 0


def test_two_level_refuses_what_would_lose_a_leaf() -> None:
    with pytest.raises(ValueError, match="merge_threshold: two-level KVM-Fold keeps every"):
        KVMFoldConfig(budget=26, sinks=2, window=16, open=2, merge_threshold=0.5)
    with pytest.raises(ValueError, match="readout: two-level KVM-Fold routes on each slot"):
        KVMFoldConfig(budget=26, sinks=2, window=16, open=2, readout="founder")


def test_greedy_decoding_with_every_slot_open_is_the_folds() -> None:
    """Decoding goes through the same cache: tokens leave the window as they are generated."""
    model, ids = tiny_hf("llama", torch.float64), ids_of(60)
    want = fold_generate(model, ids, 60, 24)
    runner = make_runner(model, KVMFoldConfig(budget=26, sinks=2, window=16, open=8))
    assert torch.equal(bounded_generate(runner, ids, 8, 24), want)
    assert runner.seen == 60 + 24 - 1  # the last token is generated, never read


def test_decoded_tokens_leave_the_window_an_eighth_of_it_at_a_time() -> None:
    """A window of 16: a decoded token moves no token until 2 go together, so the leaves grow by
    2 every other step and the window holds 15 or 16 tokens (the decoded one included)."""
    model, ids = tiny_hf("llama"), ids_of(60)
    runner = make_runner(model, KVMFoldConfig(budget=26, sinks=2, window=16, open=2))
    assert isinstance(runner, TwoLevelRunner) and runner.leave_at_once == 2
    bounded_fold(runner, ids[:, :40], 8)
    seen = []
    with torch.inference_mode():
        for t in range(40, 52):
            runner.forward(ids[:, t : t + 1])
            leaves = runner.leaves[0]
            assert leaves is not None
            seen.append((len(leaves), runner.window_count))
    assert [n for n, _ in seen] == [24, 24, 26, 26, 28, 28, 30, 30, 32, 32, 34, 34]
    assert {w for _, w in seen} == {15, 16}
