"""`longkv tokenizer train`, `train`, `eval-loss` and `generate` on a tiny model and corpus."""

from __future__ import annotations

import csv
import gzip
import json
import shlex
from pathlib import Path

import pytest
import yaml

from longkv.cli.main import main
from longkv.train import loop
from longkv.train.run import load_run, model_config
from longkv.train.tokenizer import gpt2_tokenizer, load_tokenizer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_kvm.yaml"


@pytest.fixture
def tiny_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Overrides of CONFIG for a 3-step run of a tiny model on a tiny corpus and its own BPE."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        with gzip.open(corpus / f"d{i}.txt.gz", "wt") as f:
            f.write(f"The cat sat on the mat number {i}. " * 60)
    bpe = tmp_path / "bpe"
    argv = ["tokenizer", "train", "--out", str(bpe), "--vocab-size", "300"]
    assert main([*argv, "--corpus-dir", str(corpus), "--every", "4"]) == 0
    learned = int(capsys.readouterr().out.split(" tokens")[0])  # at most 300 on this tiny text
    assert 257 < learned <= 300
    return [
        f"data.folder={corpus}", f"data.tokenizer={bpe}", "data.seq_len=32", "data.every=4",
        "train.steps=3",
        "train.batch_size=2", "train.warmup=1", "train.eval_every=3", "train.eval_batches=1",
        "model.d_model=32", "model.n_layers=2", f"out_dir={tmp_path / 'run'}",
        "model.kvm={chunk_len: 8, window_chunks: 2, state_min_len: 8, rope_dim: 4}",
    ]  # fmt: skip


def test_train_then_eval_and_generate(
    tmp_path: Path, tiny_run: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out, overrides = tmp_path / "run", tiny_run
    learned = len(load_tokenizer(tmp_path / "bpe"))
    assert main(["train", "--config", str(CONFIG), *overrides]) == 0
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [r["step"] for r in rows] == ["1", "2", "3"] and rows[-1]["eval_loss"]
    assert (out / "model" / "model.safetensors").is_file()
    assert json.loads((out / "model" / "config.json").read_text())["vocab_size"] == learned
    generation = json.loads((out / "model" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == load_tokenizer(tmp_path / "bpe").eos_token_id
    assert main(["eval-loss", "--config", str(CONFIG), *overrides, "--batches", "1"]) == 0
    assert "held-out loss" in capsys.readouterr().out
    assert main(["eval-loss", "--config", str(out / "run.yaml"), "--batches", "1"]) == 0
    assert "over 1 batches of 2" in capsys.readouterr().out  # the run's own batch size
    assert (
        main(
            [
                "generate",
                "--model",
                str(out / "model"),
                "--prompt",
                "The cat",
                "--max-new-tokens",
                "5",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("The cat")  # decoded by the model's own BPE


def test_eval_loss_refuses_a_config_that_is_not_the_runs(
    tmp_path: Path, tiny_run: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--config", str(CONFIG), *tiny_run]) == 0
    other = [*tiny_run, "data.seq_len=16", "train.batch_size=4"]  # another run's settings
    assert main(["eval-loss", "--config", str(CONFIG), *other]) == 2
    err = capsys.readouterr().err
    assert "(data.seq_len: 32 -> 16; train.batch_size: 2 -> 4; recorded -> given)" in err
    assert f"--config {tmp_path / 'run' / 'run.yaml'}" in err


def test_ctrl_c_says_where_the_checkpoint_is_and_how_to_resume(
    tmp_path: Path,
    tiny_run: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch_rows = loop.batch_rows

    def ctrl_c_at_step_4(step: int, *args: int) -> object:
        if step == 3:  # steps 1-3 done, checkpoint at step 2
            raise KeyboardInterrupt
        return batch_rows(step, *args)

    monkeypatch.setattr(loop, "batch_rows", ctrl_c_at_step_4)
    argv = ["train", "--config", str(CONFIG), *tiny_run, "train.steps=5"]
    assert main([*argv, "train.checkpoint_every=2"]) == 130
    command = shlex.join(["longkv", *argv, "train.checkpoint_every=2"])
    checkpoint = tmp_path / "run" / "checkpoint.pt"
    assert capsys.readouterr().err.endswith(
        f"longkv train: interrupted after step 3 of 5; {checkpoint} holds step 2, the 1 after it "
        f"will be redone; resume with: {command}\n"
    )
    monkeypatch.undo()
    assert main(shlex.split(command)[1:]) == 0  # the command it gave resumes the run
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert [r["step"] for r in rows] == ["1", "2", "3", "4", "5"]
    monkeypatch.setattr(loop, "batch_rows", ctrl_c_at_step_4)
    assert main([*argv, "train.steps=6", f"out_dir={tmp_path / 'new'}"]) == 130
    assert (
        "interrupted after step 3 of 6, before the first checkpoint (train.checkpoint_every=50); "
        "nothing to resume; rerun with: longkv train"
    ) in capsys.readouterr().err


def test_overrides_and_bad_runs(capsys: pytest.CaptureFixture[str]) -> None:
    run = load_run(str(CONFIG), ["train.steps=7", "model.mixer=full", "data.seq_len=64"])
    assert run["train"]["steps"] == 7 and run["model"]["mixer"] == "full"
    with pytest.raises(ValueError, match="write key=value"):
        load_run(str(CONFIG), ["train.steps"])
    with pytest.raises(ValueError, match="unknown sections"):
        load_run(str(CONFIG), ["optimiser.lr=1"])
    assert main(["train", "--config", str(CONFIG), "model.preset=huge"]) == 2
    assert main(["train", "--config", str(CONFIG), "data.seqlen=64"]) == 2
    assert main(["train", "--config", str(CONFIG), "train.parallel=zero"]) == 2
    assert main(["train", "--config", str(CONFIG), "model=tiny"]) == 2
    err = capsys.readouterr().err
    assert "data: unknown keys ['seqlen']" in err and "TrainConfig.parallel: must be" in err
    assert "model: must be a mapping of keys to values, got 'tiny'" in err
    with pytest.raises(ValueError, match="model: unknown keys") as refused:  # not a kwarg
        model_config({"prest": "tiny", "mixer": "full"}, gpt2_tokenizer())
    assert str(refused.value).startswith(
        "model: unknown keys ['prest']; use ['bos_token_id', 'bswa_chunk_len',"
    )
    # the preset among LongKVConfig's fields
    assert "'preset', 'residual_scale', 'rope_base'" in str(refused.value)


def test_training_without_a_corpus_says_which_setting_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LONGKV_CORPUS_DIR", raising=False)  # no training corpus is shipped
    assert main(["train", "--config", str(CONFIG), f"out_dir={tmp_path}"]) == 2
    assert main(["tokenizer", "train", "--out", str(tmp_path / "bpe")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and not any(tmp_path.iterdir())
    for line in errors:
        assert line.startswith("longkv: error: no training corpus")
        assert "data.folder=PATH" in line and "LONGKV_CORPUS_DIR=PATH" in line


def test_dry_run_prints_the_paper_models_counts_and_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LONGKV_CORPUS_DIR", raising=False)  # it needs no data
    argv = ["train", "--config", str(CONFIG), "--dry-run", f"out_dir={tmp_path / 'run'}"]
    assert main([*argv, "model.preset=paper_120m_kvm_sqrt16"]) == 0
    assert main([*argv, "model.preset=paper_350m_kvm_swa_saturation"]) == 0
    small, large = capsys.readouterr().out.splitlines()
    assert small == (
        "model paper_120m_kvm_sqrt16: 12 kvm layers, d_model 768, vocabulary 50304; parameters: "
        "embedding 38.6M, head 38.6M, blocks 85.6M, total 162.9M"
    )
    assert "24 kvm/swa layers, d_model 1024" in large and "blocks 303.8M" in large
    assert not any(tmp_path.iterdir())
    paper = CONFIG.parent / "paper_120m.yaml"  # the paper's run: its data is never read here
    assert main(["train", "--config", str(paper), "--dry-run"]) == 0
    assert capsys.readouterr().out == small + "\n"


def test_bench_train_measures_every_variant_and_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "bench", "train", "--contexts", "128", "--repeats", "1", "--vocab-size", "97",
        "--out-dir", str(tmp_path),
    ]  # fmt: skip
    assert main([*argv, "--name", "bt"]) == 0
    report = json.loads((tmp_path / "bt.json").read_text())
    others = ("kvm_fixed", "kvm_sqrt", "kvm_saturation", "ovq", "bswa")
    assert {r["variant"] for r in report["rows"]} == {*others, "full"}
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_bytes"] is None for r in report["rows"])
    assert set(report["ratios"]) == {f"{v} / full tokens/s, fp32 at 128" for v in others}
    modes = ["fp32", "bf16", "bf16-autocast+checkpointing"]
    more = ["--variants", "kvm_sqrt", "full", "--modes", *modes, "--memory", "--no-interleave"]
    assert main([*argv, *more, "--name", "modes"]) == 0
    report = json.loads((tmp_path / "modes.json").read_text())
    assert [(r["variant"], r["mode"]) for r in report["rows"]] == [
        (v, m) for v in ("kvm_sqrt", "full") for m in modes
    ]
    # Linux measures it: a step allocates its gradients (the last step's are freed first)
    assert all(r["peak_memory_bytes"] > 0 for r in report["rows"])
    assert "kvm_sqrt bf16 / fp32 tokens/s at 128" in report["ratios"]
    assert main([*argv, "--modes", "fp16+compile"]) == 2
    assert "--modes: 'fp16+compile': a precision of" in capsys.readouterr().err


def test_compare_runs_scores_every_run_on_the_same_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"d{i}.txt").write_text(f"Document {i} says the same thing. " * 80)
    configs = []
    for mixer in ("full", "kvm"):
        run = {
            "model": {"preset": "tiny", "mixer": mixer, "d_model": 32, "n_layers": 2,
                      "kvm": {"chunk_len": 8, "window_chunks": 2, "state_min_len": 8,
                              "rope_dim": 4}},
            "data": {"folder": str(corpus), "seq_len": 32, "every": 3},
            "train": {"steps": 4, "batch_size": 2, "warmup": 1, "eval_every": 2},
            "out_dir": str(tmp_path / mixer),
        }  # fmt: skip
        configs.append(tmp_path / f"{mixer}.yaml")
        configs[-1].write_text(yaml.safe_dump(run))
        assert main(["train", "--config", str(configs[-1])]) == 0
    argv = ["compare-runs", "--configs", *map(str, configs), "--out-dir", str(tmp_path)]
    assert main([*argv, "--batches", "3", "--name", "c"]) == 0
    capsys.readouterr()
    assert main([*argv, "--batches", "2", "--name", "c"]) == 2  # would replace another run's page
    err = capsys.readouterr().err
    assert "argument --name: " in err and "c.json holds a run of other settings (batches" in err
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["settings"] == {"configs": list(map(str, configs)), "batches": 3}
    full, kvm = report["runs"]
    assert (full["label"], kvm["label"]) == ("full", "kvm") and kvm["mixers"] == ["kvm", "kvm"]
    assert full["held_out_tokens"] == kvm["held_out_tokens"] == 3 * 2 * 32
    assert full["train_tokens"] == 4 * 2 * 32 and 0 < kvm["train_seconds"]
    assert full["held_out_loss"] != kvm["held_out_loss"]
    page = (tmp_path / "c.md").read_text()
    assert "| full | full |" in page and "+0.00 % |" in page
    assert f"- kvm: `longkv train --config {configs[1]}` at commit " in page
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    edited = yaml.safe_load(configs[1].read_text())
    edited["train"]["batch_size"] = 4  # edited after training: not what scored the run
    edited["data"]["seq_len"] = 16
    configs[1].write_text(yaml.safe_dump(edited))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--configs {configs[1]}: not the settings of the run in {tmp_path / 'kvm'}" in err
    assert "(data.seq_len: 32 -> 16; train.batch_size: 2 -> 4; recorded -> given)" in err
    assert f"use the run's own: --configs {tmp_path / 'kvm' / 'run.yaml'}" in err
    short = yaml.safe_load(configs[0].read_text())  # trained on other data
    short["data"]["seq_len"], short["out_dir"] = 16, str(tmp_path / "short")
    short["train"].update(steps=1, eval_every=1)
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(short))
    assert main(["train", "--config", str(tmp_path / "short.yaml")]) == 0
    assert main([*argv[:2], str(configs[0]), str(tmp_path / "short.yaml")]) == 2
    assert "(short: data.seq_len: 32 -> 16; full -> that run)" in capsys.readouterr().err
    (tmp_path / "short" / "run.yaml").unlink()  # as if unfinished
    assert main([*argv[:2], str(configs[0]), str(tmp_path / "short.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"--configs {tmp_path / 'short.yaml'}: no finished run in {tmp_path / 'short'}" in err
    assert len(err.splitlines()) == 1
