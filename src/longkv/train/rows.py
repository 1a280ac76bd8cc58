"""The rows a run trains and is scored on, and their loss: token rows or `LabelledRows`, the
next-token loss of a batch (float32 for gradients, exact for evaluation), and the held-out loss
averaged over torchrun's ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from longkv.data import IGNORE
from longkv.nll import token_nll


@dataclass(frozen=True)
class LabelledRows:
    """Training or held-out rows that score only some tokens.

    ids (N, L + 1) long: the tokens; labels (N, L + 1) long: the target at each position, -100
    where unscored (`longkv.data.IGNORE`). The loss of a row is the mean cross
    entropy of labels[:, 1:] given ids[:, :-1] over the labelled positions; plain token rows
    (a Tensor) are the case labels == ids. Indexing and `to` act on both tensors.
    """

    ids: Tensor
    labels: Tensor

    def __post_init__(self) -> None:
        if self.ids.shape != self.labels.shape or self.ids.dim() != 2:
            raise ValueError(
                f"LabelledRows: ids {tuple(self.ids.shape)} and labels "
                f"{tuple(self.labels.shape)} must both be (N, L + 1)"
            )

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: Tensor | slice) -> LabelledRows:
        return LabelledRows(self.ids[index], self.labels[index])

    def to(self, device: torch.device | str) -> LabelledRows:
        """Both tensors on device."""
        return LabelledRows(self.ids.to(device), self.labels.to(device))


TrainingRows = Tensor | LabelledRows  # (N, L + 1) token rows, or rows with labels


def world() -> tuple[int, int]:
    """(rank, world size): from torchrun's environment, else (0, 1)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def next_token_loss(net: nn.Module, rows: TrainingRows, exact: bool = False) -> Tensor:
    """Cross entropy of rows[:, 1:] given rows[:, :-1] (token rows), or of labels[:, 1:] given
    ids[:, :-1] over the labelled positions (LabelledRows). exact: scored by `token_nll` (a
    float64 value, for evaluation) rather than torch's float32 cross entropy (for gradients)."""
    ids, labels = (rows.ids, rows.labels) if isinstance(rows, LabelledRows) else (rows, rows)
    logits, targets = net(ids[:, :-1]).logits.flatten(0, 1), labels[:, 1:].flatten()
    if exact:
        scored = targets != IGNORE
        return token_nll(logits[scored], targets[scored]).mean()
    return nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE)


def mean_over_ranks(value: Tensor, size: int) -> float:
    """value averaged over the `size` ranks (as it is with one)."""
    if size > 1:
        value = value.clone()
        dist.all_reduce(value)
        value /= size
    return float(value)


def check_held_out(rows: TrainingRows, batch_size: int) -> None:
    """ValueError unless the held-out rows fill one batch, in the run file's terms."""
    if len(rows) < batch_size:
        raise ValueError(
            f"held-out rows: {len(rows)} do not fill one batch of {batch_size}; hold out more "
            "documents (data.every=) or lower train.batch_size="
        )


@torch.no_grad()
def evaluate(net: nn.Module, rows: TrainingRows, batches: int, batch_size: int) -> float:
    """Mean next-token loss over the first `batches` full batches of held-out rows (N, L + 1)
    (the mean over batches of each batch's loss, as in training, scored exactly: see
    `next_token_loss`).

    Under torchrun each rank scores its slice of every batch (as in training) and the ranks
    average, so the result does not depend on the number of processes.
    """
    rank, size = world()
    check_held_out(rows, batch_size)
    n = min(batches, len(rows) // batch_size)
    local = batch_size // size
    device = next(net.parameters()).device
    losses = []
    for i in range(n):
        batch = rows[i * batch_size : (i + 1) * batch_size]
        mine = batch[rank * local : (rank + 1) * local].to(device)
        losses.append(mean_over_ranks(next_token_loss(net, mine, exact=True), size))
    return sum(losses) / len(losses)
