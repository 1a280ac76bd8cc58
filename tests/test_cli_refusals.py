"""Every command that reads with a bounded cache reports each refusal a model can earn under
its own option (`--methods`, or ask's `--method`; `--budgets`), with the reason, before it
reads anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from conftest import over_tokenizer, tiny_hf_config, tiny_longkv
from longkv.cli.main import main
from longkv.train.tokenizer import gpt2_tokenizer

SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
# the model of each refusal, as (factory of the model given the tokenizer) and its reason
REFUSALS: dict[str, tuple[Any, str]] = {
    "learned": (
        lambda tok: GPT2LMHeadModel(
            GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=512)
        ),
        "its positions are learned embeddings",
    ),
    "dynamic": (
        lambda tok: LlamaForCausalLM(
            tiny_hf_config(
                **over_tokenizer(tok),
                max_position_embeddings=512,
                rope_parameters={"rope_type": "dynamic", "factor": 2.0},
            )
        ),
        "rope_type 'dynamic'",
    ),
    "all sliding": (
        lambda tok: MistralForCausalLM(
            MistralConfig(vocab_size=len(tok), sliding_window=8, **SMALL)
        ),
        "every layer attends a sliding window",
    ),
    "softcap": (
        lambda tok: Gemma2ForCausalLM(
            Gemma2Config(vocab_size=len(tok), head_dim=8, attn_logit_softcapping=50.0, **SMALL)
        ),
        "does not soft-cap attention logits",
    ),
    "longkv": (
        lambda tok: tiny_longkv(
            ["kvm", "swa"],
            "fixed",
            vocab_size=len(tok),
            kvm=dict(chunk_len=16, window_chunks=2, sink_len=1, state_min_len=16, rope_dim=4),
        ).float(),
        "carries KVM states and window caches",
    ),
    "budget": (  # read with a budget of 1024
        lambda tok: LlamaForCausalLM(
            tiny_hf_config(**over_tokenizer(tok), max_position_embeddings=512)
        ),
        "streaming@1024: a budget of 1024 cache positions exceeds the model's "
        "max_position_embeddings = 512",
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A saved folder per refusal, with the GPT-2 tokenizer."""
    tok = gpt2_tokenizer()
    folders = {}
    for name, (factory, _) in REFUSALS.items():
        folder = tmp_path_factory.mktemp(name.replace(" ", "_"))
        torch.manual_seed(0)
        factory(tok).save_pretrained(folder)
        tok.save_pretrained(folder)
        folders[name] = folder
    return folders


def argv_of(command: str, model: Path, tmp: Path, budget: int) -> tuple[list[str], str]:
    """A run of `command` on `model` with streaming at `budget` and the option it names its
    methods with."""
    bounded = ["--budgets", str(budget), "--stream-chunk", "8", "--out-dir", str(tmp)]
    if command == "ask":
        (tmp / "doc.txt").write_text("A short document.")
        args = ["--file", str(tmp / "doc.txt"), "--question", "What?", "--method", "streaming"]
        return ["ask", "--model", str(model), *args, *bounded[:4]], "--method"
    if command == "serve":  # refused at start, before it listens
        return ["serve", "--model", str(model), "--method", "streaming", *bounded[:4]], "--method"
    # longer than the budget, which would otherwise hold every token and be refused for that
    needles = ["--tasks", "passkey", "--lengths", str(max(200, 2 * budget)), "--depths", "0.5"]
    if command == "fold":
        args = ["--tokens", "128", "--methods", "streaming"]
    elif command == "niah":
        args = [*needles, "--methods", "streaming"]
    else:
        args = [*needles, "--methods", "streaming", "--nll-tokens", "128"]
    return [command, "--model", str(model), *args, *bounded], "--methods"


@pytest.mark.parametrize("command", ["fold", "niah", "bounded", "ask", "serve"])
@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_each_command_reports_each_refusal_under_its_own_option(
    command: str, refusal: str, models: dict[str, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    budget = 1024 if refusal == "budget" else 64
    argv, option = argv_of(command, models[refusal], tmp_path, budget)
    if refusal == "budget":
        option = "--budget" if command in ("ask", "serve") else "--budgets"  # one, singular
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: " in err, err
    assert REFUSALS[refusal][1] in err, err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("*.json"))
