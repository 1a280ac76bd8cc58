"""token_nll against a float64 log-sum-exp, in every dtype a model gives logits in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longkv.nll import token_nll

V = 49_152  # SmolLM2's vocabulary


def reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    x = logits.double()
    return x.logsumexp(-1) - x.gather(-1, targets.unsqueeze(-1))[..., 0]


def model_like(dtype: torch.dtype, T: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, T, V) logits spread like a language model's (a few large, most far below) and targets."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, T, V, generator=g) * 3 + 10
    logits[..., :50] += 8  # the likely tokens
    return logits.to(dtype), torch.randint(0, V, (1, T), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_token_nll_equals_a_float64_log_sum_exp(dtype: torch.dtype) -> None:
    logits, targets = model_like(dtype)
    nll = token_nll(logits, targets)
    assert nll.dtype == torch.float64 and nll.shape == targets.shape
    assert (nll - reference(logits, targets)).abs().max() < 1e-6  # 21 rows a block: 4 blocks


def test_float64_logits_are_scored_in_float64() -> None:
    logits, targets = model_like(torch.float64, T=8)
    assert (token_nll(logits, targets) - reference(logits, targets)).abs().max() < 1e-12


def test_the_transposed_float32_cross_entropy_it_replaces_is_biased() -> None:
    """The call kv_fold scored with: classes on dim 1 of a strided tensor, in float32. It is
    1e-4 low, so a scorer within 1e-6 of float64 is not that call."""
    logits, targets = model_like(torch.float32, T=256)
    old = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").double()
    ref = reference(logits, targets)
    assert (old - ref).mean() < -1e-5
    assert abs((token_nll(logits, targets) - ref).mean()) < 1e-7


def test_shapes_must_match() -> None:
    with pytest.raises(ValueError, match=r"must be \(\.\.\., V\) and \(\.\.\.\)"):
        token_nll(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
