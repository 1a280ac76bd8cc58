"""The training loop: AdamW with warmup and linear decay, clipping, eval, checkpoints, DDP/FSDP.

The batch of step s is a function of (seed, s) alone, so a run resumed from a checkpoint (model,
optimizer, schedule, step) replays exactly the batches it would have seen. Under torchrun each
rank takes its slice of the global batch; DistributedDataParallel averages the gradients, or
FSDP (`fully_shard` per block) shards parameters, gradients and optimizer state. Each process
uses the GPU of its LOCAL_RANK when CUDA is available (bf16 autocast unless amp=False), else
the CPU in the model's dtype.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from tqdm import tqdm

from longkv.checks import require, require_at_least
from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.results import replaced_atomically

CHECKPOINT = "checkpoint.pt"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered, on rank 0's CPU


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
    parallel: str = "ddp"  # under torchrun: "ddp" or "fsdp"
    amp: bool = True  # bf16 autocast on CUDA (CPU runs stay in the model's dtype)

    def __post_init__(self) -> None:
        at_least_one = ("steps", "batch_size", "eval_every", "eval_batches", "checkpoint_every")
        require_at_least(1, "TrainConfig", self, *at_least_one)
        require_at_least(0, "TrainConfig", self, "warmup")
        for name in ("lr", "grad_clip"):
            value = getattr(self, name)
            require(value > 0, f"TrainConfig.{name}", f"must be > 0, got {value}")
        require(
            self.parallel in ("ddp", "fsdp"),
            "TrainConfig.parallel",
            f"must be 'ddp' or 'fsdp', got {self.parallel!r}",
        )


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


def train_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def distribute(
    model: LongKVForCausalLM, parallel: str, size: int, device: torch.device
) -> nn.Module:
    """The module the steps run through: the model (one process), DDP, or FSDP over its blocks."""
    if size == 1:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def tensorboard_writer(out: Path, first_step: int) -> Any:
    """A SummaryWriter in out/tensorboard when tensorboard is installed, else None.

    Events at steps >= first_step (the first this process logs) are purged: an interrupted run
    logged them after its last checkpoint, and the resumed run logs them again.
    """
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(out / "tensorboard"), purge_step=first_step)


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
    """Train (or resume) on rows (N, seq_len + 1) and return the metrics rows.

    A row per step: step, loss, lr, eval_loss (on eval steps) and seconds (wall time of the
    training steps so far, evaluations included, checkpoint writes not; carried across resumes).
    stop_after simulates an interruption.
    """
    rank, size = world()
    device = train_device()
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if cfg.batch_size % size:
        raise ValueError(f"batch_size {cfg.batch_size} is not divisible by {size} ranks")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = LongKVForCausalLM(model_config).to(device=device, dtype=dtype)
    net = distribute(model, cfg.parallel, size, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup, cfg.steps)
    )
    metrics: list[dict[str, float]] = []
    start = 0
    checkpoint = out / CHECKPOINT
    if checkpoint.is_file():
        state = load_checkpoint(checkpoint, model_config, cfg)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"],
            optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True),
        )  # fmt: skip
        schedule.load_state_dict(state["schedule"])
        start, metrics = state["step"], state["metrics"]
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=cfg.amp and device.type == "cuda"
    )
    writer = tensorboard_writer(out, start + 1) if rank == 0 else None  # rows count from 1
    local = cfg.batch_size // size
    elapsed = metrics[-1]["seconds"] if metrics else 0.0  # training time, resumes included
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    for step in tqdm(range(start, end), desc="train", unit="step", disable=rank != 0):
        t0 = time.perf_counter()
        rows = train_rows[batch_rows(step, len(train_rows), cfg.batch_size, cfg.seed)]
        mine = rows[rank * local : (rank + 1) * local].to(device)
        with autocast:
            loss = _next_token_loss(net, mine)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        row = {"step": step + 1, "loss": _mean_over_ranks(loss.detach(), size)}
        row["lr"] = schedule.get_last_lr()[0]
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            with autocast:
                row["eval_loss"] = evaluate(net, held_out_rows, cfg.eval_batches, cfg.batch_size)
        elapsed += time.perf_counter() - t0
        row["seconds"] = elapsed
        metrics.append(row)
        if writer is not None:
            for key in ("loss", "lr", "eval_loss"):
                if key in row:
                    writer.add_scalar(key, row[key], step + 1)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end:
            model_state, optim_state = get_state_dict(model, optimizer, options=FULL)
            if rank == 0:
                save_checkpoint(
                    checkpoint,
                    {
                        "model": model_state, "optimizer": optim_state,
                        "schedule": schedule.state_dict(), "step": step + 1, "metrics": metrics,
                        "model_config": model_config.to_dict(), "train": asdict(cfg),
                    },
                )  # fmt: skip
                write_metrics(out / "metrics.csv", metrics)
                if writer is not None:
                    writer.flush()
        if size > 1:
            dist.barrier()
    if writer is not None:
        writer.close()
    if end == cfg.steps:  # the finished model, for generate and eval-loss
        model_state = get_model_state_dict(model, options=FULL)
        if rank == 0:
            model.save_pretrained(out / "model", state_dict=model_state)
    return metrics


def _next_token_loss(net: nn.Module, rows: Tensor) -> Tensor:
    """Cross entropy of rows[:, 1:] given rows[:, :-1]."""
    logits = net(rows[:, :-1]).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())


def _mean_over_ranks(value: Tensor, size: int) -> float:
    if size > 1:
        value = value.clone()
        dist.all_reduce(value)
        value /= size
    return float(value)


@torch.no_grad()
def evaluate(net: nn.Module, rows: Tensor, batches: int, batch_size: int) -> float:
    """Mean next-token loss over the first `batches` full batches of held-out rows (N, L + 1).

    Under torchrun each rank scores its slice of every batch (as in training) and the ranks
    average, so the result does not depend on the number of processes.
    """
    rank, size = world()
    n = min(batches, len(rows) // batch_size)
    if n < 1:
        raise ValueError(
            f"held-out rows: {len(rows)} do not fill one batch of {batch_size}; hold out more "
            "documents (data.every) or use a smaller batch_size"
        )
    local = batch_size // size
    device = next(net.parameters()).device
    losses = []
    for i in range(n):
        batch = rows[i * batch_size : (i + 1) * batch_size]
        mine = batch[rank * local : (rank + 1) * local].to(device)
        losses.append(_mean_over_ranks(_next_token_loss(net, mine), size))
    return sum(losses) / len(losses)


def write_metrics(path: Path, metrics: list[dict[str, float]]) -> None:
    """All metrics rows as CSV (rewritten atomically)."""
    with replaced_atomically(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "lr", "eval_loss", "seconds"])
        writer.writeheader()
        writer.writerows(metrics)
