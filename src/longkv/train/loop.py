"""The training loop: AdamW with warmup and linear decay, clipping, eval, checkpoints, DDP.

The batch of step s is a function of (seed, s) alone, so a run resumed from a checkpoint (model,
optimizer, schedule, step) replays exactly the batches it would have seen. Under torchrun each
rank takes its slice of the global batch and DistributedDataParallel averages the gradients.
"""

from __future__ import annotations

import csv
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

from longkv.checks import require
from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.results import replaced_atomically

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping of one run."""

    steps: int = 100
    batch_size: int = 8  # global: split over the ranks
    lr: float = 1e-3
    warmup: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "checkpoint_every"):
            value = getattr(self, name)
            require(value >= 1, f"TrainConfig.{name}", f"must be >= 1, got {value}")
        for name in ("lr", "grad_clip"):
            value = getattr(self, name)
            require(value > 0, f"TrainConfig.{name}", f"must be > 0, got {value}")
        require(self.warmup >= 0, "TrainConfig.warmup", f"must be >= 0, got {self.warmup}")


def world() -> tuple[int, int]:
    """(rank, world size): from torchrun's environment, else (0, 1)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def batch_rows(step: int, n_rows: int, batch_size: int, seed: int) -> Tensor:
    """Row indices of the global batch of `step`: a seeded permutation per epoch, in order."""
    per_epoch = n_rows // batch_size
    if per_epoch < 1:
        raise ValueError(f"batch_size {batch_size} exceeds the {n_rows} training rows")
    epoch, i = divmod(step, per_epoch)
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[i * batch_size : (i + 1) * batch_size]


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warmup to 1, then linear decay to 0 at `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / max(1, steps - warmup))


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """torch.save through a temporary file and a rename: never a half-written checkpoint."""
    with replaced_atomically(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path, model_config: LongKVConfig, train: TrainConfig) -> dict[str, Any]:
    """The checkpoint at path, refused unless it was written by the same model and run config."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise ValueError(
            f"checkpoint {path} is unreadable ({err}); delete it or pass another out dir"
        ) from err
    if state.get("model_config") != model_config.to_dict() or state.get("train") != asdict(train):
        raise ValueError(
            f"checkpoint {path} was written by another model or training config; use a new "
            "out dir, or the settings that wrote it"
        )
    return state


def train(
    model_config: LongKVConfig,
    cfg: TrainConfig,
    train_rows: Tensor,
    held_out_rows: Tensor,
    out_dir: str | Path,
    *,
    stop_after: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[dict[str, float]]:
    """Train (or resume) and return the metrics rows; stop_after simulates an interruption.

    A row per step: step, loss, lr, eval_loss (on eval steps) and seconds (wall time of the
    training steps so far, evaluations included, checkpoint writes not; carried across resumes).
    """
    rank, size = world()
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if cfg.batch_size % size:
        raise ValueError(f"batch_size {cfg.batch_size} is not divisible by {size} ranks")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = LongKVForCausalLM(model_config).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps)
    )
    metrics: list[dict[str, float]] = []
    start = 0
    checkpoint = out / CHECKPOINT
    if checkpoint.is_file():
        state = load_checkpoint(checkpoint, model_config, cfg)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        start, metrics = state["step"], state["metrics"]
    net = torch.nn.parallel.DistributedDataParallel(model) if size > 1 else model
    local = cfg.batch_size // size
    elapsed = metrics[-1]["seconds"] if metrics else 0.0  # training time, resumes included
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    for step in tqdm(range(start, end), desc="train", unit="step", disable=rank != 0):
        t0 = time.perf_counter()
        rows = train_rows[batch_rows(step, len(train_rows), cfg.batch_size, cfg.seed)]
        mine = rows[rank * local : (rank + 1) * local]
        loss = _next_token_loss(net, mine)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        row = {"step": step + 1, "loss": _mean_over_ranks(loss.detach(), size)}
        row["lr"] = schedule.get_last_lr()[0]
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            row["eval_loss"] = evaluate(model, held_out_rows, cfg.eval_batches, local)
        elapsed += time.perf_counter() - t0
        row["seconds"] = elapsed
        metrics.append(row)
        if rank == 0 and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == end):
            save_checkpoint(
                checkpoint,
                {
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), "step": step + 1, "metrics": metrics,
                    "model_config": model_config.to_dict(), "train": asdict(cfg),
                },
            )  # fmt: skip
            write_metrics(out / "metrics.csv", metrics)
        if size > 1:
            dist.barrier()
    if rank == 0 and end == cfg.steps:  # the finished model, for generate and eval-loss
        model.save_pretrained(out / "model")
    return metrics


def _next_token_loss(net: torch.nn.Module, rows: Tensor) -> Tensor:
    """Cross entropy of rows[:, 1:] given rows[:, :-1]."""
    logits = net(rows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())


def _mean_over_ranks(value: Tensor, size: int) -> float:
    if size > 1:
        value = value.clone()
        dist.all_reduce(value)
        value /= size
    return float(value)


@torch.no_grad()
def evaluate(model: LongKVForCausalLM, rows: Tensor, batches: int, batch_size: int) -> float:
    """Mean next-token loss over the first `batches` batches of held-out rows."""
    losses = [
        float(_next_token_loss(model, rows[i * batch_size : (i + 1) * batch_size]))
        for i in range(min(batches, math.ceil(len(rows) / batch_size)))
    ]
    return sum(losses) / len(losses)


def write_metrics(path: Path, metrics: list[dict[str, float]]) -> None:
    """All metrics rows as CSV (rewritten atomically)."""
    with replaced_atomically(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "lr", "eval_loss", "seconds"])
        writer.writeheader()
        writer.writerows(metrics)
