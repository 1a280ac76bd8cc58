"""Weight-only int8 (`longkv.models.int8`): the quantization's bound, each module against its
dequantized reference in float64, and whole tiny Llama, Qwen2 and Gemma 3 models (tied and
untied output layers) against the same models holding the dequantized weights, read by the
fold."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import tiny_hf
from longkv.checks import SettingError
from longkv.fold.fold import kv_fold
from longkv.models.int8 import (
    Int8Embedding,
    Int8Linear,
    dequantize,
    group_of,
    held_tensors,
    quantize,
    quantize_model,
)
from longkv.models.pretrained import int8_file, load_model


def test_quantization_moves_each_weight_by_at_most_half_its_groups_scale() -> None:
    sizes = torch.logspace(-3, 1, 6, dtype=torch.float64)[:, None]
    w = torch.randn(6, 64, dtype=torch.float64) * sizes
    w[2, :32] = 0.0  # a group of zeros
    q, scale = quantize(w, 32)
    assert q.dtype == torch.int8 and scale.shape == (6, 2) and scale[2, 0] == 1.0
    err = (dequantize(q, scale, torch.float64) - w).abs().view(6, 2, 32)
    assert bool((err <= scale.double()[..., None] / 2 * (1 + 1e-6)).all())
    assert bool((dequantize(q, scale, torch.float64)[2, :32] == 0).all())
    # weights already on the grid come back exactly
    grid = dequantize(q, scale, torch.float64)
    assert torch.equal(dequantize(*quantize(grid, 32), torch.float64), grid)
    assert group_of(64) == 32 and group_of(48) == 48  # a width 32 does not divide: one per row


@pytest.mark.parametrize("block", [4, 1000])
def test_an_int8_linear_is_the_linear_of_its_dequantized_weight(block: int) -> None:
    linear = nn.Linear(64, 10, dtype=torch.float64)
    layer = Int8Linear.of(linear, 32, block)
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    w = dequantize(layer.qweight, layer.scale, torch.float64)
    want = nn.functional.linear(x, w, linear.bias)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-10)
    assert layer.weight.shape == (10, 64) and layer(x.float()).dtype == torch.float32


def test_an_int8_embedding_looks_up_its_dequantized_rows_times_its_scale() -> None:
    table = nn.Embedding(50, 64, dtype=torch.float64)
    table.embed_scale = torch.tensor(8.0, dtype=torch.float64)  # as Gemma's embedding has
    layer = Int8Embedding.of(table, 32)
    ids = torch.tensor([[3, 49, 0, 3]])
    rows = dequantize(layer.qweight, layer.scale, torch.float64)[ids] * 8.0
    torch.testing.assert_close(layer(ids), rows, rtol=0, atol=1e-10)


def dequantized_twin(model: nn.Module) -> nn.Module:
    """A copy of model whose linear and embedding weights are replaced by what int8 keeps."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for module in twin.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                w = module.weight
                w.copy_(dequantize(*quantize(w, 32), w.dtype))
    return twin


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False), ("qwen2", False),
                                            ("gemma3", True)])  # fmt: skip
def test_an_int8_model_reads_as_the_model_of_its_dequantized_weights(arch: str, tied: bool) -> None:
    model = tiny_hf(arch, torch.float64, tie_word_embeddings=tied)
    twin = dequantized_twin(model)
    quantize_model(model, 32, block=40)  # the output layer of 97 rows in three blocks
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    assert (head.qweight is table.qweight) == tied
    ids = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(5))
    got, want = kv_fold(model, ids, 16), kv_fold(twin, ids, 16)
    torch.testing.assert_close(got.nll, want.nll, rtol=0, atol=1e-10)
    torch.testing.assert_close(got.last_logits, want.last_logits, rtol=0, atol=1e-10)
    assert all(p.dtype == torch.float64 for p in model.parameters())  # norms, biases


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int8_weights_load_from_their_file_as_quantized_in_memory(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LONGKV_CACHE", str(tmp_path / "cache"))
    tiny_hf(arch, tie_word_embeddings=True).save_pretrained(tmp_path / "m")
    want = quantize_model(load_model(str(tmp_path / "m")))
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(6))
    for first in (True, False):
        model = load_model(str(tmp_path / "m"), weights="int8")
        assert ("quantizing" in capsys.readouterr().err) == first  # once, then from the file
        assert model.get_output_embeddings().qweight is model.get_input_embeddings().qweight
        assert set(held_tensors(model)) == set(held_tensors(want))
        for name, t in held_tensors(want).items():
            assert torch.equal(held_tensors(model)[name], t), name
        assert torch.equal(kv_fold(model, ids, 16).nll, kv_fold(want, ids, 16).nll)
    assert int8_file(str(tmp_path / "m")).is_file()
    with pytest.raises(SettingError, match="int8 weights compute in float32 on one device"):
        load_model(str(tmp_path / "m"), torch.bfloat16, weights="int8")
