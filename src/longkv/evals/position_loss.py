"""Held-out loss by sequence position (docs/evals.md section 3).

Position t of a row of tokens x_0 .. x_T is the prediction of x_{t+1} from x_0 .. x_t, so a
model that runs past its training length shows where its loss rises. Buckets of positions
[edges[i], edges[i+1]) average the curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import Tensor

from longkv.checks import require
from longkv.nll import token_nll


def position_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """(T,) float64: the NLL of targets (B, T) under logits (B, T, V) at each position, averaged
    over the B rows (logits[:, t] scores targets[:, t])."""
    if logits.shape[:2] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must be (B, T, V) "
            "and (B, T)"
        )
    return token_nll(logits, targets).mean(0)


@dataclass(frozen=True)
class PositionBucket:
    """Positions low <= t < high and their mean loss."""

    low: int
    high: int
    loss: float


def check_edges(
    edges: Sequence[int], length: int, owner: object = None, name: str = "edges"
) -> list[int]:
    """The edges as a list: at least two, strictly increasing, in [0, length]; else refuse
    setting `name` of owner (by default the argument `edges`)."""
    edges = list(edges)
    require(
        len(edges) >= 2 and all(a < b for a, b in pairwise(edges)) and edges[0] >= 0,
        owner, name,
        f"needs at least two strictly increasing positions >= 0, got {edges}; "
        "e.g. [0, 256, 1024, 4096]",
    )  # fmt: skip
    require(
        edges[-1] <= length,
        owner,
        name,
        f"the last edge {edges[-1]} is past the {length} positions",
    )
    return edges


def bucket_loss(nll: Tensor, edges: Sequence[int]) -> list[PositionBucket]:
    """The mean of the per-position curve nll (T,) in each bucket [edges[i], edges[i+1])."""
    edges = check_edges(edges, len(nll))
    return [PositionBucket(a, b, nll[a:b].mean().item()) for a, b in pairwise(edges)]


def doubling_edges(length: int) -> list[int]:
    """[0, 1, 2, 4, ...] up to length, which ends the list: buckets that read on a log axis."""
    edges = [0, 1]
    while edges[-1] * 2 < length:
        edges.append(edges[-1] * 2)
    return [*edges, length] if edges[-1] < length else edges


@torch.no_grad()
def held_out_position_nll(model: torch.nn.Module, rows: Tensor, batch_size: int) -> Tensor:
    """(T,) float64: position_nll of token rows (N, T + 1) under a causal LM, averaged over
    all N rows (one forward of T tokens per row, batch_size rows at a time)."""
    device = next(model.parameters()).device
    total = torch.zeros(rows.shape[1] - 1, dtype=torch.float64)
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size].to(device)
        logits = model(batch[:, :-1]).logits
        total += position_nll(logits, batch[:, 1:]).cpu() * len(batch)
    return total / len(rows)
