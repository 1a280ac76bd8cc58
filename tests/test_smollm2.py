"""The default model, SmolLM2-135M-Instruct, in float64: the fold is exact on real text, and
generation from a folded cache equals generation from one full-context pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longkv.data.corpus import BUNDLED_CORPUS, read_text
from longkv.fold import FoldRunner, continue_decode, fold_generate, kv_fold
from longkv.models.pretrained import load_pretrained

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2() -> tuple[torch.nn.Module, object]:
    return load_pretrained(dtype=torch.float64)


@pytest.fixture(scope="module")
def text_ids(smollm2: tuple[torch.nn.Module, object]) -> torch.Tensor:
    _, tokenizer = smollm2
    text = read_text("mobydick.txt.gz", BUNDLED_CORPUS)[:20_000]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:1024]  # type: ignore[operator]
    assert len(ids) == 1024
    return torch.tensor([ids])


def test_converted_model_is_a_plain_llama(smollm2: tuple[torch.nn.Module, object]) -> None:
    model, _ = smollm2
    assert model.config.model_type == "llama"
    assert getattr(model.config, "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_fold_equals_full_forward_on_corpus_text(
    smollm2: tuple[torch.nn.Module, object], text_ids: torch.Tensor
) -> None:
    model, _ = smollm2
    with torch.inference_mode():
        full = model(text_ids).logits
    nll = F.cross_entropy(full[:, :-1].transpose(1, 2), text_ids[:, 1:], reduction="none")
    fold = kv_fold(model, text_ids, 256, return_logits=True)
    assert fold.logits is not None
    assert (fold.logits - full).abs().max().item() <= 1e-10
    assert (fold.nll - nll).abs().max().item() <= 1e-10
    assert 2.0 < fold.nll.mean().item() < 5.0  # a real language model on English prose


def test_generation_from_a_folded_cache_equals_full_context(
    smollm2: tuple[torch.nn.Module, object], text_ids: torch.Tensor
) -> None:
    model, _ = smollm2
    prompt = text_ids[:, :600]
    full = FoldRunner(model)  # one pass over the whole prompt
    with torch.inference_mode():
        logits = full.forward(prompt)[:, -1]
    ref = continue_decode(full.forward, logits, 16)
    assert torch.equal(fold_generate(model, prompt, 128, 16), ref)
