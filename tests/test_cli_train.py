"""`longkv train`, `eval-loss` and `generate` on a tiny model and a tiny corpus."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import pytest

from longkv.cli.main import main
from longkv.cli.train import load_run

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_kvm.yaml"


def test_train_then_eval_and_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        with gzip.open(corpus / f"d{i}.txt.gz", "wt") as f:
            f.write("The cat sat on the mat. " * 60)
    out = tmp_path / "run"
    overrides = [
        f"data.folder={corpus}", "data.seq_len=32", "data.every=4", "train.steps=3",
        "train.batch_size=2", "train.warmup=1", "train.eval_every=3", "train.eval_batches=1",
        "model.d_model=32", "model.n_layers=2", f"out_dir={out}",
        "model.kvm={chunk_len: 8, window_chunks: 2, state_min_len: 8, rope_dim: 4}",
    ]  # fmt: skip
    assert main(["train", "--config", str(CONFIG), *overrides]) == 0
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [r["step"] for r in rows] == ["1", "2", "3"] and rows[-1]["eval_loss"]
    assert (out / "model" / "model.safetensors").is_file()
    assert main(["eval-loss", "--config", str(CONFIG), *overrides, "--batches", "1"]) == 0
    assert "held-out loss" in capsys.readouterr().out
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
    assert capsys.readouterr().out.startswith("The cat")


def test_overrides_and_bad_runs() -> None:
    run = load_run(str(CONFIG), ["train.steps=7", "model.mixer=full", "data.seq_len=64"])
    assert run["train"]["steps"] == 7 and run["model"]["mixer"] == "full"
    with pytest.raises(ValueError, match="write key=value"):
        load_run(str(CONFIG), ["train.steps"])
    with pytest.raises(ValueError, match="unknown sections"):
        load_run(str(CONFIG), ["optimiser.lr=1"])
    assert main(["train", "--config", str(CONFIG), "model.preset=huge"]) == 2


def test_bench_train_measures_every_variant(tmp_path: Path) -> None:
    import json

    argv = [
        "bench", "train", "--contexts", "128", "--repeats", "1", "--vocab-size", "97",
        "--out-dir", str(tmp_path), "--name", "bt",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "bt.json").read_text())
    assert {r["variant"] for r in report["rows"]} == {"kvm_fixed", "kvm_sqrt", "bswa", "full"}
    assert all(r["tokens_per_s"] > 0 for r in report["rows"])
    assert set(report["ratios"]) == {
        f"{v} / full tokens/s at 128" for v in ("kvm_fixed", "kvm_sqrt", "bswa")
    }
