"""`longkv eval`: lm-evaluation-harness on a longkv model, offline, with task files over local
JSON data: every request type, any batch size, the model's own numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from longkv.cli.main import main
from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.train.tokenizer import gpt2_tokenizer

pytest.importorskip("lm_eval")
from longkv.evals.harness import run_harness  # needs lm_eval

TASKS = {  # name -> (rows, the task file's own lines)
    "longkv_mc": (
        [
            {"question": f"Question {i}: what is {i} plus {i}?", "choices": [str(2 * i),
             str(2 * i + 1), "a blue sky"], "answer": i % 3}
            for i in range(5)
        ],
        [
            "output_type: multiple_choice", 'doc_to_text: "{{question}}"',
            'doc_to_choice: "{{choices}}"', 'doc_to_target: "{{answer}}"', "metric_list:",
            "  - {metric: acc, aggregation: mean, higher_is_better: true}",
        ],
    ),
    "longkv_ppl": (
        [{"text": "The cat sat on the mat. " * (i + 1)} for i in range(3)],
        [
            "output_type: loglikelihood_rolling", 'doc_to_text: ""',
            'doc_to_target: "{{text}}"', "metric_list:",
            "  - {metric: byte_perplexity, aggregation: weighted_perplexity, "
            "higher_is_better: false}",
        ],
    ),
    "longkv_gen": (
        [
            {"prompt": p, "answer": "x"}
            for p in ("One two three", "Four five six", "Seven", "A longer prompt of more words",
                      "Eight nine")
        ],
        [
            "output_type: generate_until", 'doc_to_text: "{{prompt}}"',
            'doc_to_target: "{{answer}}"',
            'generation_kwargs: {until: ["\\n"], max_gen_toks: 6, do_sample: false}',
            "metric_list:", "  - {metric: exact_match, aggregation: mean, higher_is_better: true}",
        ],
    ),
}  # fmt: skip


def write_tasks(folder: Path) -> None:
    """Each task of TASKS as a YAML over its rows in a JSON lines file beside it."""
    folder.mkdir()
    for name, (rows, lines) in TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        head = [f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
                f"    test: {data}", "test_split: test"]  # fmt: skip
        (folder / f"{name}.yaml").write_text("\n".join([*head, *lines]) + "\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random KVM model with the GPT-2 tokenizer, saved."""
    path = tmp_path_factory.mktemp("harness") / "model"
    tok = gpt2_tokenizer()
    config = LongKVConfig.tiny(
        vocab_size=len(tok), d_model=32, n_layers=2, n_heads=2, eos_token_id=tok.eos_token_id,
        kvm=dict(chunk_len=4, window_chunks=2, state_min_len=4, rope_dim=8),
    )  # fmt: skip
    torch.manual_seed(0)
    LongKVForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def own_loglikelihood(model: LongKVForCausalLM, context: list[int], target: list[int]) -> float:
    """log p(target | context) from the model's logits over context + target, one forward."""
    ids = torch.tensor([context + target])
    with torch.no_grad():
        logp = model(ids[:, :-1]).logits.log_softmax(-1)[0]
    return sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(target))


def responses(samples: dict[str, list[dict[str, Any]]], task: str) -> list[Any]:
    return [s["resps"] for s in samples[task]]


def test_lm_eval_answers_as_the_model_itself_at_any_batch_size(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tasks(tmp_path / "tasks")
    names = list(TASKS)
    alone = run_harness(
        str(model_dir), names, include_path=str(tmp_path / "tasks"), log_samples=True
    )["samples"]
    argv = ["eval", "--model", str(model_dir), "--tasks", *names, "--include-path",
            str(tmp_path / "tasks"), "--batch-size", "3", "--log-samples", "--out-dir",
            str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    assert "longkv_mc" in capsys.readouterr().out
    batched = json.loads((tmp_path / "out" / "eval.json").read_text())["samples"]
    assert (tmp_path / "out" / "eval.md").is_file()
    model = LongKVForCausalLM.from_pretrained(model_dir).eval()
    tok = gpt2_tokenizer()
    # generate_until: batches of 3 left-padded prompts answer as each prompt alone, and as the
    # model's own greedy decoding
    assert responses(batched, "longkv_gen") == responses(alone, "longkv_gen")
    for sample in alone["longkv_gen"]:
        ids = torch.tensor([tok(sample["arguments"][0][0])["input_ids"]])
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        text = tok.decode(out[0, ids.shape[1] :]).split("\n")[0].split("<|endoftext|>")[0]
        assert sample["resps"] == [[text]]
    # loglikelihoods: batch 3 as batch 1 (float32 GEMMs of other shapes), and as the model's
    for task in ("longkv_mc", "longkv_ppl"):
        for a, b in zip(alone[task], batched[task], strict=True):
            got = [float(r[0][0] if task == "longkv_mc" else r[0]) for r in a["resps"]]
            assert got == pytest.approx([float(r[0][0] if task == "longkv_mc" else r[0])
                                         for r in b["resps"]], abs=1e-4)  # fmt: skip
            for (context, *target), ll in zip(a["arguments"], got, strict=True):
                if task == "longkv_mc":  # the continuation after the context's tokens
                    ctx = tok(context)["input_ids"]
                    whole = tok(context + target[0])["input_ids"]
                    own = own_loglikelihood(model, ctx, whole[len(ctx) :])
                else:  # rolling: every token after the prefix token (eos for GPT-2)
                    own = own_loglikelihood(model, [tok.eos_token_id], tok(context)["input_ids"])
                assert ll == pytest.approx(own, abs=1e-4)


def test_eval_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--tasks", "x", "--include-path", str(tmp_path / "none")]) == 2
    assert "--include-path: " in capsys.readouterr().err
    (tmp_path / "eval.json").write_text(json.dumps({"settings": {"tasks": ["y"]}}))
    assert main(["eval", "--tasks", "x", "--out-dir", str(tmp_path)]) == 2  # another run's page
    err = capsys.readouterr().err
    assert "argument --name: " in err and "eval.json holds a run of other settings" in err
    assert json.loads((tmp_path / "eval.json").read_text()) == {"settings": {"tasks": ["y"]}}
