"""Sampling for decoding: the distribution a Sampler draws from against a plain per-row
reference in float64, and its limits (top_k = 1, a tiny top_p: greedy)."""

from __future__ import annotations

import math

import pytest
import torch

from longkv.decoding import Sampler, decode, greedy


def reference(row: list[float], temperature: float, top_k: int | None, top_p: float) -> list[float]:
    """Scale, keep the top_k likeliest (ties at the k-th kept), then the likeliest ones until
    their probability reaches top_p, renormalise."""
    scores = [x / temperature for x in row]
    order = sorted(range(len(row)), key=lambda i: -scores[i])
    kept = set(order)
    if top_k is not None:
        kth = scores[order[top_k - 1]]
        kept = {i for i in kept if scores[i] >= kth}
    z = sum(math.exp(scores[i]) for i in kept)
    mass, nucleus = 0.0, set()
    for i in order:
        if i in kept and mass < top_p:
            nucleus.add(i)
            mass += math.exp(scores[i]) / z
    z = sum(math.exp(scores[i]) for i in nucleus)
    return [math.exp(scores[i]) / z if i in nucleus else 0.0 for i in range(len(row))]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, 1.0), (0.7, 5, 1.0), (1.3, None, 0.8), (0.5, 10, 0.5), (2.0, 3, 0.99)],
)
def test_the_sampled_distribution_equals_the_per_row_reference(
    temperature: float, top_k: int | None, top_p: float
) -> None:
    logits = torch.randn(4, 37, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = Sampler(temperature, top_k, top_p).probs(logits)
    for b in range(4):
        want = reference(logits[b].tolist(), temperature, top_k, top_p)
        assert got[b].tolist() == pytest.approx(want, abs=1e-12)


def test_one_kept_token_is_greedy_and_draws_follow_the_generator() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(Sampler(top_k=1)(logits), greedy(logits))
    assert torch.equal(Sampler(top_p=1e-9)(logits), greedy(logits))

    def draws(seed: int) -> torch.Tensor:
        sampler = Sampler(temperature=5.0, generator=torch.Generator().manual_seed(seed))
        return decode(lambda ids: logits, logits, 20, pick=sampler)

    assert torch.equal(draws(0), draws(0)) and not torch.equal(draws(0), draws(1))


def test_decode_shows_each_token_as_it_comes() -> None:
    logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(2))
    seen: list[list[int]] = []
    out = decode(lambda ids: logits, logits, 4, on_token=lambda t: seen.append(t.tolist()))
    assert seen == out.T.tolist()
    steps: list[int] = []
    out = decode(
        lambda ids: steps.append(1) or logits, logits, 9, on_token=lambda t: len(steps) == 2
    )
    assert out.shape == (2, 3) and len(steps) == 2  # on_token's True stops after its tokens


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(temperature=0.0), "temperature: must be > 0"),
        (dict(top_k=0), "top_k: must be >= 1"),
        (dict(top_p=0.0), r"top_p: must lie in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p: must lie in \(0, 1\]"),
    ],
)
def test_bad_sampling_settings_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Sampler(**kwargs)  # type: ignore[arg-type]
