"""Routing recall (`longkv.caches.recall`): full attention's probabilities at watched tokens
against the model's own eager attention, which tokens a cache attended exactly, and the recall
of a planted answer whose share is known."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from conftest import TOL, tiny_hf
from longkv.caches import KVMFoldConfig, bounded_fold
from longkv.caches.bounded import BoundedConfig
from longkv.caches.methods import make_runner
from longkv.caches.recall import cache_recall, full_attention_at, head_recall, recall
from longkv.caches.two_level import TwoLevelRunner


def ids_of(n: int = 90) -> Tensor:
    return torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(5))


def read(runner: object, ids: Tensor, chunk: int = 8) -> None:
    """Read ids as a prompt is read to answer it: all but the last token in chunks, the last on
    its own (as `bounded_generate` reads it)."""
    bounded_fold(runner, ids[:, :-1], chunk, score=False)  # type: ignore[arg-type]
    with torch.inference_mode():
        runner.forward(ids[:, -1:], "last")  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_full_attention_at_a_token_is_the_models_own_attention_there(arch: str) -> None:
    """Against one eager forward's attention weights (float64), at tokens read mid-chunk, at a
    chunk's edge and at the first; a sliding-window layer gives none."""
    model, ids = tiny_hf(arch, torch.float64), ids_of(60)
    model.set_attn_implementation("eager")
    weights = model(ids, output_attentions=True).attentions  # per layer (B, H, T, T)
    model.set_attn_implementation("sdpa")
    tokens = [0, 17, 31, 32, 59]
    got = full_attention_at(model, ids, tokens, chunk_size=16)
    assert sorted(got) == tokens
    for token, layers in got.items():
        for i, probs in enumerate(layers):
            if arch == "gemma3" and i % 2 == 0:  # sliding, global, sliding
                assert probs is None
                continue
            assert probs is not None and probs.shape == (2, 4, token + 1)
            want = weights[i][:, :, token, : token + 1].float()
            torch.testing.assert_close(probs, want, rtol=0, atol=1e-6)


def test_a_streaming_cache_attends_its_sinks_and_window_exactly() -> None:
    model, ids = tiny_hf("llama"), ids_of()
    runner = make_runner(model, BoundedConfig(budget=20, sinks=2, window=18))
    runner.watch = {45, 89}
    read(runner, ids)
    last = runner.exact_tokens(89)[0]
    assert last is not None and last.shape == (2, 4, 90)
    want = torch.zeros(90, dtype=torch.bool)
    want[:2] = want[72:] = True  # 2 sinks, then the window of 18 ending with the token itself
    assert torch.equal(last, want.expand(2, 4, 90))
    mid = runner.exact_tokens(45)[1]  # a chunk of 8 from 40: the window before it and itself
    assert mid is not None and int(mid[0, 0].sum()) == 2 + 18 - 8 + 6
    with pytest.raises(ValueError, match="token: 44 was not watched"):
        runner.exact_tokens(44)


def test_opening_every_slot_recalls_all_of_full_attentions_mass() -> None:
    model, ids = tiny_hf("llama", torch.float64), ids_of()
    runner = make_runner(model, KVMFoldConfig(budget=26, sinks=2, window=16, open=64))
    runner.watch = {89}
    read(runner, ids)
    full = full_attention_at(model, ids, [89], chunk_size=32)
    got = cache_recall(runner, full, {89: (30, 34)})[89]
    assert got["mass"] == pytest.approx(1.0, abs=1e-6)  # float32 probabilities
    assert got["answer"] == pytest.approx(1.0, abs=TOL)
    assert got["entries"] == 90


@pytest.mark.parametrize("routing", ["token", "block"])
def test_a_caches_exact_leaves_are_those_of_the_units_each_head_opened(routing: str) -> None:
    """Against the runner's own record of what the last query's heads opened (leaf j is token
    2 + j, KV head h // 2 of query head h): the exact tokens are the sinks, the window and the
    leaves of the opened slots, and an answer's recall is the mass of the heads that opened its
    slot over all heads' mass on it (its true share)."""
    model, ids = tiny_hf("llama", torch.float64), ids_of()
    config = KVMFoldConfig(budget=26, sinks=2, window=16, open=2, routing=routing, leaf_budget=8)
    runner = make_runner(model, config)
    assert isinstance(runner, TwoLevelRunner)
    runner.watch = {89}
    read(runner, ids)
    exact = runner.exact_tokens(89)
    full = full_attention_at(model, ids, [89], chunk_size=32)[89]
    mixed_layers = 0
    for layer, (mask, opened, store) in enumerate(
        zip(exact, runner.last_opened, runner.leaves, strict=True)
    ):
        assert mask is not None and opened is not None and store is not None
        n = len(store)
        assert runner.watched[89].leaves[layer] == n
        assert 2 + n == 90 - runner.window_count  # every leaf is a token before the window
        owner = store.owner.tensor[..., 0]
        for b in range(2):
            for h in range(4):
                want = [True, True] + [bool(opened[b, h, owner[b, h // 2, j]]) for j in range(n)]
                want += [True] * runner.window_count
                assert mask[b, h].tolist() == want
        # an answer of one leaf that some heads opened and some did not: the heads that opened
        # it attend all their mass on it, the others none
        probs = full[layer]
        assert probs is not None
        seen = opened.gather(-1, owner.repeat_interleave(2, dim=1))  # (B, H, n)
        mixed = [j for j in range(n) if 0 < int(seen[..., j].sum()) < seen[..., j].numel()]
        for j in mixed[:3]:
            on = probs[:, :, 2 + j].double()
            heads = head_recall([probs], [mask], (2 + j, 3 + j))
            want_share = float((on * seen[..., j]).sum() / on.sum())
            assert recall(heads)["answer"] == pytest.approx(want_share, abs=TOL)
            assert 0 < want_share < 1
        mixed_layers += bool(mixed)
    assert mixed_layers


def test_a_planted_answer_is_recalled_whole_when_its_slot_opens_and_its_share_when_not() -> None:
    """One head puts 0.9 of its mass on a planted token, another 0.1: the answer recall is 1.0
    when both open it, 0.9 when only the first does, 0 when neither; heads with no mass on the
    answer do not count; the mass recall and entries follow the exact tokens."""
    probs = torch.full((1, 3, 10), 0.1 / 9, dtype=torch.float64)
    probs[0, 0] = 0.1 / 9
    probs[0, 0, 4] = 0.9  # head 0: 0.9 on the planted token
    probs[0, 1] = 0.9 / 9
    probs[0, 1, 4] = 0.1  # head 1: 0.1
    probs[0, 2] = 0.1
    probs[0, 2, 4] = 0.0  # head 2: none
    probs[0, 2, 0] = 0.2
    assert torch.allclose(probs.sum(-1), torch.ones(1, 3, dtype=torch.float64))
    both = torch.ones(1, 3, 10, dtype=torch.bool)
    first = both.clone()
    first[0, 1:, 4] = False
    neither = both.clone()
    neither[0, :, 4] = False
    for exact, want in ((both, 1.0), (first, 0.9 / 1.0), (neither, 0.0)):
        got = recall(head_recall([probs.float()], [exact], (4, 5)))
        assert got["answer"] == pytest.approx(want, abs=1e-7)
    got = recall(head_recall([probs.float()], [neither], (4, 5)))
    assert got["mass"] == pytest.approx((0.1 + 0.9 + 1.0) / 3, abs=1e-7)
    assert got["entries"] == 9
    assert got["answer_mass"] == pytest.approx(1.0 / 3, abs=1e-7)
    with pytest.raises(ValueError, match="exact: shape"):
        head_recall([probs.float()], [both[..., :9]])
