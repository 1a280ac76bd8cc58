"""A training run's settings (`TrainConfig`, its named `RECIPES`), the arithmetic its steps use
(`PRECISIONS`), and the optimiser's schedule: AdamW's parameter groups and the learning rate and
weight decay of each step (linear warmup, then linear decay).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from longkv.checks import require, require_at_least, require_known, settings_from_section
from longkv.models import LongKVConfig

MODEL_FIELDS = tuple(
    name
    for name in inspect.signature(LongKVConfig.__init__).parameters
    if name not in ("self", "kwargs")
)  # the settings of a LongKVConfig


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping of one run."""

    steps: int = 100
    batch_size: int = 8  # global: split over the ranks
    lr: float = 1e-3
    warmup: int = 10
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0  # None: no clipping
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's
    scalar_decay: bool = True  # weight decay on 1-D parameters (norms, temperatures, biases)
    decay_follows_lr: bool = False  # weight decay scaled by lr_t / lr_peak every step
    width_scaled: bool = False  # matrices: lr / rho and weight_decay * rho, rho = d_model / 768
    checkpointing: bool = False  # recompute each block in the backward pass (less memory)
    compile: bool = False  # torch.compile each block's feed-forward half (`compile_feedforward`)
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 50
    seed: int = 0
    parallel: str = "ddp"  # under torchrun: "ddp" or "fsdp"
    precision: str = "auto"  # PRECISIONS: the arithmetic of the steps

    def __post_init__(self) -> None:
        at_least_one = ("steps", "batch_size", "eval_every", "eval_batches", "checkpoint_every")
        require_at_least(1, self, *at_least_one)
        require_at_least(0, self, "warmup")
        require(self.lr > 0, self, "lr", f"must be > 0, got {self.lr}")
        require(
            self.grad_clip is None or self.grad_clip > 0, self, "grad_clip",
            f"must be > 0 (or null: no clipping), got {self.grad_clip}",
        )  # fmt: skip
        object.__setattr__(self, "betas", tuple(self.betas))  # YAML gives a list
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), self, "betas",
            f"must be two numbers in [0, 1), got {self.betas}",
        )  # fmt: skip
        require(
            self.parallel in ("ddp", "fsdp"),
            self,
            "parallel",
            f"must be 'ddp' or 'fsdp', got {self.parallel!r}",
        )
        require_known(self, "precision", [self.precision], list(PRECISIONS))
        require(
            self.precision != "bf16" or self.parallel == "ddp", self, "precision",
            "bf16 parameters with float32 master weights run on one process or under ddp; "
            "with fsdp use bf16-autocast",
        )  # fmt: skip

    @classmethod
    def from_section(cls, values: dict[str, Any]) -> TrainConfig:
        """The train section of a run or study file: its fields, or `recipe: NAME` (RECIPES)
        and any fields that change the recipe's."""
        values = dict(values)
        name = values.pop("recipe", None)
        if name is not None:
            require_known(None, "train.recipe", [name], list(RECIPES))
            values = {**RECIPES[name], **values}
        return settings_from_section(cls, "train", values)


# how the steps compute (TrainConfig.precision)
PRECISIONS = {
    "auto": "bf16-autocast on CUDA and on CPUs with bf16 arithmetic (AMX or AVX512-BF16: the "
    "fastest there, results/bench_train_*_2k.md), else fp32",
    "fp32": "the model's dtype (float32 unless the caller gives another)",
    "bf16-autocast": "float32 parameters, matmuls in bfloat16 under torch.autocast",
    "bf16": "bfloat16 parameters and activations, AdamW on float32 master weights (the "
    "paper's): each step copies the masters into the bf16 model and its gradients back",
}


# named optimisation recipes for `train: {recipe: NAME}`; kvm_paper: the KVM paper's (spec
# training.md 1.6, the 3B-token run: 6000 steps; lr and weight decay scale as
# 1 / sqrt(tokens / 3B) for longer runs)
RECIPES: dict[str, dict[str, Any]] = {
    "kvm_paper": dict(
        lr=2e-3,
        weight_decay=0.2,
        warmup=200,
        betas=(0.9, 0.95),
        grad_clip=None,
        scalar_decay=False,
        decay_follows_lr=True,
        width_scaled=True,
    ),
}
WIDTH_BASE = 768  # rho = d_model / WIDTH_BASE


def param_groups(model: nn.Module, cfg: TrainConfig, d_model: int) -> list[dict[str, Any]]:
    """AdamW's parameter groups: "scalars" (1-D: norms, temperatures, token-shift and value
    mixes, biases; weight decay only with cfg.scalar_decay), "embedding" (the input
    embedding) and "matrices" (every other 2-D weight, the output head included; with
    cfg.width_scaled lr / rho and weight decay * rho, rho = d_model / 768). Each group keeps its
    lr_scale and base weight decay, which `schedule` reads every step."""
    rho = d_model / WIDTH_BASE if cfg.width_scaled else 1.0
    embedding = model.get_input_embeddings().weight
    groups: dict[str, list[nn.Parameter]] = {"scalars": [], "embedding": [], "matrices": []}
    for p in model.parameters():
        if p is embedding:
            groups["embedding"].append(p)
        else:
            groups["scalars" if p.dim() < 2 else "matrices"].append(p)
    scale = {"scalars": (1.0, cfg.weight_decay if cfg.scalar_decay else 0.0),
             "embedding": (1.0, cfg.weight_decay),
             "matrices": (1 / rho, cfg.weight_decay * rho)}  # fmt: skip
    return [
        {"params": params, "name": name, "lr_scale": scale[name][0], "decay": scale[name][1]}
        for name, params in groups.items()
        if params
    ]


def schedule(groups: list[dict[str, Any]], cfg: TrainConfig, step: int) -> float:
    """Set each group's lr and weight decay for `step` (0-based); returns the peak lr times
    the schedule's factor (`lr_factor`), the lr a run reports."""
    factor = lr_factor(step, cfg.warmup, cfg.steps)
    for group in groups:
        group["lr"] = cfg.lr * factor * group["lr_scale"]
        group["weight_decay"] = group["decay"] * (factor if cfg.decay_follows_lr else 1.0)
    return cfg.lr * factor


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warmup to 1, then linear decay to 0 at `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / max(1, steps - warmup))


def run_settings(
    model_config: LongKVConfig, cfg: TrainConfig, data: Mapping[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """What a run is made of, by section: model fields, data (what made the rows), train."""
    return {
        "model": {name: getattr(model_config, name) for name in MODEL_FIELDS},
        "data": dict(data or {}),
        "train": asdict(cfg),
    }


def compute_precision(precision: str, device: torch.device) -> str:
    """The precision the steps use on device: `auto` resolved (`PRECISIONS`)."""
    if precision == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16())
        return "bf16-autocast" if fast else "fp32"
    return precision


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (Linux's cpuinfo flags amx_bf16 or
    avx512_bf16); False where it cannot tell."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
