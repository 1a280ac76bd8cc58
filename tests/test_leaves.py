"""Two-level KVM-Fold's leaves: ownership against the per-token state, the two stores' round
trips and the bytes they count."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from longkv.caches import KVMFoldConfig
from longkv.caches.kvm_state import empty_state
from longkv.caches.leaves import add_leaves, empty_leaves, read_leaves
from longkv.caches.naive import update_state_naive

B, HKV, D, DV = 2, 3, 6, 5


def blocks(seed: int, n: int, m: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(B, HKV, m, D, generator=g, dtype=torch.float64),
            torch.randn(B, HKV, m, DV, generator=g, dtype=torch.float64),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("targets", [(2, 2, 2, 2), (1, 3, 6, 9), (4, 8, 12, 16)])
def test_every_token_that_left_is_a_leaf_of_the_one_slot_its_key_built(
    targets: tuple[int, ...],
) -> None:
    """Leaves owned by the per-token state's destinations: each slot's leaves sum to its key
    and value sums and number its count."""
    parts = blocks(sum(targets), len(targets), 4)
    state = empty_state(*parts[0])
    leaves = empty_leaves(*parts[0])
    first = 0
    for (k, v), target in zip(parts, targets, strict=True):
        state, dest = update_state_naive(state, k, v, first, target, k[:, :, :0])
        leaves = add_leaves(leaves, k, v, dest, donate=True)
        first += k.shape[2]
    keys, values, owner = read_leaves(leaves, torch.float64)
    assert len(leaves) == first and bool((owner >= 0).all())  # no merge threshold: none dropped
    S = state.num_slots
    one_hot = torch.nn.functional.one_hot(owner, S).to(torch.float64)  # (B, Hkv, L, S)
    own = one_hot.transpose(-1, -2)  # (B, Hkv, S, L)
    torch.testing.assert_close(own @ keys, state.key_sum, rtol=0, atol=1e-10)
    torch.testing.assert_close(own @ values, state.value_sum, rtol=0, atol=1e-10)
    assert torch.equal(own.sum(-1), state.count)


def test_exact_leaves_come_back_as_given_and_count_their_bytes() -> None:
    (k1, v1), (k2, v2) = blocks(1, 2, 3)
    owner = torch.arange(3).expand(B, HKV, 3)
    leaves = add_leaves(add_leaves(empty_leaves(k1, v1), k1, v1, owner), k2, v2, owner + 3)
    keys, values, own = read_leaves(leaves, torch.float64)
    assert torch.equal(keys, torch.cat([k1, k2], 2)) and torch.equal(values, torch.cat([v1, v2], 2))
    assert own.tolist() == torch.arange(6).expand(B, HKV, 6).tolist()
    assert leaves.nbytes == B * HKV * 6 * ((D + DV) * 8 + 8)  # float64 rows, int64 owners


def test_int8_leaves_come_back_within_half_a_step_in_a_quarter_of_the_bytes() -> None:
    ((k, v),) = blocks(2, 1, 7)
    k[0, 0, 0] = 0.0  # a zero row has no scale to divide by
    v = v * torch.logspace(-3, 3, 7, dtype=torch.float64).view(1, 1, 7, 1)  # rows of all sizes
    owner = torch.zeros(B, HKV, 7, dtype=torch.long)
    leaves = add_leaves(empty_leaves(k, v, "int8"), k, v, owner)
    keys, values, _ = read_leaves(leaves, torch.float64)
    for x, back in ((k, keys), (v, values)):
        bound = x.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)  # float32 scales round too
        assert bool(((x - back).abs() <= bound).all())
    assert bool((keys[0, 0, 0] == 0).all())
    assert leaves.nbytes == B * HKV * 7 * ((D + DV) * 1 + 2 * 4 + 8)  # codes, scales, owners


def test_an_unknown_store_is_refused_naming_the_setting() -> None:
    with pytest.raises(
        ValueError, match=r"KVMFoldConfig\.leaves: must be one of \('exact', 'int8'\)"
    ):
        KVMFoldConfig(budget=26, sinks=2, window=16, open=2, leaves="fp4")
