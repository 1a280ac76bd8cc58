"""Model commands on saved models: a longkv model in niah and fold, any causal LM in generate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import over_tokenizer, tiny_hf, tiny_hf_config, tiny_longkv
from longkv.cli.main import main
from longkv.train.tokenizer import gpt2_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def longkv_dir(tok: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved longkv model with GPT-2's tokenizer beside it, as `longkv train` leaves one."""
    folder = tmp_path_factory.mktemp("longkv") / "model"
    model = tiny_longkv(
        ["kvm", "swa"], "fixed", extras=True, vocab_size=len(tok),
        kvm=dict(chunk_len=16, window_chunks=2, sink_len=1, state_min_len=16, rope_dim=4),
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    model.float().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_niah_runs_a_saved_longkv_model(
    longkv_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "niah", "--model", str(longkv_dir), "--tasks", "passkey", "--lengths", "300",
        "--depths", "0.5", "--chunk-size", "64", "--max-new-tokens", "4", "--dtype", "fp64",
        "--out-dir", str(tmp_path), "--name", "n", "--budgets", "128",
    ]  # fmt: skip
    assert main(argv) == 2  # the default methods include streaming, refused before any answer
    err = capsys.readouterr().err  # after the weights' loading bar
    assert "argument --methods: streaming cannot run on this model" in err
    assert "read it with full or fold" in err and not (tmp_path / "n.json").exists()
    assert main([*argv, "--methods", "full", "fold"]) == 0
    report = json.loads((tmp_path / "n.json").read_text())
    assert report["fold_equals_full"] and [r["method"] for r in report["records"]] == [
        "full",
        "fold",
    ]
    assert all(len(r["tokens"]) <= 4 for r in report["records"])


def test_fold_runs_a_saved_longkv_model(longkv_dir: Path, tmp_path: Path) -> None:
    argv = [
        "fold", "--model", str(longkv_dir), "--tokens", "200", "--chunk-size", "48",
        "--dtype", "fp64", "--out-dir", str(tmp_path), "--name", "f",
    ]  # fmt: skip
    assert main(argv) == 0
    runs = {r["method"]: r for r in json.loads((tmp_path / "f.json").read_text())["runs"]}
    assert runs["fold"]["max_abs_nll_diff_vs_full"] <= 1e-10
    # its own cache (KVM states, windows) counts its bytes; bounded, not every token's keys
    assert 0 < runs["full"]["cache_bytes"] == runs["fold"]["cache_bytes"]


def test_generate_runs_any_causal_lm_as_what_it_is(
    tok: Any, longkv_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llama = tiny_hf(**over_tokenizer(tok), max_position_embeddings=128)
    llama.save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    prompt = "The cat sat on"
    ref = llama.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=6, do_sample=False)
    argv = ["generate", "--prompt", prompt, "--max-new-tokens", "6"]
    assert main([*argv, "--model", str(tmp_path / "llama")]) == 0
    assert capsys.readouterr().out == tok.decode(ref[0], skip_special_tokens=True) + "\n"
    assert main([*argv, "--model", str(longkv_dir), "--sample", "--top-k", "5"]) == 0
    assert capsys.readouterr().out.startswith(prompt)


@pytest.mark.parametrize(
    ("folder", "message"),
    [
        ("/nonexistent", "model '/nonexistent': no such folder"),
        ("empty", "the folder holds no config.json"),
        ("unknown", "has model type `nope` but Transformers does not recognize this"),
        ("no-weights", "no file named model.safetensors"),
    ],
)
def test_generate_refuses_what_is_not_a_causal_lm_in_one_line(
    folder: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text('{"model_type": "nope"}')
    tiny_hf_config().save_pretrained(tmp_path / "no-weights")
    path = folder if folder.startswith("/") else str(tmp_path / folder)
    assert main(["generate", "--model", path, "--prompt", "x"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("longkv: error: model ") and message in captured.err


@pytest.mark.parametrize("command", ["generate", "ask"])
def test_answer_lengths_are_refused_before_a_model_is_looked_for(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model does not exist: the length is refused first, naming its option."""
    text = ["--prompt", "x"] if command == "generate" else ["--file", "-", "--question", "x"]
    argv = [command, "--model", "/nonexistent/model", *text, "--max-new-tokens", "-3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "argument --max-new-tokens: must be >= 1, got -3" in err and "nonexistent" not in err


def test_models_lists_the_cache_with_sizes_and_removes_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`longkv models`: the named models by their --model name, models converted from GGUF
    files and GGUF files by their names, each with its size; --remove takes one away, and an
    unknown name is refused listing the names there are."""
    monkeypatch.setenv("LONGKV_CACHE", str(tmp_path))
    (tmp_path / "gemma-3-270m").mkdir()
    (tmp_path / "gemma-3-270m" / "model.safetensors").write_bytes(b"\0" * 3 * 2**20)
    (tmp_path / "gguf" / "tiny-0123456789ab").mkdir(parents=True)
    (tmp_path / "gguf" / ".tiny-partial").mkdir()  # a conversion under way: not listed
    (tmp_path / "gguf-files").mkdir()
    (tmp_path / "gguf-files" / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"\0" * 2**20)
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{tmp_path} ($LONGKV_CACHE): 3 entries"
    assert [line.split()[:3] for line in lines[1:]] == [
        ["gemma3", "3", "MiB"], ["tiny-0123456789ab", "0", "MiB"],
        ["gemma-3-270m-q4_k_m.gguf", "1", "MiB"],
    ]  # fmt: skip
    assert main(["models", "--remove", "gemma3"]) == 0
    assert "removed gemma3 (3 MiB)" in capsys.readouterr().out
    assert not (tmp_path / "gemma-3-270m").exists()
    assert main(["models", "--remove", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "argument --remove: no cached model is called 'smollm2' (there are: " in err
    assert "tiny-0123456789ab, gemma-3-270m-q4_k_m.gguf)" in err
