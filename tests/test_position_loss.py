"""Held-out loss by position: the per-position NLL, its buckets, and the batched model pass."""

from __future__ import annotations

import math

import pytest
import torch

from longkv.evals.position_loss import (
    PositionBucket,
    bucket_loss,
    doubling_edges,
    held_out_position_nll,
    position_nll,
)
from longkv.models import LongKVConfig, LongKVForCausalLM


def test_position_nll_and_buckets_by_hand() -> None:
    ln3 = math.log(3)
    logits = torch.tensor(
        [[[0.0, 0.0], [ln3, 0.0]], [[ln3, 0.0], [0.0, 0.0]]], dtype=torch.float64
    )  # (2, 2, 2)
    targets = torch.tensor([[0, 0], [1, 1]])
    # row 0: p = 1/2, then 3/4; row 1: p = 1/4, then 1/2
    t0, t1 = (math.log(2) + math.log(4)) / 2, (math.log(4 / 3) + math.log(2)) / 2
    nll = position_nll(logits, targets)
    assert nll.dtype == torch.float64
    assert torch.allclose(nll, torch.tensor([t0, t1], dtype=torch.float64), atol=1e-12)
    assert bucket_loss(nll, [0, 1, 2]) == [
        PositionBucket(0, 1, nll[0].item()),
        PositionBucket(1, 2, nll[1].item()),
    ]
    assert bucket_loss(nll, [0, 2])[0].loss == pytest.approx((t0 + t1) / 2, abs=1e-12)
    with pytest.raises(ValueError, match="past the 2 positions"):
        bucket_loss(nll, [0, 3])
    with pytest.raises(ValueError, match="strictly increasing"):
        bucket_loss(nll, [1, 1])


def test_doubling_edges_end_at_the_length() -> None:
    assert doubling_edges(5) == [0, 1, 2, 4, 5]
    assert doubling_edges(4) == [0, 1, 2, 4]
    assert doubling_edges(1) == [0, 1]


def test_held_out_position_nll_averages_rows_whatever_the_batch() -> None:
    config = LongKVConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, mixer="full")
    model = LongKVForCausalLM(config).double().eval()
    rows = torch.randint(0, 32, (3, 9))
    with torch.no_grad():
        whole = position_nll(model(rows[:, :-1]).logits, rows[:, 1:])
    for batch_size in (1, 2, 3):
        assert torch.allclose(held_out_position_nll(model, rows, batch_size), whole, atol=1e-10)
