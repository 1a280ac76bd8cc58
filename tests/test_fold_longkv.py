"""KV-Fold on longkv's own models: the fold is their chunked prefill, equal to one full forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_longkv
from longkv.caches import streaming_llm
from longkv.fold import compat, fold_generate, kv_fold
from longkv.kvm.functional import _non_rotary

V, T = 53, 45
LAYOUTS = {"hybrid": ["kvm", "swa", "kvm", "bswa"], "full-kvm": ["full", "kvm"]}


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("chunk", [1, 7, 16, T])
def test_fold_equals_full_forward(layout: str, chunk: int) -> None:
    model = tiny_longkv(LAYOUTS[layout], "fixed", extras=True, vocab_size=V)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
    fold = kv_fold(model, ids, chunk, return_logits=True)
    assert fold.logits is not None and (fold.logits - full).abs().max().item() <= 1e-10
    assert (fold.nll - token_nll(full, ids)).abs().max().item() <= 1e-10
    assert fold.next_position == fold.cache.get_seq_length() == T


def test_fold_continues_from_its_cache_and_inserts_prefixes() -> None:
    model = tiny_longkv(LAYOUTS["hybrid"], "sqrt", extras=True, vocab_size=V)
    ids = torch.randint(2, V, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
    first = kv_fold(model, ids[:, :20], 8)
    rest = kv_fold(model, ids[:, 20:], 8, cache=first.cache, return_logits=True)
    assert rest.logits is not None and (rest.logits - full[:, 20:]).abs().max().item() <= 1e-10
    bos = torch.tensor([1])  # [bos, chunk 0, bos, chunk 1, ...] as one stream
    stream = torch.cat([torch.cat([bos[None], c], 1) for c in ids.split(20, 1)], 1)
    with torch.no_grad():
        whole = model(stream).logits
    real = torch.ones(stream.shape[1], dtype=torch.bool)
    real[[0, 21, 42]] = False
    fold = kv_fold(model, ids, 20, prefix_ids=bos, return_logits=True)
    assert fold.logits is not None and (fold.logits - whole[:, real]).abs().max().item() <= 1e-10


def test_greedy_generation_from_a_fold_equals_generate() -> None:
    model = tiny_longkv(LAYOUTS["hybrid"], "saturation", extras=True, vocab_size=V)
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(3))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10)
    assert torch.equal(fold_generate(model, ids, 7, max_new_tokens=10), ref[:, 30:])


def test_streaming_and_offloading_are_refused() -> None:
    model = tiny_longkv(LAYOUTS["hybrid"], vocab_size=V)
    ids = torch.randint(0, V, (1, 20))
    with pytest.raises(ValueError, match=r"StreamingLLM evicts .* LongKVForCausalLM carries KVM"):
        streaming_llm(model, ids, sinks=2, window=8)
    with pytest.raises(ValueError, match="offload_cache: LongKVForCausalLM carries a LongKVCache"):
        compat.new_cache(model, offload=True)


def test_a_fold_leaves_the_model_trainable() -> None:
    """What the fold's inference mode first computes and caches is usable by autograd later."""
    _non_rotary.cache_clear()  # the shared key mask is made on first use: here, in the fold
    model = tiny_longkv(LAYOUTS["hybrid"], vocab_size=V)
    ids = torch.randint(0, V, (1, 20))
    kv_fold(model, ids, 8)
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.model.layers[0].mixer.parameters())
