"""The training loop: AdamW with warmup and linear decay, clipping, eval, checkpoints, DDP/FSDP.

The batch of step s is a function of (seed, s) alone and its learning rate a function of
(s, warmup, steps), so a run resumed from a checkpoint (model, optimizer, step, settings)
replays exactly the steps it would have taken. Under torchrun each rank takes its slice of the
global batch; DistributedDataParallel averages the gradients, or FSDP (`fully_shard` per block)
shards parameters, gradients and optimizer state. Each process uses the GPU of its LOCAL_RANK
when CUDA is available, else the CPU, in the arithmetic of `TrainConfig.precision`
(`PRECISIONS`).
Training rows are token rows, scored on every next token, or `LabelledRows`, scored on their
labelled tokens only (the answers of MQAR rows, say); rows and their loss are
`longkv.train.rows`'. The run's settings, precisions and
schedule are `longkv.train.config`'s.
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from tqdm import tqdm

from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.results import replaced_atomically
from longkv.train.checkpoint import (
    CHECKPOINT,
    load_checkpoint,
    load_training_state,
    save_checkpoint,
)
from longkv.train.config import (
    TrainConfig,
    compute_precision,
    param_groups,
    run_settings,
    schedule,
)
from longkv.train.rows import (
    TrainingRows,
    check_held_out,
    evaluate,
    mean_over_ranks,
    next_token_loss,
    world,
)

METRICS_FILE = "metrics.csv"  # one row per step: loss, lr, eval_loss on eval steps, seconds
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered, on rank 0's CPU


def compile_feedforward(model: LongKVForCausalLM) -> None:
    """torch.compile each block's feed-forward half (LayerNorm and MLP are one module each;
    the MLP is compiled), as the paper's recipe compiles the FFN half. The mixers stay eager:
    the KVM update's data-dependent merges break the graph into many pieces, each compiled on
    its own."""
    for block in model.model.layers:
        block.mlp.compile()


def batch_rows(step: int, n_rows: int, batch_size: int, seed: int) -> Tensor:
    """Row indices of the global batch of `step`: a seeded permutation per epoch, in order."""
    per_epoch = n_rows // batch_size
    if per_epoch < 1:
        raise ValueError(f"batch_size {batch_size} exceeds the {n_rows} training rows")
    epoch, i = divmod(step, per_epoch)
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[i * batch_size : (i + 1) * batch_size]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during the steps of `train`; says the steps done and the step the checkpoint holds."""

    def __init__(self, step: int, checkpoint: Path, checkpoint_step: int, cfg: TrainConfig) -> None:
        self.step = step
        self.checkpoint_step = checkpoint_step  # 0: no checkpoint written yet
        done = f"interrupted after step {step} of {cfg.steps}"
        if checkpoint_step == 0:
            every = f"train.checkpoint_every={cfg.checkpoint_every}"
            super().__init__(f"{done}, before the first checkpoint ({every})")
            return
        redo = (
            f", the {step - checkpoint_step} after it will be redone"
            if step > checkpoint_step
            else ""
        )
        super().__init__(f"{done}; {checkpoint} holds step {checkpoint_step}{redo}")


def progress_postfix(loss: float, eval_loss: float | None) -> str:
    """The progress bar's postfix: the step's training loss and the last held-out loss."""
    shown = f"loss={loss:.4f}"
    return shown if eval_loss is None else f"{shown}, eval_loss={eval_loss:.4f}"


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
    # static_graph: every step uses the same parameters, and some may never get a gradient (a
    # KVM merge gate when rows fit the window), which plain DDP refuses at the second step.
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, static_graph=True)


def tensorboard_writer(out: Path, first_step: int) -> Any:
    """A SummaryWriter in out/tensorboard when tensorboard is installed, else None.

    Events at steps >= first_step (the first this process logs) are purged: an interrupted run
    logged them after its last checkpoint, and the resumed run logs them again.
    """
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(out / "tensorboard"), purge_step=first_step)


@dataclass(frozen=True)
class TrainRun:
    """What every step of one `train` call uses: this process's place among the ranks, its
    device, the model (in the run's dtype, float32 by default, under every precision: the
    weights AdamW updates, checkpoints and saves), the model the steps compute with (the model
    itself, or its bfloat16 copy under precision bf16), the module they run through (that, DDP
    or FSDP), AdamW and the autocast context."""

    cfg: TrainConfig
    rank: int
    size: int
    device: torch.device
    model: LongKVForCausalLM
    work: LongKVForCausalLM
    net: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: torch.autocast

    @torch.no_grad()
    def load_work(self) -> None:
        """Copy the model's weights into the working copy (rounded to bfloat16), if it has one."""
        if self.work is not self.model:
            for w, p in zip(self.work.parameters(), self.model.parameters(), strict=True):
                w.copy_(p)

    def take_gradients(self) -> None:
        """The working copy's gradients, widened, become the model's (if it has a copy)."""
        if self.work is not self.model:
            for w, p in zip(self.work.parameters(), self.model.parameters(), strict=True):
                p.grad = None if w.grad is None else w.grad.to(p.dtype)
                w.grad = None


def start_run(
    model_config: LongKVConfig, cfg: TrainConfig, dtype: torch.dtype = torch.float32
) -> TrainRun:
    """Join the process group under torchrun and build the model (seeded with cfg.seed, in
    dtype), its working copy, its distributed wrapper and AdamW on this process's device."""
    rank, size = world()
    device = train_device()
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if cfg.batch_size % size:
        raise ValueError(f"batch_size {cfg.batch_size} is not divisible by {size} ranks")
    torch.manual_seed(cfg.seed)
    model = LongKVForCausalLM(model_config).to(device=device, dtype=dtype)
    precision = compute_precision(cfg.precision, device)
    work = copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16" else model
    if cfg.checkpointing:
        work.activation_checkpointing_enable()
    if cfg.compile:
        compile_feedforward(work)
    net = distribute(work, cfg.parallel, size, device)
    groups = param_groups(model, cfg, model_config.d_model)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=precision == "bf16-autocast"
    )
    return TrainRun(cfg, rank, size, device, model, work, net, optimizer, autocast)


def _resume(
    run: TrainRun, checkpoint: Path, settings: dict[str, dict[str, Any]]
) -> tuple[int, list[dict[str, float]]]:
    """(first step, metrics rows so far): the checkpoint's, its state loaded into the model and
    optimizer, when there is one (refused if its settings differ, see load_checkpoint)."""
    if not checkpoint.is_file():
        return 0, []
    state = load_checkpoint(checkpoint, settings)
    load_training_state(run.model, run.optimizer, state)
    return state["step"], state["metrics"]


def _step(run: TrainRun, train_rows: TrainingRows, step: int) -> dict[str, float]:
    """One optimizer step on this rank's slice of the global batch of `step`; its metrics row:
    step (counted from 1), loss (the mean over ranks) and lr."""
    cfg = run.cfg
    local = cfg.batch_size // run.size
    rows = train_rows[batch_rows(step, len(train_rows), cfg.batch_size, cfg.seed)]
    mine = rows[run.rank * local : (run.rank + 1) * local].to(run.device)
    loss, lr = optimizer_step(run, mine, step)
    return {"step": step + 1, "loss": mean_over_ranks(loss, run.size), "lr": lr}


def optimizer_step(run: TrainRun, rows: TrainingRows, step: int) -> tuple[Tensor, float]:
    """Forward, backward and AdamW on rows (B, L + 1) at the schedule of `step` (0-based), in
    the run's precision: (the loss, detached; the lr reported)."""
    run.optimizer.zero_grad(set_to_none=True)
    run.load_work()
    with run.autocast:
        loss = next_token_loss(run.net, rows)
    loss.backward()
    run.take_gradients()
    if run.cfg.grad_clip is not None:
        nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.grad_clip)
    lr = schedule(run.optimizer.param_groups, run.cfg, step)
    run.optimizer.step()
    return loss.detach(), lr


def _save(
    run: TrainRun, out: Path, metrics: list[dict[str, float]], settings: dict[str, dict[str, Any]],
    writer: Any,
) -> None:  # fmt: skip
    """Checkpoint the step of the last metrics row: the state is gathered on every rank, and
    rank 0 writes it with the metrics CSV and flushes tensorboard."""
    model_state, optim_state = get_state_dict(run.model, run.optimizer, options=FULL)
    if run.rank == 0:
        save_checkpoint(
            out / CHECKPOINT,
            {
                "model": model_state, "optimizer": optim_state, "step": metrics[-1]["step"],
                "metrics": metrics, "settings": settings,
            },
        )  # fmt: skip
        write_metrics(out / METRICS_FILE, metrics)
        if writer is not None:
            writer.flush()


def _log(writer: Any, row: dict[str, float]) -> None:
    """The row's loss, lr and eval_loss (when it has one) as tensorboard scalars at its step."""
    if writer is not None:
        for key in ("loss", "lr", "eval_loss"):
            if key in row:
                writer.add_scalar(key, row[key], row["step"])


def train(
    model_config: LongKVConfig,
    cfg: TrainConfig,
    train_rows: TrainingRows,
    held_out_rows: TrainingRows,
    out_dir: str | Path,
    *,
    data: Mapping[str, Any] | None = None,
    stop_after: int | None = None,
    dtype: torch.dtype = torch.float32,
    desc: str = "train",
    on_step: Callable[[], object] | None = None,
) -> list[dict[str, float]]:
    """Train (or resume, or extend) on rows (N, seq_len + 1) and return the metrics rows.

    Training rows are token rows, the loss on every next token, or LabelledRows, the loss on the
    labelled tokens only (training and held-out alike). desc: the progress bar's label;
    on_step is called after each step (a study's overall progress).

    A row per step: step, loss, lr (of that step's update), eval_loss (on eval steps) and
    seconds (wall time of the training steps so far, evaluations included, checkpoint writes
    not; carried across resumes). data: the settings that made the rows, recorded with the
    model and train settings in the checkpoint and compared on resume (see load_checkpoint).
    A checkpoint in out_dir is continued from its step to cfg.steps, the learning rate of step
    s being cfg.lr * lr_factor(s, cfg.warmup, cfg.steps) whatever steps the checkpoint's run
    had. stop_after simulates an interruption. Ctrl-C during the steps raises Interrupted.
    """
    check_held_out(held_out_rows, cfg.batch_size)  # before the first step, not at the first eval
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = start_run(model_config, cfg, dtype)
    settings = run_settings(model_config, cfg, data)
    checkpoint = out / CHECKPOINT
    start, metrics = _resume(run, checkpoint, settings)
    writer = tensorboard_writer(out, start + 1) if run.rank == 0 else None  # rows count from 1
    elapsed = metrics[-1]["seconds"] if metrics else 0.0  # training time, resumes included
    evals = [row["eval_loss"] for row in metrics if "eval_loss" in row]
    eval_loss = evals[-1] if evals else None
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    saved = start  # the step the checkpoint holds (rank 0 writes it)
    bar = tqdm(
        range(start, end), desc=desc, unit="step", initial=start, total=end,
        disable=run.rank != 0,
    )  # fmt: skip
    try:
        for step in bar:
            t0 = time.perf_counter()
            row = _step(run, train_rows, step)
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                run.load_work()
                with run.autocast:
                    eval_loss = evaluate(run.net, held_out_rows, cfg.eval_batches, cfg.batch_size)
                row["eval_loss"] = eval_loss
            elapsed += time.perf_counter() - t0
            row["seconds"] = elapsed
            metrics.append(row)
            bar.set_postfix_str(progress_postfix(row["loss"], eval_loss))
            if on_step is not None:
                on_step()
            _log(writer, row)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end:
                _save(run, out, metrics, settings, writer)
                if run.rank == 0:
                    saved = step + 1
            if run.size > 1:
                dist.barrier()
        if writer is not None:
            writer.close()
        if end == cfg.steps:  # the finished model, for generate and eval-loss
            model_state = get_model_state_dict(run.model, options=FULL)
            if run.rank == 0:
                run.model.save_pretrained(out / "model", state_dict=model_state)
    except KeyboardInterrupt as err:
        raise Interrupted(len(metrics), checkpoint, saved, cfg) from err
    finally:
        bar.close()  # before any message about the interruption
    return metrics


def write_metrics(path: Path, metrics: list[dict[str, float]]) -> None:
    """All metrics rows as CSV (rewritten atomically)."""
    with replaced_atomically(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "lr", "eval_loss", "seconds"])
        writer.writeheader()
        writer.writerows(metrics)
