"""Retrieval attention: the tokens that left the window, exact, grouped in units (two-level
KVM-Fold's slots, InfLLM's blocks, Quest's pages), and each query attending the tokens of the
units it opens.

Per layer and KV head a retrieval cache holds a bounded part [sinks | read-outs | window]; the
tokens that left the window are leaves of a `LeafStore`, each owned by one of U units. A query
attends in one softmax the sinks, the window, the chunk being read (causally), the leaves of
the units it opens and, where the method keeps one read-out per unit (two-level KVM-Fold), the
read-outs of the units it leaves closed, each weighted as its count of tokens (logit + log
count). An opened unit's read-out is left out: its leaves stand for it.

Who opens what is a mask `opened` (B, Hkv, R, U):
- per token (R = G * L, the rows of the queries grouped by KV head, (G, L) heads first): each
  query head and query opens its k best units by a score (`top_units`);
- per block (R = 1): every query head and query of a forward opens the same units, those some
  of them gives the largest shares of its attention, within a budget of leaves (`block_units`).
`routed_attention` attends, through torch's fused kernel (`attend_key_sets`), the opened units'
leaves and the bounded part, copied once into [sinks | read-outs | leaves | window before the
chunk] with an additive bias per row, as one key set, the chunk causally as another, merged by
their log-sum-exp (a decoded token, a chunk of one, joins the first set as its last key: one
kernel call); it never forms a logit for a leaf of a unit no row opened.
`naive.routed_attention_naive` writes the same out per query and head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from longkv.attention.core import KeySet, attend_key_sets
from longkv.caches.leaves import Gathered

# who opens units in a prefill chunk: its queries together (block) or each on its own (token)
ROUTINGS = ("block", "token")
# where a retrieval cache places its tokens: exact (each at the position the model gave it) or
# inside (the read-outs and leaves un-rotated, met at one distance; the sinks and window at
# their cache index), so that no distance a query sees leaves the budget
POSITIONS = ("exact", "inside")


def top_units(rank: Tensor, k: int) -> Tensor:
    """(..., U) bool: the k highest of the scores rank (..., U) (all of them if k >= U), the
    earlier unit on ties."""
    k = min(k, rank.shape[-1])
    if k == 0:
        return torch.zeros_like(rank, dtype=torch.bool)
    kth = rank.topk(k, dim=-1).values[..., -1:]  # each row's k-th highest score
    above, tied = rank > kth, rank == kth
    room = k - above.sum(-1, keepdim=True)  # how many of the tied units still open
    return above | (tied & (tied.cumsum(-1) <= room))  # the earlier tied units first


def fill_units(
    key: Tensor, count: Tensor, leaf_budget: int | None, most: int | None = None
) -> Tensor:  # fmt: skip
    """(..., U) bool: units taken in descending order of key (..., U) (the earlier unit on
    ties) while their leaves, count (..., U), fit leaf_budget: a unit that does not fit what the
    units taken before it leave is skipped and the next ones are still tried (None: no bound);
    at most `most` of them (None: no bound)."""
    if (leaf_budget is None or bool((count.sum(-1) <= leaf_budget).all())) and (
        most is None or most >= key.shape[-1]
    ):  # every unit fits: no order to take them in
        return torch.ones_like(key, dtype=torch.bool)
    order = key.argsort(dim=-1, descending=True, stable=True)
    size = count.gather(-1, order)  # the units' leaves in that order
    taken = torch.ones_like(size, dtype=torch.bool)
    at = torch.arange(size.shape[-1], device=size.device)
    while leaf_budget is not None:  # each pass settles every row up to its first unit past it
        total = (size * taken).cumsum(-1)
        over = taken & (total > leaf_budget)
        if not bool(over.any()):
            break
        first = over.int().argmax(-1, keepdim=True)  # a row's first unit past the budget
        room = leaf_budget - (total - size).gather(-1, first)  # what the units before it leave
        taken &= ~((at >= first) & (size > room) & over.any(-1, keepdim=True))
    if most is not None:
        taken &= taken.cumsum(-1) <= most
    return torch.zeros_like(taken).scatter(-1, order, taken)


def block_units(rank: Tensor, count: Tensor, leaf_budget: int | None) -> Tensor:
    """(B, Hkv, 1, U) bool: the units a block of rows opens together. rank (B, Hkv, R, U): each
    row's scores; count (B, Hkv, U): each unit's leaves.

    Units are ranked by the largest share any row gives them in its softmax over the scores
    (the earlier unit on equal shares) and taken in that order while their leaves fit
    leaf_budget, skipping those that do not (`fill_units`; None: every unit)."""
    if leaf_budget is None:
        return torch.ones_like(rank[:, :, :1], dtype=torch.bool)
    share = torch.softmax(rank, dim=-1).amax(2)  # (B, Hkv, U)
    return fill_units(share, count, leaf_budget).unsqueeze(2)


def row_units(rank: Tensor, count: Tensor, k: int, leaf_budget: int | None) -> Tensor:
    """(B, Hkv, R, U) bool: the units each row opens on its own, its k best by rank (B, Hkv, R,
    U) (the earlier unit on ties) whose leaves, count (B, Hkv, U), fit leaf_budget, skipping
    those that do not (`fill_units`; None: its k best, `top_units`)."""
    if leaf_budget is None:
        return top_units(rank, k)
    return fill_units(rank, count.unsqueeze(2).expand_as(rank), leaf_budget, k)


def leaf_mass(q: Tensor, got: Gathered, candidates: Tensor, scale: float) -> Tensor:
    """(B, Hkv, R, U): each row's exact log-mass of each of its candidate units, the log-sum-exp
    of scale * q . k over the unit's leaves among `got` (gathered with every candidate's), -inf
    for a unit that is not one of the row's candidates (B, Hkv, R, U bool); q (B, Hkv, R, D)."""
    logits = scale * q @ got.keys.transpose(-1, -2)  # (B, Hkv, R, n)
    owner = got.owner.unsqueeze(2).expand_as(logits)
    mine = candidates.gather(-1, owner)
    if got.valid is not None:
        mine = mine & got.valid.unsqueeze(2)
    logits = logits.masked_fill(~mine, float("-inf"))
    top = torch.full_like(candidates, float("-inf"), dtype=logits.dtype)
    top = top.scatter_reduce(-1, owner, logits, "amax").nan_to_num(neginf=0.0)
    summed = torch.zeros_like(top).scatter_add(-1, owner, (logits - top.gather(-1, owner)).exp())
    return top + summed.log()


def bound_scores(q: Tensor, key_max: Tensor, key_min: Tensor, scale: float) -> Tensor:
    """(B, Hkv, R, U): scale * sum_c max(q_c * max_c, q_c * min_c), the largest logit any key
    inside each unit's per-channel bounds can give (Quest's page score), for the rows q
    (B, Hkv, R, D) of each KV head's query heads against the units' bounds key_max, key_min
    (B, Hkv, U, D)."""
    upper = q.clamp_min(0) @ key_max.transpose(-1, -2) + q.clamp_max(0) @ key_min.transpose(-1, -2)
    return scale * upper


def widen_bounds(
    bounds: tuple[Tensor, Tensor] | None, keys: Tensor, unit: Tensor, units: int
) -> tuple[Tensor, Tensor]:
    """The per-channel max and min keys (B, Hkv, units, D) of each unit once keys (B, Hkv, m, D)
    have joined the units `unit` (B, Hkv, m); bounds: the max and min before (B, Hkv, u, D),
    u <= units (None: no unit yet)."""
    B, Hkv, m, D = keys.shape
    key_max, key_min = (keys[:, :, :0], keys[:, :, :0]) if bounds is None else bounds
    grow = units - key_max.shape[2]
    key_max = torch.cat([key_max, keys.new_full((B, Hkv, grow, D), float("-inf"))], dim=2)
    key_min = torch.cat([key_min, keys.new_full((B, Hkv, grow, D), float("inf"))], dim=2)
    index = unit.unsqueeze(-1).expand(B, Hkv, m, D)
    return (
        key_max.scatter_reduce(2, index, keys, "amax"),
        key_min.scatter_reduce(2, index, keys, "amin"),
    )


def grouped(q: Tensor, Hkv: int) -> Tensor:
    """q (B, H, L, D) as (B, Hkv, G * L, D): the rows of each KV head's G query heads."""
    B, H, L, D = q.shape
    return q.reshape(B, Hkv, H // Hkv * L, D)


def query_units(rows: Tensor, G: int, L: int, i: int = -1) -> Tensor:
    """(B, Hkv * G, U): each query head's row of query i of the L (default: the last), from rows
    (B, Hkv, R, U) with R = G * L (heads first) or 1 (one row for every query head and query);
    never a view of more rows, so that keeping it does not keep every row."""
    B, Hkv, R, U = rows.shape
    row = rows.expand(B, Hkv, G, U) if R == 1 else rows.unflatten(2, (G, L))[:, :, :, i]
    return row.reshape(B, Hkv * G, U).contiguous()


def routed_bias(
    opened: Tensor, count: Tensor | None, got: Gathered, sinks: int, window: int
) -> Tensor | None:  # fmt: skip
    """The additive bias (B, Hkv, R, sinks + S + n + window) over [sinks | read-outs | gathered
    leaves | window] (window: the entries after the leaves, the window before the chunk and, in
    `routed_attention`, a decoded token's own): 0 on the sinks, the window and the leaves of the
    units a row opened; log count on the read-out of a unit it left closed; -inf on an opened
    unit's read-out, on the leaves of units it left closed and on padding. count (B, Hkv, U): the
    read-outs' counts (S = U), None without read-outs (S = 0). None where every entry is 0."""
    B, Hkv, R, _ = opened.shape
    n = got.owner.shape[-1]
    seen = opened.gather(-1, got.owner.unsqueeze(2).expand(B, Hkv, R, n))  # (B, Hkv, R, n)
    if got.valid is not None:
        seen = seen & got.valid.unsqueeze(2)
    if count is None and bool(seen.all()):
        return None
    dtype = got.keys.dtype
    parts = [opened.new_zeros(B, Hkv, R, sinks, dtype=dtype)]
    if count is not None:
        parts.append(count.to(dtype).log().unsqueeze(2).masked_fill(opened, float("-inf")))
    parts.append(torch.zeros_like(seen, dtype=dtype).masked_fill(~seen, float("-inf")))
    parts.append(opened.new_zeros(B, Hkv, R, window, dtype=dtype))
    return torch.cat(parts, dim=-1)


class Part(NamedTuple):
    """Keys (B, Hkv, n, D) and values (B, Hkv, n, Dv) of one part of what a query attends."""

    keys: Tensor
    values: Tensor


def routed_attention(
    q: Tensor, sinks: Part, readouts: Part | None, window: Part, chunk: Part,
    count: Tensor | None, opened: Tensor, got: Gathered, scale: float,
    q_mem: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Attention of q (B, H, L, D) over the sinks, the units' read-outs (S = U of them, each
    weighted as its count (B, Hkv, U) of tokens; None, with count None: no read-outs), the
    window before the chunk, the L queries' own tokens `chunk` (causally) and the leaves `got`
    of the units `opened` (B, Hkv, R, U) opens (R = 1 or G * L, module docstring), in one
    softmax. q_mem (B, H, L, D): the queries that meet the read-outs and leaves, where they
    are placed elsewhere than the rest (`POSITIONS`' inside; None: q). Returns (B, H, L, Dv) in
    q's dtype (computed in at least float32)."""
    B, H, L, D = q.shape
    Hkv = chunk.keys.shape[1]
    high = torch.promote_types(q.dtype, torch.float32)
    qg = (q.to(high) * scale).view(B, Hkv, H // Hkv, L, D)
    own = L == 1  # a single query sees its own token as it sees the window: no causal set
    tail = [window, chunk] if own else [window]
    s = sinks.keys.shape[2]
    bias = routed_bias(opened, count, got, s, sum(p.keys.shape[2] for p in tail))
    if bias is not None and bias.shape[2] == 1:  # one row for all: the kernel broadcasts it
        bias = bias[..., 0, :]
    sets = [] if own else [KeySet(qg, chunk.keys.to(high), chunk.values.to(high), causal=True)]

    def add(queries: Tensor, parts: list[Part], bias: Tensor | None) -> None:
        """One key set of the parts, before the others (one copy of their keys)."""
        if sum(p.keys.shape[2] for p in parts):
            k = torch.cat([p.keys.to(high) for p in parts], dim=2)
            v = torch.cat([p.values.to(high) for p in parts], dim=2)
            sets.insert(0, KeySet(queries, k, v, bias=bias))

    memory = [*([] if readouts is None else [readouts]), Part(got.keys, got.values)]
    if q_mem is None:
        add(qg, [sinks, *memory, *tail], bias)
    else:  # the sinks and window carry no bias; the read-outs and leaves are met by q_mem
        add(qg, [sinks, *tail], None)
        n = sum(p.keys.shape[2] for p in memory)
        qm = (q_mem.to(high) * scale).view(B, Hkv, H // Hkv, L, D)
        add(qm, memory, None if bias is None else bias[..., s : s + n])
    return attend_key_sets(sets).reshape(B, H, L, -1).to(q.dtype)


def attended_entries(
    opened: Tensor, count: Tensor, sinks: int, window: int, L: int, readouts: bool
) -> Tensor:  # fmt: skip
    """(B, Hkv, R', L) float: how many entries each query attends under `routed_attention`
    (R' = 1 for a block's shared units, G for a query head's own): the sinks, the read-outs of
    the units left closed (with readouts), the leaves of the opened units (count (B, Hkv, U) of
    them each) and the window before the chunk, plus the chunk up to the query."""
    B, Hkv, R, U = opened.shape
    shared = R == 1
    rows = opened.view(B, Hkv, 1 if shared else R // L, 1 if shared else L, U).to(count.dtype)
    leaves = (rows @ count.unsqueeze(2).unsqueeze(-1))[..., 0]  # (B, Hkv, R', L or 1)
    closed = U - rows.sum(-1) if readouts else torch.zeros_like(leaves)
    causal = torch.arange(1, L + 1, device=opened.device, dtype=count.dtype)
    return sinks + window + closed + leaves + causal
