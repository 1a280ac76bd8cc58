"""Fold variants: each departs from the exact fold in exactly the way it claims (tiny Llama)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from conftest import TINY_HF, tiny_hf
from longkv.fold import FoldRunner, fold_generate, kv_fold
from longkv.fold.attention import visible_keys
from longkv.fold.compat import CACHE_ARG
from longkv.fold.drift import DriftResult, depth_bins, plateau_table
from longkv.models import LongKVConfig, LongKVForCausalLM

V, T = TINY_HF["vocab_size"], 60


IDS = torch.randint(2, V, (2, T), generator=torch.Generator().manual_seed(3))


def folded(variant: str, chunk: int, model: LlamaForCausalLM | None = None) -> torch.Tensor:
    """(B, T, V) logits of a fold of IDS under the variant."""
    model = tiny_hf(dtype=torch.float64) if model is None else model
    logits = kv_fold(model, IDS, chunk, variant=variant, return_logits=True).logits
    assert logits is not None
    return logits


def by_hand(
    model: LlamaForCausalLM,
    chunk: int,
    mask: str | None = None,
    position: int | None = None,
    cache: DynamicCache | None = None,
) -> torch.Tensor:
    """(B, T, V) logits of IDS fed chunk by chunk through the model's own attention with an
    explicit 4D boolean mask (`visible_keys`) and position ids (absolute, or mod `position`)."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    out = []
    with torch.no_grad():
        for start in range(0, T, chunk):
            ids = IDS[:, start : start + chunk]
            L = ids.shape[1]
            pos = torch.arange(start, start + L).expand(2, L)
            pos = pos if position is None else pos % position
            kwargs = {}
            if mask is not None:
                kwargs["attention_mask"] = visible_keys(mask, L, start + L)[None, None]
            out.append(
                model(input_ids=ids, position_ids=pos, **{CACHE_ARG: cache}, **kwargs).logits
            )
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("chunk", [1, 7, 16, T])
def test_the_exact_fold_still_equals_one_forward(chunk: int) -> None:
    model = tiny_hf(dtype=torch.float64)
    assert (folded("exact", chunk, model) - folded("exact", T, model)).abs().max() <= 1e-10


@pytest.mark.parametrize("chunk", [7, 16])
def test_restart_equals_positions_from_zero_in_every_chunk(chunk: int) -> None:
    model = tiny_hf(dtype=torch.float64)
    got = folded("restart", chunk, model)
    # one forward over the whole input (a cache, so no packed-sequence mask) with the positions
    # restarting every chunk
    ref = by_hand(model, T, position=chunk)
    assert (got - ref).abs().max() <= 1e-10
    assert (got - folded("exact", chunk, model)).abs().max() > 1e-6


@pytest.mark.parametrize(("variant", "mask"), [("top-left", "top-left"),
                                               ("chunk-excluded", "past-and-self")])  # fmt: skip
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_attention_variants_equal_their_explicit_masks(variant: str, mask: str, chunk: int) -> None:
    model = tiny_hf(dtype=torch.float64)
    got = folded(variant, chunk, model)
    assert (got - by_hand(model, chunk, mask=mask)).abs().max() <= 1e-10
    exact = folded("exact", chunk, model)
    if chunk == 1:  # one query per chunk sees the whole cache under every mask but top-left
        assert ((got - exact).abs().max() <= 1e-10) == (variant == "chunk-excluded")
    else:
        assert (got - exact).abs().max() > 1e-6
    if variant == "top-left":  # the first chunk has no cache: its mask is the causal one
        assert (got[:, :chunk] - exact[:, :chunk]).abs().max() <= 1e-10


def test_explicit_masks() -> None:
    assert visible_keys("causal", 2, 4).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert visible_keys("top-left", 2, 4).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0]]
    assert visible_keys("past-and-self", 2, 4).tolist() == [[1, 1, 1, 0], [1, 1, 0, 1]]


class RoundingLayer:
    """Wraps a cache layer's update so the layer stores bfloat16-rounded keys and values."""

    def __init__(self, update):  # type: ignore[no-untyped-def]
        self.update = update

    def __call__(self, k, v, *args, **kwargs):  # type: ignore[no-untyped-def]
        def rounded(x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.bfloat16).to(x.dtype)

        return self.update(rounded(k), rounded(v), *args, **kwargs)


@pytest.mark.parametrize("chunk", [1, 16])
def test_bf16_cache_equals_a_cache_that_stores_bfloat16(chunk: int) -> None:
    model = tiny_hf(dtype=torch.float64)
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        layer.update = RoundingLayer(layer.update)
    got = folded("bf16-cache", chunk, model)
    assert (got - by_hand(model, chunk, cache=cache)).abs().max() <= 1e-10
    assert (got - folded("exact", chunk, model)).abs().max() > 1e-6


def test_float32_softmax_changes_only_the_kernel() -> None:
    model = tiny_hf(dtype=torch.float64)  # float64: the same math as the model's kernel
    assert (folded("float32-softmax", 16, model) - folded("exact", 16, model)).abs().max() <= 1e-10
    model = model.to(torch.bfloat16)  # the softmax now runs wider than the model's kernel
    assert (folded("float32-softmax", 16, model) - folded("exact", 16, model)).abs().max() > 1e-3


def test_bos_variant_inserts_the_models_bos() -> None:
    model = tiny_hf(dtype=torch.float64)
    got = kv_fold(model, IDS, 16, variant="bos").nll
    ref = kv_fold(model, IDS, 16, prefix_ids=torch.tensor([model.config.bos_token_id])).nll
    assert torch.equal(got, ref)


def test_restart_decodes_at_positions_mod_the_chunk() -> None:
    model = tiny_hf(dtype=torch.float64)
    ids = IDS[:1, :44]
    with torch.no_grad():  # one forward over prompt and answer, positions mod 16
        ref = model(
            input_ids=ids, position_ids=torch.arange(44)[None] % 16, **{CACHE_ARG: DynamicCache()}
        ).logits
    fold = kv_fold(model, ids[:, :40], 16, variant="restart")
    runner = FoldRunner(model, fold.cache, fold.next_position, variant="restart", chunk_size=16)
    with torch.no_grad():  # the answer token by token, as decoding feeds it
        steps = torch.cat([runner.forward(ids[:, i : i + 1]) for i in range(40, 44)], dim=1)
    assert (steps - ref[:, 40:]).abs().max() <= 1e-10
    tokens = fold_generate(model, ids[:, :40], 16, 4, variant="restart")
    assert tokens[0, 0] == ref[0, 39].argmax()


def test_the_positions_a_prefix_inserts_count_against_the_models() -> None:
    """40 tokens in chunks of 16 take 40 positions, 43 with a BOS per chunk ('bos') and 46 with
    a 2-token prefix per chunk: refused past a model of 42 (or 45) positions."""
    model = tiny_hf(dtype=torch.float64, max_position_embeddings=42)
    ids = IDS[:, :40]
    kv_fold(model, ids, 16)  # 40 fit
    with pytest.raises(ValueError, match="take 43 positions"):
        kv_fold(model, ids, 16, variant="bos")
    model = tiny_hf(dtype=torch.float64, max_position_embeddings=45)
    kv_fold(model, ids, 16, variant="bos")
    with pytest.raises(ValueError, match="take 46 positions"):
        kv_fold(model, ids, 16, prefix_ids=torch.tensor([1, 2]))


def test_bad_variants_are_refused() -> None:
    model = tiny_hf(dtype=torch.float64)
    with pytest.raises(ValueError, match="variant: 'sideways' is not one of"):
        kv_fold(model, IDS, 16, variant="sideways")
    with pytest.raises(ValueError, match="prefix_ids: a per-chunk prefix is itself a variant"):
        kv_fold(model, IDS, 16, variant="restart", prefix_ids=torch.tensor([1]))
    with pytest.raises(ValueError, match="computes in bfloat16 already"):
        kv_fold(model.to(torch.bfloat16), IDS, 16, variant="bf16-cache")
    with pytest.raises(ValueError, match="chunk_size: the 'restart' variant"):
        FoldRunner(model, variant="restart")
    longkv = LongKVForCausalLM(LongKVConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match="'top-left' changes transformers' attention"):
        kv_fold(longkv, IDS, 16, variant="top-left")


def test_drift_is_averaged_over_depth_bins() -> None:
    r = DriftResult(16, "float32", "exact", [float(i) for i in range(9)], [0.0] * 9, 1.0)
    assert r.depth_means() == [1.0, 2.5, 5.5, 8.0]  # depths 1, 2-3, 4-7, 8
    assert r.depth_centres() == [1.0, 2.5, 5.5, 8.0]  # the last bin holds depth 8 alone
    assert depth_bins(4) == ["1", "2-3", "4-7", "8-15"]


def test_the_plateau_is_the_mean_past_depth_7_and_its_deeper_half_minus_its_shallower() -> None:
    # drift 5 at depths 0-7 (left out), then 1.0 at depths 8-11 and 1.5 at depths 12-15
    drift = [5.0] * 8 + [1.0] * 4 + [1.5] * 4
    fp32 = DriftResult(16, "float32", "bos", drift, [0.0] * 16, 1.0)
    assert fp32.plateau() == (1.25, 0.5)
    assert DriftResult(16, "float32", "bos", [0.0] * 9, [0.0] * 9, 1.0).plateau() is None
    bf16 = DriftResult(16, "bfloat16", "bos", [2 * d for d in drift], [0.0] * 16, 1.0)
    short = DriftResult(256, "float32", "bos", [0.0] * 4, [0.0] * 4, 1.0)
    table = plateau_table([fp32, bf16, short])
    assert "| 16 | bos | +1.25e+00 | +5.0e-01 | +2.50e+00 | +1.0e+00 | 2 |" in table
    assert "| 256 |" not in table  # too few chunks for a plateau
    fp32_only = plateau_table([fp32, bf16, DriftResult(16, "float32", "bf16-cache", drift,
                                                       [0.0] * 16, 1.0)])  # fmt: skip
    assert "| 16 | bf16-cache | +1.25e+00 | +5.0e-01 |  |  |  |" in fp32_only  # bf16 left it out
