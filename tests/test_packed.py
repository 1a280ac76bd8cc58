"""The packed cache layer (`longkv.fold.packed`): against transformers' DynamicLayer on random
chunks in float64, narrower storage against its plain reference, crops and copies; the fold
with a packed cache against the fold with transformers' on tiny Llama, Qwen2 and Gemma 3."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from conftest import tiny_hf
from longkv.caches.fork import fork
from longkv.checks import SettingError
from longkv.document.read import read
from longkv.fold.fold import kv_fold
from longkv.fold.packed import PackedLayer, Scratch
from longkv.train.tokenizer import gpt2_tokenizer


def chunks(sizes: list[int], dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, ...]]:
    """Random (keys, values) of (1, 2, L, 4) per size."""
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(1, 2, L, 4, generator=g, dtype=dtype),
         torch.randn(1, 2, L, 4, generator=g, dtype=dtype))
        for L in sizes
    ]  # fmt: skip


@pytest.mark.parametrize("capacity", [0, 7, 40, 1000])
def test_a_packed_layer_returns_what_a_dynamic_layer_returns(capacity: int) -> None:
    plain, packed = DynamicLayer(), PackedLayer(None, capacity)
    for k, v in chunks([5, 1, 9, 300, 1, 2]):
        want, got = plain.update(k, v), packed.update(k, v)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g)
        assert torch.equal(plain.keys, packed.keys) and torch.equal(plain.values, packed.values)
        assert plain.get_seq_length() == packed.get_seq_length()
    assert packed.stored is not None and packed.stored.keys.shape[-2] >= 318
    # written in place: one storage for every update once it is large enough
    before = packed.stored.keys.data_ptr()
    packed.update(*chunks([1])[0])
    assert packed.stored.keys.data_ptr() == before


def test_narrower_storage_rounds_the_earlier_rows_once_and_keeps_the_forwards_own() -> None:
    packed = PackedLayer(torch.float16, 0)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for k, v in chunks([3, 4, 2]):
        got = packed.update(k, v)
        earlier = [torch.cat([s[i] for s in seen], dim=-2) if seen else k[..., :0, :]
                   for i in (0, 1)]  # fmt: skip
        for i, new in enumerate((k, v)):
            want = torch.cat([earlier[i].half().double(), new], dim=-2)
            assert got[i].dtype == torch.float64 and torch.equal(got[i], want)
        seen.append((k, v))
    assert packed.keys.dtype == torch.float16
    assert torch.equal(packed.keys, torch.cat([s[0] for s in seen], dim=-2).half())


def test_layers_sharing_a_scratch_each_widen_their_own_rows() -> None:
    scratch = Scratch()
    layers = [PackedLayer(torch.float16, 0, scratch) for _ in range(2)]
    plain = [DynamicLayer() for _ in range(2)]
    for step, (k, v) in enumerate(chunks([3, 4, 300, 2])):
        for i in range(2):  # one forward: every layer in turn
            k_i, v_i = k + i, v - i
            got = layers[i].update(k_i, v_i)
            want = plain[i].update(k_i.half().double(), v_i.half().double())
            n = want[0].shape[-2] - k.shape[-2]  # the forward's own rows are not rounded
            for g, w, own in zip(got, want, (k_i, v_i), strict=True):
                assert torch.equal(g[..., :n, :], w[..., :n, :]) and torch.equal(g[..., n:, :], own)
            assert got[0].data_ptr() == (
                scratch.keys.data_ptr()  # type: ignore[union-attr]
            ), step


def test_a_crop_then_an_update_matches_transformers_and_reuses_the_storage() -> None:
    plain, packed = DynamicLayer(), PackedLayer(None, 64)
    for k, v in chunks([10, 6]):
        plain.update(k, v), packed.update(k, v)
    plain.crop(-4), packed.crop(-4)
    before = packed.stored.keys.data_ptr()  # type: ignore[union-attr]
    k, v = chunks([3])[0]
    for w, g in zip(plain.update(k, v), packed.update(k, v), strict=True):
        assert torch.equal(w, g)
    assert packed.stored.keys.data_ptr() == before  # type: ignore[union-attr]


def forked(layer: PackedLayer) -> PackedLayer:
    """A copy as `longkv.caches.fork` makes one: the rows shown shared."""
    return copy.deepcopy(layer, {id(layer.keys): layer.keys, id(layer.values): layer.values})


def test_a_fork_writes_after_the_reads_rows_in_place_unless_a_living_one_holds_them() -> None:
    read = PackedLayer(None, 64)
    for k, v in chunks([10, 6]):
        read.update(k, v)
    kept = read.keys.clone()
    first = forked(read)
    first.update(*chunks([5])[0])  # a question: written in place after the read's 16 rows
    assert first.stored is read.stored and torch.equal(read.keys, kept)
    longer = first.keys.clone()
    second = forked(read)  # while the first lives: its rows 16..20 are not the second's
    second.update(*chunks([3])[0])
    assert second.stored is not read.stored and torch.equal(first.keys, longer)
    assert torch.equal(second.keys[..., :16, :], kept) and torch.equal(read.keys, kept)
    del first, second
    gc.collect()
    third = forked(read)  # nobody holds rows past the read's now
    third.update(*chunks([2])[0])
    assert third.stored is read.stored and torch.equal(read.keys, kept)


def test_a_saved_layer_keeps_the_rows_written_not_the_storage() -> None:
    packed = PackedLayer(None, 64)
    for k, v in chunks([10, 6]):
        packed.update(k, v)
    loaded = pickle.loads(pickle.dumps(packed))
    assert loaded.stored is None and torch.equal(loaded.keys, packed.keys)
    loaded.update(*chunks([5])[0])
    assert loaded.stored is not packed.stored and loaded.get_seq_length() == 21


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_the_fold_with_a_packed_cache_is_the_fold(arch: str) -> None:
    model = tiny_hf(arch, torch.float64)
    ids = torch.randint(0, 97, (1, 120), generator=torch.Generator().manual_seed(2))
    plain = kv_fold(model, ids, 16)
    same = kv_fold(model, ids, 16, cache_dtype=torch.float64)
    assert torch.allclose(plain.nll, same.nll, rtol=0, atol=1e-10)
    kinds = {type(layer) for layer in same.cache.layers}
    assert PackedLayer in kinds and DynamicLayer not in kinds
    if arch == "gemma3":  # sliding layers keep transformers' window
        assert DynamicSlidingWindowLayer in kinds


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_keeps_the_folds_nll_within_its_tolerance(
    arch: str, dtype: torch.dtype
) -> None:
    """The stated tolerance: a mean NLL within 1e-3 of the float32 cache's (docs/memory.md)."""
    model = tiny_hf(arch, torch.float32)
    ids = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(3))
    wide = kv_fold(model, ids, 32).nll.double().mean()
    narrow = kv_fold(model, ids, 32, cache_dtype=dtype)
    packed = [layer for layer in narrow.cache.layers if isinstance(layer, PackedLayer)]
    assert packed and all(layer.keys.dtype == dtype for layer in packed)
    assert abs(float(narrow.nll.double().mean() - wide)) <= 1e-3
    assert not torch.equal(narrow.nll, kv_fold(model, ids, 32).nll)  # the rounding is there


def test_a_read_with_a_packed_cache_answers_as_a_plain_one_each_time() -> None:
    tok = gpt2_tokenizer()
    model = tiny_hf("llama", torch.float64, vocab_size=len(tok))
    ids = torch.randint(0, len(tok), (200,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = read(model, tok, ids, "fold", chat=False, progress=False, chunk_size=64)
    packed = read(
        model, tok, ids, "fold", chat=False, progress=False, chunk_size=64, cache_dtype="fp64"
    )
    want = plain.answer([5, 6], 8, stop_at_repeat=False).tokens
    layer = packed.runner.cache.layers[0]
    assert layer.stored.keys.shape[-2] == 200 + 1024  # room for questions
    question = fork(packed.runner)  # what an answer reads through: it writes in place
    question.forward(torch.tensor([[5, 6]]))
    assert question.cache.layers[0].stored is layer.stored and layer.get_seq_length() == 200
    assert packed.answer([5, 6], 8, stop_at_repeat=False).tokens == want
    assert packed.answer([5, 6], 8, stop_at_repeat=False).tokens == want  # the read unchanged


def test_a_cache_dtype_is_refused_for_a_bounded_read_and_an_unknown_one_named() -> None:
    tok = gpt2_tokenizer()
    model = tiny_hf("llama", torch.float32, vocab_size=len(tok))
    with pytest.raises(SettingError, match="keeps its own entries; a cache dtype is for full"):
        read(model, tok, [1, 2, 3], "streaming", chat=False, cache_dtype="fp16")
    with pytest.raises(SettingError, match="cache_dtype: must be None or one of"):
        read(model, tok, [1, 2, 3], "fold", chat=False, cache_dtype="half")
