"""A training run's checkpoint: its file name, the settings a resumed run may change and how
run settings are compared, an atomic save, a load that refuses other settings, and the model and
AdamW state it restores."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from longkv.results import replaced_atomically

CHECKPOINT = "checkpoint.pt"
# Settings a resumed run may change: the length of the run and its bookkeeping (the checkpoint
# holds gathered state dicts, the same whatever the parallelism). Anything else is refused.
RESUMABLE = (
    "train.steps", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
    "train.parallel",
)  # fmt: skip


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, old, new) for every leaf that differs; nested mappings are compared by key."""
    changed = []
    for key in [*old, *(k for k in new if k not in old)]:
        a, b = old.get(key, "(unset)"), new.get(key, "(unset)")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            changed += [(f"{key}.{k}", x, y) for k, x, y in differences(a, b)]
        elif a != b:
            changed.append((key, a, b))
    return changed


def describe(changed: list[tuple[str, Any, Any]]) -> str:
    """`key: old -> new; ...` for the output of differences."""
    return "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changed)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """torch.save through a temporary file and a rename: never a half-written checkpoint."""
    with replaced_atomically(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path, settings: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint at path; refused if its run settings differ from `settings` (see
    `longkv.train.config.run_settings`) outside RESUMABLE, or its step is past settings'
    train.steps."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise ValueError(
            f"checkpoint {path} is unreadable ({err}); delete it or pass another out dir"
        ) from err
    if "settings" not in state:
        raise ValueError(
            f"checkpoint {path} records no run settings (an older longkv wrote it); resume it "
            "with that version, or pass another out_dir"
        )
    refused = [d for d in differences(state["settings"], settings) if d[0] not in RESUMABLE]
    if refused:
        raise ValueError(
            f"checkpoint {path} was written with other settings ({describe(refused)}); resume "
            f"with the settings that wrote it, or pass another out_dir (only "
            f"{', '.join(RESUMABLE)} may change on resume)"
        )
    steps = settings["train"]["steps"]
    if state["step"] > steps:
        raise ValueError(
            f"checkpoint {path} is at step {state['step']}, past train.steps={steps}; pass "
            f"train.steps >= {state['step']}, or another out_dir"
        )
    return state


def load_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Model and AdamW state from a checkpoint's gathered state dicts, exactly as saved.

    A parameter that never received a gradient (a KVM merge gate whose rows never overflow the
    window, say) has no optimizer state. The loader would refuse that unless not strict, and
    then invent one (step 1, zero moments); it is dropped again, so that such a parameter, as
    in the run that wrote the checkpoint, starts its state at its first gradient.
    """
    set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(
        model, optimizer, state["optimizer"],
        options=StateDictOptions(full_state_dict=True, strict=False),
    )  # fmt: skip
    for name, param in model.named_parameters():
        if name not in state["optimizer"]["state"]:
            optimizer.state.pop(param, None)
