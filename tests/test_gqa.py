"""The grouped SDPA attention (`longkv.models.gqa`): the same fold as transformers' SDPA in
float64 on Llama, Qwen2 and Gemma 3 (sliding layers included), without repeating the KV heads,
and the attention the models longkv loads run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.integrations import sdpa_attention

from conftest import tiny_hf
from longkv.fold.fold import kv_fold
from longkv.models.gqa import NAME, PLAIN, use_gqa_sdpa
from longkv.models.pretrained import load_model


def refuse_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make transformers' repeat of the KV heads fail, so a read that repeats them fails."""

    def refused(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
        raise AssertionError(f"repeat_kv({tuple(hidden.shape)}, {n_rep})")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", refused)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_grouped_sdpa_folds_as_transformers_sdpa_without_repeating_kv_heads(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_hf(arch, torch.float64)  # 4 query heads over 2 KV heads
    assert model.config._attn_implementation == PLAIN
    ids = torch.randint(0, 97, (1, 70), generator=torch.Generator().manual_seed(7))
    want = kv_fold(model, ids, 16)  # chunks after the first attend under a mask
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == NAME
    refuse_repeats(monkeypatch)
    got = kv_fold(model, ids, 16)
    torch.testing.assert_close(got.nll, want.nll, rtol=0, atol=1e-10)
    torch.testing.assert_close(got.last_logits, want.last_logits, rtol=0, atol=1e-10)
    with pytest.raises(AssertionError, match="repeat_kv"):  # the refusal bites on the plain path
        model.set_attn_implementation(PLAIN)
        kv_fold(model, ids, 16)


def test_an_eager_model_keeps_its_attention() -> None:
    model = tiny_hf("llama")
    model.set_attn_implementation("eager")
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_models_longkv_loads_attend_through_grouped_sdpa(
    weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LONGKV_CACHE", str(tmp_path / "cache"))
    tiny_hf("llama").save_pretrained(tmp_path / "m")
    model = load_model(str(tmp_path / "m"), weights=weights)
    assert model.config._attn_implementation == NAME
    refuse_repeats(monkeypatch)
    kv_fold(model, torch.arange(40)[None], 16)
