"""OVQ attention, chunk by chunk (docs/ovq.md; spec ovq.md sections 2-5).

A query at position p of chunk c attends, in one softmax, to the dictionary as it stood when
chunk c began (each centroid the mean key and value of its tokens, its logit raised by
log(count)) and to the tokens of its own chunk up to itself. A complete chunk joins the
dictionary: the schedule grows it by m slots, founded by the chunk's m tokens least similar to
any visible centroid (in the first chunk: to the chunk's first token), and every other token
joins the visible centroid of the largest dot product, whose running mean it moves.

`ovq_attention` runs each piece of a chunk as one fused attention over the two key sets (the
count bias added to the centroids' logits) and each commit as one similarity matmul and an
indexed add; `naive.ovq_attention_naive` is its token-by-token reference.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from longkv.attention.core import (
    KeySet,
    attend_key_sets,
    check_optional,
    check_qkv,
    group_heads,
    ungroup_heads,
)
from longkv.attention.state import Rows, WindowCache
from longkv.ovq.config import OVQConfig
from longkv.ovq.state import OVQState

NORM_EPS = 1e-5  # added to the norm, as the reference's x / (|x| + eps)


def unit(x: Tensor) -> Tensor:
    """x / (|x| + 1e-5) over the last dim (the reference's normalisation)."""
    return x / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) + NORM_EPS)


def empty_state(config: OVQConfig, k: Tensor, v: Tensor) -> OVQState:
    """An empty state for keys k (B, Hkv, T, Dk) and values v (B, Hkv, T, Dv)."""
    B, Hkv, _, Dk = k.shape
    slots = k.new_zeros(B, Hkv, 0, Dk + v.shape[-1] + 1)
    return OVQState(config, Rows.of(slots), WindowCache.empty(k, v))


def assign(keys: Tensor, means: Tensor, m: int) -> Tensor:
    """The slot of each of a complete chunk's normalised keys (B, Hkv, C, Dk), given the d
    visible centroids' mean keys (B, Hkv, d, Dk) and m new slots (spec ovq.md 4.1): (B, Hkv, C)
    long. d > 0: the m keys of the lowest best dot product found slots d, d + 1, ... (the least
    similar first), the others join their arg-max centroid. d = 0: every key joins slot 0 but
    the m - 1 least similar to the chunk's first key, which found slots 1 .. m - 1. Ties go to
    the earlier key and the earlier centroid."""
    B, Hkv, C, _ = keys.shape
    d = means.shape[2]
    if d == 0:
        slot = keys.new_zeros(B, Hkv, C, dtype=torch.long)
        founders, first = max(m - 1, 0), 1
        novelty = (keys * keys[:, :, :1]).sum(-1)  # similarity to the first key
        novelty[..., 0] = math.inf  # which never founds
    else:
        sim = keys @ means.transpose(-1, -2)  # (B, Hkv, C, d)
        novelty, slot = sim.max(-1)  # the index of the first of equal maxima
        founders, first = m, d
    if founders:
        order = novelty.sort(dim=-1, stable=True).indices[..., :founders]  # least similar first
        new = torch.arange(first, first + founders, device=keys.device).expand_as(order)
        slot = slot.scatter(-1, order, new)
    return slot


def commit(state: OVQState, keys: Tensor, values: Tensor, own: bool = False) -> Rows:
    """The dictionary after the complete chunk of normalised keys (B, Hkv, C, Dk) and values
    (B, Hkv, C, Dv) at state.committed joins it: rows for the slots it founds, then its tokens
    added to their slots' sums and counts. own: the state's rows may be written in place."""
    config, C = state.config, keys.shape[2]
    d = state.visible
    m = config.size(state.committed + C) - d
    with torch.no_grad():  # the choices are discrete: no gradient flows through them
        means = state.centroids().k if d else keys[:, :, :0]
        slot = assign(keys.detach(), means.detach(), m)
    rows = state.slots
    need = max(len(rows), d + m if d else max(m, 1))
    if need > len(rows):
        B, Hkv, _, width = rows.tensor.shape
        rows = rows.append(keys.new_zeros(B, Hkv, need - len(rows), width), own)
    one = keys.new_ones(*keys.shape[:3], 1)
    return rows.add_at(slot, torch.cat([keys, values, one], dim=-1), own)


def ovq_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: OVQConfig,
    beta: Tensor | None = None,
    state: OVQState | None = None,
    donate: bool = False,
) -> tuple[Tensor, OVQState]:
    """OVQ attention of tokens [seen, seen + T) continuing `state` (None: a new sequence).

    q (B, H, T, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv), raw (the function normalises q and
    k); beta (H,) the per-head scale, logits beta_h sqrt(Dk) q.k on unit vectors (None: 1).
    Returns (out (B, H, T, Dv), the new state). donate: the given state may be changed in
    place (its holder keeps only the returned one).
    """
    dims = check_qkv(q, k, v)
    _, H, T, Dk = q.shape
    beta = check_optional("beta", beta, (H,), q)
    scale = math.sqrt(Dk) if beta is None else math.sqrt(Dk) * beta.view(1, H, 1, 1)
    qs = group_heads(unit(q) * scale, dims.Hkv)  # (B, Hkv, G, T, Dk)
    kn = unit(k)
    if state is None:
        state = empty_state(config, k, v)
    else:
        state.pending.check_fits(dims, q)
    C = config.chunk_len
    outs, i, own_rows = [], 0, donate
    while i < T:
        take = min(T - i, C - state.seen % C)  # the rest of the open chunk, at most
        pending = state.pending.extend(kn[:, :, i : i + take], v[:, :, i : i + take], own=donate)
        state = state.with_read(pending)
        outs.append(_attend(state, qs[:, :, :, i : i + take]))
        if pending.seen % C == 0:  # the chunk is complete: it joins the dictionary
            slots = commit(state, pending.k, pending.v, own=own_rows)
            state = OVQState(config, slots, _empty_at(pending))
            own_rows = True  # a commit returns rows of its own: later ones may write in place
        i += take
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return ungroup_heads(out), state


def _empty_at(pending: WindowCache) -> WindowCache:
    """An empty open chunk after the tokens of `pending`."""
    k, v = pending.k, pending.v
    return WindowCache.of(k[:, :, :0], v[:, :, :0], pending.seen)


def _attend(state: OVQState, qs: Tensor) -> Tensor:
    """Grouped queries qs (B, Hkv, G, L, Dk) of the last L tokens of the open chunk against the
    visible centroids (their logits raised by log(count)) and the open chunk, causally:
    (B, Hkv, G, L, Dv)."""
    pending = state.pending
    chunk = KeySet(qs, pending.k, pending.v, causal=True)
    if state.visible == 0:
        return attend_key_sets([chunk])
    keys, values, bias = state.centroids()
    return attend_key_sets([KeySet(qs, keys, values, bias=bias), chunk])
