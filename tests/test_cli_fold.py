"""`longkv fold`, `longkv drift` and `longkv niah` end to end on the default model, small sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longkv.cli.main import main

pytestmark = pytest.mark.smollm2


def test_fold_command_compares_methods(tmp_path: Path) -> None:
    argv = [
        "fold", "--tokens", "300", "--chunk-size", "64", "--dtype", "fp64",
        "--methods", "full", "fold", "streaming",
        "--budgets", "104", "--stream-chunk", "16", "--out-dir", str(tmp_path), "--name", "f",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "f.json").read_text())
    runs = {r["method"]: r for r in report["runs"]}
    assert runs["fold"]["max_abs_nll_diff_vs_full"] <= 1e-10
    assert runs["streaming@104"]["max_abs_nll_diff_vs_full"] > 1e-3  # its cache holds 104 entries
    assert set(report["ratios"]) == {
        "fold / full time", "fold / full peak memory",
        "streaming@104 / full time", "streaming@104 / full peak memory",
    }  # fmt: skip
    assert report["provenance"]["command"].startswith("longkv fold")
    assert "| fold / full time |" in (tmp_path / "f.md").read_text()


def test_drift_command_writes_table_and_plot(tmp_path: Path) -> None:
    argv = [
        "drift", "--tokens", "256", "--chunk-sizes", "64", "--dtypes", "fp64",
        "--variants", "exact", "bos", "--out-dir", str(tmp_path), "--name", "d",
    ]  # fmt: skip
    assert main(argv) == 0
    runs = json.loads((tmp_path / "d.json").read_text())["runs"]
    assert [(r["chunk_size"], r["variant"]) for r in runs] == [(64, "exact"), (64, "bos")]
    exact = [f - r for f, r in zip(runs[0]["fold_nll"], runs[0]["full_nll"], strict=True)]
    assert max(abs(d) for d in exact) <= 1e-10
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 64 | float64 | bos | 4 |" in (tmp_path / "d.md").read_text()
    argv = [*argv[:6], "fp64", "fp32", "bf16", "--variants", "bf16-cache", *argv[10:]]
    assert main(argv) == 0
    runs = json.loads((tmp_path / "d.json").read_text())["runs"]
    assert [(r["dtype"], r["variant"]) for r in runs] == [
        ("float64", "bf16-cache"),
        ("float32", "bf16-cache"),
    ]  # in bf16 there is nothing to round
    assert "Left out: bf16-cache in bf16" in (tmp_path / "d.md").read_text()


def test_niah_command_reports_and_plots(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = [
        "niah", "--tasks", "passkey", "--lengths", "600", "--depths", "0.5",
        "--methods", "full", "fold", "--chunk-size", "128", "--max-new-tokens", "6",
        "--out-dir", str(tmp_path), "--name", "n",
    ]  # fmt: skip
    assert main(argv) == 0
    assert "The fold's answers equal full attention's on every sample." in capsys.readouterr().out
    page = (tmp_path / "n.md").read_text()
    assert "| passkey | fold |" in page and (tmp_path / "n.png").is_file()
