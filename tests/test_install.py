"""`pip install longkv` is enough: a wheel built from the repository and installed away from the
checkout imports every subpackage and runs a needle-in-a-haystack sample end to end on the
texts and tokenizer it ships, with no corpus folder configured."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("kvm", "attention", "models", "fold", "evals", "train", "bench", "cli", "data")

# Run by the installed package: argv = site folder, work folder, subpackages.
SCRIPT = """
import importlib, json, sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import longkv
from longkv.cli.main import main
from longkv.train.tokenizer import gpt2_tokenizer

site, work = Path(sys.argv[1]), Path(sys.argv[2])
modules = [longkv, *(importlib.import_module(f"longkv.{name}") for name in sys.argv[3:])]
tokenizer = gpt2_tokenizer()  # the shipped GPT-2 BPE
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
)
LlamaForCausalLM(config).save_pretrained(work / "model")
tokenizer.save_pretrained(work / "model")
argv = [
    "niah", "--model", str(work / "model"), "--lengths", "512", "--depths", "0.5",
    "--methods", "full", "fold", "--chunk-size", "128", "--max-new-tokens", "4",
    "--out-dir", str(work / "out"), "--name", "n",
]
code = main(argv)
print(json.dumps({
    "version": longkv.__version__,
    "outside": [m.__name__ for m in modules if not Path(m.__file__).is_relative_to(site)],
}))
sys.exit(code)
"""


def run(
    argv: list[str | Path], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{argv[:4]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


def test_the_installed_wheel_runs_without_the_checkout(tmp_path: Path) -> None:
    repo = tmp_path / "repo"  # a copy, so that building leaves the checkout as it is
    shutil.copytree(
        ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, repo / name)
    pip: list[str | Path] = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels, repo])
    (wheel,) = wheels.glob("longkv-*.whl")
    bundled = ROOT / "src" / "longkv" / "data" / "bundled"
    shipped = {
        f"longkv/data/bundled/{p.relative_to(bundled)}" for p in bundled.rglob("*") if p.is_file()
    }
    with zipfile.ZipFile(wheel) as z:
        assert shipped <= set(z.namelist()) and len(shipped) == 10  # texts, tokenizer, README
    run([*pip, "install", "--no-deps", "--no-index", "--target", site, wheel])

    work = tmp_path / "work"  # outside the checkout: no ../shared, no src
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LONGKV_", "PYTHON"))}
    env |= {"PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}
    out = run([sys.executable, "-c", SCRIPT, site, work, *SUBPACKAGES], cwd=work, env=env)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert report == {"version": version, "outside": []}  # every module from the wheel
    records = json.loads((work / "out" / "n.json").read_text())["records"]
    # niah_single_2 (the default task) reads its essay haystack from the shipped texts
    assert [(r["task"], r["method"], r["context_len"]) for r in records] == [
        ("niah_single_2", "full", 512),
        ("niah_single_2", "fold", 512),
    ]
    assert all(len(r["answers"]) == 1 and len(r["tokens"]) <= 4 for r in records)
    assert (work / "out" / "n.md").is_file() and (work / "out" / "n.png").is_file()
    usage = run([sys.executable, "-m", "longkv", "--help"], cwd=work, env=env).stdout
    assert usage.startswith("usage: longkv") and "niah" in usage


def test_version_without_installed_metadata() -> None:
    """Sources on sys.path with no distribution installed still give a PEP 440 version."""
    code = (
        "import importlib.metadata as m\n"
        "def missing(name): raise m.PackageNotFoundError(name)\n"
        "m.version = missing\n"
        "import longkv\n"
        "print(longkv.__version__)\n"
    )
    assert run([sys.executable, "-c", code]).stdout.strip() == "0+unknown"
