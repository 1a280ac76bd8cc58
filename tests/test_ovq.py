"""OVQ attention (spec ovq.md section 10): the chunked path against the token-by-token
reference, the limits it must meet, segmentation, bookkeeping, the schedule and gradients."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from longkv.attention.naive import naive_full_attention
from longkv.ovq.config import OVQConfig
from longkv.ovq.functional import assign, ovq_attention, unit
from longkv.ovq.naive import ovq_attention_naive

B, H, HKV, DK, DV = 2, 4, 2, 6, 5


def inputs(T: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, DK, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, T, DK, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, T, DV, generator=g, dtype=torch.float64)
    beta = 0.5 + torch.rand(H, generator=g, dtype=torch.float64)
    return q, k, v, beta


CONFIGS = {
    "saturating": OVQConfig(chunk_len=5, max_centroids=7),
    "min": OVQConfig(chunk_len=5, max_centroids=9, schedule="min"),
    "no-count-bias": OVQConfig(chunk_len=4, max_centroids=6, count_bias=False),
    "one-token-chunks": OVQConfig(chunk_len=1, max_centroids=5),
    "never-visible": OVQConfig(chunk_len=3, max_centroids=1),  # size 0 forever (9.11)
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_chunked_path_equals_the_token_by_token_reference(name: str) -> None:
    config = CONFIGS[name]
    q, k, v, beta = inputs(37)
    out, state = ovq_attention(q, k, v, config, beta)
    ref, ref_state = ovq_attention_naive(q, k, v, config, beta)
    assert (out - ref).abs().max() <= 1e-10
    rows = len(state.slots)
    keys, values, count = state.means(rows)
    for (b, h), book in ref_state.dictionaries.items():
        assert len(book.slots) == rows
        for j, slot in enumerate(book.slots):
            key, value = slot.mean()
            assert count[b, h, j] == slot.count
            assert (keys[b, h, j] - key).abs().max() <= 1e-12
            assert (values[b, h, j] - value).abs().max() <= 1e-12
        pending = torch.stack([key for key, _ in book.pending]) if book.pending else None
        assert len(book.pending) == state.pending.k.shape[2]
        if pending is not None:
            assert (state.pending.k[b, h] - pending).abs().max() <= 1e-15


@pytest.mark.parametrize("name", ["saturating", "min", "one-token-chunks", "no-count-bias"])
def test_any_segmentation_equals_one_call(name: str) -> None:
    config = CONFIGS[name]
    q, k, v, beta = inputs(31, seed=1)
    whole, whole_state = ovq_attention(q, k, v, config, beta)
    for cuts in ([0, 31], [0, 1, 2, 3, 31], [0, 7, 8, 13, 22, 31], list(range(32))):
        state, outs = None, []
        for a, b in itertools.pairwise(cuts):
            out, state = ovq_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], config, beta, state
            )
            outs.append(out)
        assert state is not None
        assert (torch.cat(outs, dim=2) - whole).abs().max() <= 1e-12
        assert (state.slots.tensor - whole_state.slots.tensor).abs().max() <= 1e-12
        read = state.read  # the centroids' read carried to the next call: the rows' means
        if config.chunk_len == 1:  # every token commits: nothing to carry
            assert read is None
            continue
        assert read is not None and torch.equal(read.k, state.means()[0])
        assert (read.bias is None) == (not config.count_bias)
        kept = sum(t.numel() * 8 for t in read if t is not None)
        assert state.nbytes == state.slots.tensor.numel() * 8 + kept + state.pending.nbytes
    # one state continued twice: the first branch leaves it as it was
    _, mid = ovq_attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], config, beta)
    first, _ = ovq_attention(q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], config, beta, mid)
    again, _ = ovq_attention(q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], config, beta, mid)
    assert torch.equal(first, again) and (first - whole[:, :, 12:]).abs().max() <= 1e-12


def scaled_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor):
    """Causal softmax attention on unit q, k with the logit scale beta_h sqrt(Dk)."""
    qs = unit(q) * (beta * math.sqrt(DK)).view(1, H, 1, 1)
    return naive_full_attention(qs, unit(k), v, scale=1.0)


def test_within_one_chunk_and_without_merging_it_is_causal_attention() -> None:
    q, k, v, beta = inputs(20, seed=2)
    one_chunk = OVQConfig(chunk_len=32, max_centroids=4)
    out, _ = ovq_attention(q, k, v, one_chunk, beta)
    assert (out - scaled_causal(q, k, v, beta)).abs().max() <= 1e-12
    lossless = OVQConfig(chunk_len=3, max_centroids=20, schedule="min")  # every token its slot
    out, state = ovq_attention(q, k, v, lossless, beta)
    assert (out - scaled_causal(q, k, v, beta)).abs().max() <= 1e-12
    assert bool((state.means(len(state.slots))[2] == 1).all())


def test_causality_and_bookkeeping() -> None:
    config = CONFIGS["saturating"]
    q, k, v, beta = inputs(23, seed=3)
    out, state = ovq_attention(q, k, v, config, beta)
    changed = v.clone()
    changed[:, :, 17:] += 1.0
    later, _ = ovq_attention(q, k, changed, config, beta)
    assert torch.equal(out[:, :, :17], later[:, :, :17])  # nothing before 17 sees them
    assert state.seen == 23 and state.committed == 20 and state.visible == config.size(20)
    assert len(state.slots) == state.visible  # every slot of the dictionary holds tokens
    counts = state.means(len(state.slots))[2]
    assert bool((counts >= 1).all()) and bool((counts.sum(-1) == 20).all())
    assert torch.equal(state.pending.k, unit(k[:, :, 20:])) and torch.equal(
        state.pending.v, v[:, :, 20:]
    )


def test_the_papers_schedule() -> None:
    paper = OVQConfig.paper()
    sizes = [paper.size(256 * c) for c in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 31, 32, 64, 128, 512)]
    assert sizes == [204, 341, 438, 512, 568, 614, 651, 682, 768, 819, 906, 910, 963, 992, 1016]
    assert OVQConfig(max_centroids=4, schedule="min").size(256) == 4


def test_assignment_rules() -> None:
    # first chunk (no centroid): the m - 1 keys least similar to the first found slots 1..
    keys = unit(torch.tensor([[1.0, 0.0], [0.9, 0.1], [-1.0, 0.0], [0.0, 1.0], [0.8, 0.2]]))
    slots = assign(keys.view(1, 1, 5, 2), keys[:0].view(1, 1, 0, 2), 3)
    assert slots.view(-1).tolist() == [0, 0, 1, 2, 0]  # -1.0 least similar, then (0, 1)
    # later chunks: the m keys of the lowest best similarity found d, d + 1, ..., the others
    # join their arg-max centroid; ties: keys 1 and 3 are equally novel (best 0, at centroid
    # 2) and the earlier founds; key 0 is as close to centroids 0 and 1 and joins 0
    means = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]).view(1, 1, 3, 2)
    keys = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.6, 0.8]])
    slots = assign(keys.view(1, 1, 5, 2), means, 1)
    assert slots.view(-1).tolist() == [0, 3, 2, 2, 2]


def test_gradients_reach_earlier_tokens_through_the_means() -> None:
    """gradcheck through two commits (chunks of 2, one query head per KV head pair); the first
    token's key and value move the last output only through the centroid they joined."""
    config = OVQConfig(chunk_len=2, max_centroids=2)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 7, 3, generator=g, dtype=torch.float64) for n in (2, 1, 1))
    beta = 0.5 + torch.rand(2, generator=g, dtype=torch.float64)
    args = tuple(t.requires_grad_() for t in (q, k, v, beta))

    def last(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        return ovq_attention(q, k, v, config, beta)[0][:, :, -1]

    assert torch.autograd.gradcheck(last, args)
    dk, dv = torch.autograd.grad(last(*args).sum(), (k, v))
    assert dk[:, :, 0].abs().sum() > 0 and dv[:, :, 0].abs().sum() > 0
