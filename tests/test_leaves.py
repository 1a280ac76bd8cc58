"""Two-level KVM-Fold's leaves: ownership against the per-token state, each store's round trip,
gathering by slot against a plain selection, and the bytes each store counts."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from torch import Tensor

from longkv.caches import KVMFoldConfig
from longkv.caches.kvm_state import empty_state
from longkv.caches.leaves import FileLeaves, LeafStore, make_leaves
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


def filled(store: str, seed: int = 1, slots: int = 4) -> tuple[LeafStore, Tensor, Tensor, Tensor]:
    """A store of 3 blocks of 5 random leaves, owners random in [0, slots); and what went in:
    keys (B, Hkv, 15, D), values, owners (B, Hkv, 15)."""
    parts = blocks(seed, 3, 5)
    g = torch.Generator().manual_seed(seed)
    owners = torch.randint(0, slots, (B, HKV, 15), generator=g)
    leaves = make_leaves(store, *parts[0])
    for i, (k, v) in enumerate(parts):
        leaves.append(k, v, owners[..., 5 * i : 5 * i + 5])
    keys, values = (torch.cat(x, dim=2) for x in zip(*parts, strict=True))
    return leaves, keys, values, owners


@pytest.mark.parametrize("targets", [(2, 2, 2, 2), (1, 3, 6, 9), (4, 8, 12, 16)])
def test_every_token_that_left_is_a_leaf_of_the_one_slot_its_key_built(
    targets: tuple[int, ...],
) -> None:
    """Leaves owned by the per-token state's destinations: each slot's leaves sum to its key
    and value sums and number its count."""
    parts = blocks(sum(targets), len(targets), 4)
    state = empty_state(*parts[0])
    leaves = make_leaves("exact", *parts[0])
    first = 0
    for (k, v), target in zip(parts, targets, strict=True):
        state, dest = update_state_naive(state, k, v, first, target, k[:, :, :0])
        leaves.append(k, v, dest)
        first += k.shape[2]
    keys, values, owner, valid = leaves.gather(None, torch.float64)
    assert len(leaves) == first and valid is None and bool((owner >= 0).all())
    S = state.num_slots
    one_hot = torch.nn.functional.one_hot(owner, S).to(torch.float64)  # (B, Hkv, L, S)
    own = one_hot.transpose(-1, -2)  # (B, Hkv, S, L)
    torch.testing.assert_close(own @ keys, state.key_sum, rtol=0, atol=1e-10)
    torch.testing.assert_close(own @ values, state.value_sum, rtol=0, atol=1e-10)
    assert torch.equal(own.sum(-1), state.count)


@pytest.mark.parametrize("store", ["exact", "file"])
def test_exact_stores_give_back_every_leaf_as_given(store: str) -> None:
    leaves, keys, values, owners = filled(store)
    got = leaves.gather(None, torch.float64)
    assert torch.equal(got.keys, keys) and torch.equal(got.values, values)
    assert torch.equal(got.owner, owners) and got.valid is None


@pytest.mark.parametrize("store", ["exact", "int8", "file"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gathering_some_slots_gives_their_leaves_in_order_padded_per_head(
    store: str, seed: int
) -> None:
    """Against a plain per-head selection: the leaves owned by the chosen slots, in the order
    they left, each head padded to the longest with invalid entries."""
    leaves, _, _, owners = filled(store, seed)
    every = leaves.gather(None, torch.float64)
    g = torch.Generator().manual_seed(10 + seed)
    chosen = torch.rand(B, HKV, 4, generator=g) < 0.5
    chosen[0, 0] = False  # a head that opens nothing
    got = leaves.gather(chosen, torch.float64)
    assert got.valid is not None
    n = int(max(chosen[b, h][owners[b, h]].sum() for b in range(B) for h in range(HKV)))
    assert got.keys.shape == (B, HKV, n, D) and got.values.shape == (B, HKV, n, DV)
    for b in range(B):
        for h in range(HKV):
            index = [j for j in range(15) if chosen[b, h, owners[b, h, j]]]
            m = len(index)
            assert got.valid[b, h].tolist() == [True] * m + [False] * (n - m)
            assert got.owner[b, h, :m].tolist() == owners[b, h, index].tolist()
            assert torch.equal(got.keys[b, h, :m], every.keys[b, h, index])
            assert torch.equal(got.values[b, h, :m], every.values[b, h, index])


def test_file_leaves_keep_bfloat16_bit_for_bit() -> None:
    ((k, v),) = blocks(4, 1, 3)
    k, v = k.bfloat16(), v.bfloat16()
    leaves = make_leaves("file", k, v)
    leaves.append(k, v, torch.zeros(B, HKV, 3, dtype=torch.long))
    got = leaves.gather(None, torch.bfloat16)
    assert torch.equal(got.keys, k) and torch.equal(got.values, v)


def test_the_exact_store_counts_its_bytes() -> None:
    leaves, *_ = filled("exact")
    assert leaves.nbytes == B * HKV * 15 * ((D + DV) * 8 + 8) and leaves.file_bytes == 0


def test_int8_leaves_come_back_within_half_a_step_in_a_quarter_of_the_bytes() -> None:
    ((k, v),) = blocks(2, 1, 7)
    k[0, 0, 0] = 0.0  # a zero row has no scale to divide by
    v = v * torch.logspace(-3, 3, 7, dtype=torch.float64).view(1, 1, 7, 1)  # rows of all sizes
    leaves = make_leaves("int8", k, v)
    leaves.append(k, v, torch.zeros(B, HKV, 7, dtype=torch.long))
    keys, values, _, _ = leaves.gather(None, torch.float64)
    for x, back in ((k, keys), (v, values)):
        bound = x.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)  # float32 scales round too
        assert bool(((x - back).abs() <= bound).all())
        assert not torch.equal(x, back)  # rounded: this store is not exact
    assert bool((keys[0, 0, 0] == 0).all())
    assert leaves.nbytes == B * HKV * 7 * ((D + DV) * 1 + 2 * 4 + 8)  # codes, scales, owners


def test_file_leaves_keep_only_owners_in_memory_and_remove_their_file(tmp_path) -> None:
    parts = blocks(3, 1, 4)
    leaves = make_leaves("file", *parts[0], directory=str(tmp_path))
    assert isinstance(leaves, FileLeaves)
    for _ in range(5):
        leaves.append(*parts[0], torch.zeros(B, HKV, 4, dtype=torch.long))
    assert leaves.nbytes == B * HKV * 20 * 8  # the owners
    assert leaves.file_bytes == B * HKV * 20 * (D + DV) * 8
    path = leaves.path
    assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) == leaves.file_bytes
    leaves.gather(torch.tensor([True, False]).expand(B, HKV, 2), torch.float64)
    if os.path.exists("/proc/self/maps"):  # read and written, never mapped into memory
        assert path not in Path("/proc/self/maps").read_text()
    del leaves
    gc.collect()
    assert not os.path.exists(path)


def test_an_unknown_store_or_folder_is_refused_naming_the_setting(tmp_path) -> None:
    with pytest.raises(
        ValueError, match=r"KVMFoldConfig\.leaves: must be one of \('exact', 'int8', 'file'\)"
    ):
        KVMFoldConfig(budget=26, sinks=2, window=16, open=2, leaves="fp4")
    with pytest.raises(ValueError, match=r"KVMFoldConfig\.leaf_dir: .* is not a folder"):
        KVMFoldConfig(budget=26, sinks=2, window=16, open=2, leaf_dir=str(tmp_path / "no"))
