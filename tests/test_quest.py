"""Quest's pages as a retrieval cache: every page opened is the exact fold; a layer's page
scores and attention are the per-query references over its own cache; dense layers open every
page; bad settings are refused. A page's bounds and score against its keys: tests/test_two_level.py
(`test_a_units_bounds_hold_its_keys_and_its_score_bounds_every_logit_in_it`)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from conftest import TOL, tiny_hf
from longkv.caches import bounded_fold, bounded_generate, make_runner
from longkv.caches.naive import (
    block_units_naive,
    bound_scores_naive,
    routed_attention_naive,
    top_units_naive,
)
from longkv.caches.quest import QuestConfig, QuestRunner
from longkv.fold import fold_generate, kv_fold


def ids_of(n: int = 90) -> Tensor:
    return torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_opening_every_page_is_the_exact_fold(arch: str, chunk: int) -> None:
    model, ids = tiny_hf(arch), ids_of()
    exact = kv_fold(model, ids, ids.shape[1], return_logits=True).logits
    runner = make_runner(model, QuestConfig(budget=26, sinks=2, window=16, page=4, open=99))
    assert isinstance(runner, QuestRunner)
    run = bounded_fold(runner, ids, chunk, return_logits=True).logits
    assert run is not None and exact is not None
    assert (run - exact).abs().max().item() <= 1e-5
    assert runner.attention_share() == {"mean": 1.0, "max": 1.0}
    leaves = runner.leaves[runner.ref]
    assert leaves is not None and len(leaves) == 90 - 2 - 16
    assert leaves.owner.tensor[0, 0, :, 0].tolist() == [j // 4 for j in range(72)]


@pytest.mark.parametrize("routing", ["block", "token"])
def test_a_layers_pages_and_attention_are_the_per_query_references(routing: str) -> None:
    model, ids = tiny_hf("llama", torch.float64), ids_of()
    config = QuestConfig(
        budget=26, sinks=2, window=16, page=4, open=3, routing=routing, leaf_budget=10,
        dense_layers=0,
    )  # fmt: skip
    runner = make_runner(model, config)
    assert isinstance(runner, QuestRunner)
    bounded_fold(runner, ids, 8)
    layer = runner.cache.layers[1]  # the last forward's chunk
    keys, values = layer.keys, layer.values
    leaves = runner.leaves[1]
    assert leaves is not None
    L = keys.shape[2]  # the last chunk's tokens
    q = torch.randn(2, 4, L, keys.shape[-1], generator=torch.Generator().manual_seed(2)).double()
    got = runner.attend(1)(q, keys, values, 0.3)
    every = leaves.gather(None, torch.float64)
    pages = (len(leaves) + 3) // 4
    scores = bound_scores_naive(q, every.keys, every.owner, pages, 0.3)  # (B, H, L, P)
    torch.testing.assert_close(runner.last_scores[1], scores[:, :, -1], rtol=0, atol=TOL)
    P = scores.shape[-1]
    count = runner.page_counts(1)
    opened = torch.zeros(2, 4, L, P, dtype=torch.bool)
    if routing == "block":
        grouped = scores.reshape(2, 2, 2 * L, P)  # each KV head's query heads' rows
        shared = block_units_naive(grouped, count, 10)  # (B, Hkv, 1, P)
        opened[:] = shared.repeat_interleave(2, dim=1)
    else:
        for b in range(2):
            for h in range(4):
                for t in range(L):
                    opened[b, h, t, top_units_naive(scores[b, h, t], 3)] = True
    sinks, _, window = runner.parts(1)
    entries = {"sinks": sinks, "window": window, "chunk": (keys, values)}
    entries["leaves"] = (every.keys, every.values)
    want = routed_attention_naive(q, entries, None, every.owner, opened, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_dense_layers_open_every_page_and_the_others_their_best() -> None:
    model, ids = tiny_hf("llama"), ids_of()
    config = QuestConfig(budget=26, sinks=2, window=16, page=4, open=2, dense_layers=1)
    runner = make_runner(model, config)
    assert isinstance(runner, QuestRunner)
    bounded_generate(runner, ids, 8, 3)
    dense, sparse = runner.last_opened  # the last decoded token's pages, per query head
    assert dense is not None and sparse is not None
    assert dense.all() and (sparse.sum(-1) == 2).all()


def test_greedy_decoding_with_every_page_open_is_the_folds() -> None:
    model, ids = tiny_hf("llama", torch.float64), ids_of(60)
    want = fold_generate(model, ids, 60, 20)
    runner = make_runner(model, QuestConfig(budget=26, sinks=2, window=16, page=3, open=99))
    assert torch.equal(bounded_generate(runner, ids, 8, 20), want)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("page", 0, "page: must be >= 1"),
        ("open", 0, "open: must be >= 1"),
        ("dense_layers", -1, "dense_layers: must be >= 0"),
        ("routing", "slot", "routing: must be one of"),
        ("leaf_budget", 0, "leaf_budget: must be >= 1"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuestConfig(budget=26, sinks=2, window=16, **{field: value})  # type: ignore[arg-type]
