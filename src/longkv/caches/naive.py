"""Plain references of the bounded caches' fast paths, one token (or query) and one head at a
time."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from longkv.caches.kvm_state import DROPPED, FoldState


def _cosine(a: Tensor, b: Tensor) -> float:
    return float(a @ b) / max(float(a.norm()) * float(b.norm()), 1e-12)


def update_state_naive(
    state: FoldState,
    keys: Tensor,
    values: Tensor,
    first: int,
    target: int,
    sink_keys: Tensor,
    threshold: float | None = None,
    cap: float | None = None,
) -> tuple[FoldState, Tensor]:
    """`longkv.caches.kvm_state.update_state` written out per row, head and token."""
    B, Hkv, m, _ = keys.shape
    S0 = state.num_slots
    n_append = min(max(target - S0, 0), m)
    rows: dict[str, list[list[list[Tensor]]]] = {
        name: [[list(getattr(state, name)[b, h]) for h in range(Hkv)] for b in range(B)]
        for name in ("key_sum", "value_sum", "count", "key_norm", "value_norm", "founder")
    }
    dest = torch.full((B, Hkv, m), DROPPED, dtype=torch.long)
    for b in range(B):
        for h in range(Hkv):
            key_sum, value_sum = rows["key_sum"][b][h], rows["value_sum"][b][h]
            count, founder = rows["count"][b][h], rows["founder"][b][h]
            known = [*sink_keys[b, h], *key_sum]
            bound = math.inf if cap is None or not count else cap * sum(count) / len(count)
            open_ = [float(c) <= bound for c in count]  # as the block arrives
            novelty = [max((_cosine(k, x) for x in known), default=0.0) for k in keys[b, h]]
            # the n_append least similar tokens, earliest first among equals
            ranked = sorted(range(m), key=lambda j: (novelty[j], j))
            appended = sorted(ranked[:n_append]) if n_append < m else list(range(m))
            for j in appended:
                k = keys[b, h, j].to(state.key_sum.dtype)
                v = values[b, h, j].to(state.value_sum.dtype)
                dest[b, h, j] = len(key_sum)
                key_sum.append(k.clone())
                value_sum.append(v.clone())
                count.append(torch.tensor(1.0, dtype=state.count.dtype))
                rows["key_norm"][b][h].append(k.norm())
                rows["value_norm"][b][h].append(v.norm())
                founder.append(torch.tensor(first + j))
            frozen = [s.clone() for s in key_sum]  # every token merges against the same state
            for j in range(m):
                if j in appended:
                    continue
                sims = [_cosine(keys[b, h, j].to(s.dtype), s) for s in frozen]
                takes = [i for i in range(len(sims)) if i >= len(open_) or open_[i]]
                best = max(takes, key=lambda i: (sims[i], -i))
                if threshold is not None and sims[best] < threshold:
                    continue
                dest[b, h, j] = best
                key_sum[best] = key_sum[best] + keys[b, h, j].to(key_sum[best].dtype)
                value_sum[best] = value_sum[best] + values[b, h, j].to(value_sum[best].dtype)
                count[best] = count[best] + 1

    def stack(name: str, like: Tensor) -> Tensor:
        grid = rows[name]
        if not any(grid[b][h] for b in range(B) for h in range(Hkv)):
            return like
        return torch.stack([torch.stack([torch.stack(grid[b][h]) for h in range(Hkv)])
                            for b in range(B)])  # fmt: skip

    return (
        FoldState.of(**{name: stack(name, getattr(state, name)) for name in rows}),
        dest,
    )


def top_units_naive(rank: Tensor, k: int) -> list[int]:
    """The k best units of one row's scores rank (U,), best first, the earlier on ties."""
    return sorted(range(rank.shape[0]), key=lambda i: (-float(rank[i]), i))[:k]


def fill_naive(
    key: list[float], count: list[float], leaf_budget: int | None, most: int | None
) -> list[int]:
    """The units taken in descending order of key (the earlier on ties) while their leaves fit
    leaf_budget, skipping those that do not, at most `most` of them (None: no bound)."""
    taken: list[int] = []
    used = 0.0
    for i in sorted(range(len(key)), key=lambda i: (-key[i], i)):
        if most is not None and len(taken) == most:
            break
        if leaf_budget is not None and used + count[i] > leaf_budget:
            continue  # it does not fit: the next units are still tried
        used += count[i]
        taken.append(i)
    return taken


def row_units_naive(rank: Tensor, count: Tensor, k: int, leaf_budget: int | None) -> Tensor:
    """`longkv.caches.routed.row_units` written out per row: (B, Hkv, R, U) bool."""
    B, Hkv, R, U = rank.shape
    out = torch.zeros(B, Hkv, R, U, dtype=torch.bool)
    for b in range(B):
        for h in range(Hkv):
            for r in range(R):
                sizes = [float(c) for c in count[b, h]]
                for i in fill_naive([float(x) for x in rank[b, h, r]], sizes, leaf_budget, k):
                    out[b, h, r, i] = True
    return out


def reranked_units_naive(
    rows: Tensor, leaf_k: Tensor, owner: Tensor, rank: Tensor, count: Tensor, scale: float,
    rerank: int, leaf_budget: int | None, k: int,
) -> Tensor:  # fmt: skip
    """Two-level KVM-Fold's reranked opening written out: the candidates, each row's best units
    by rank (B, Hkv, R, U) within `rerank` leaves; each candidate's exact log-mass per row of
    rows (B, Hkv, R, D), log sum_j exp(scale q . k_j) over its leaves leaf_k (B, Hkv, n, D)
    (owner (B, Hkv, n)); then the candidates opened by that mass as `row_units_naive` opens by
    score (at most k per row), within leaf_budget. Returns (B, Hkv, R, U) bool."""
    B, Hkv, R, U = rank.shape
    picked = row_units_naive(rank, count, U, rerank)
    mass = torch.full((B, Hkv, R, U), float("-inf"), dtype=rank.dtype)
    for b in range(B):
        for h in range(Hkv):
            for r in range(R):
                for u in range(U):
                    if not picked[b, h, r, u]:
                        continue
                    logits = [
                        scale * float(rows[b, h, r] @ key) for key in leaf_k[b, h][owner[b, h] == u]
                    ]
                    top = max(logits)
                    mass[b, h, r, u] = top + math.log(sum(math.exp(x - top) for x in logits))
    return row_units_naive(mass, count, k, leaf_budget) & picked


def block_units_naive(rank: Tensor, count: Tensor, leaf_budget: int | None) -> Tensor:
    """`longkv.caches.routed.block_units` written out per row and unit: (B, Hkv, 1, U) bool."""
    B, Hkv, R, U = rank.shape
    out = torch.zeros(B, Hkv, 1, U, dtype=torch.bool)
    for b in range(B):
        for h in range(Hkv):
            share = [0.0] * U  # each unit's largest share of a row's softmax
            for r in range(R):
                row = [float(x) for x in rank[b, h, r]]
                total = sum(math.exp(x - max(row)) for x in row)
                for i in range(U):
                    share[i] = max(share[i], math.exp(row[i] - max(row)) / total)
            for i in fill_naive(share, [float(c) for c in count[b, h]], leaf_budget, None):
                out[b, h, 0, i] = True
    return out


def routed_attention_naive(
    q: Tensor,
    entries: dict[str, tuple[Tensor, Tensor]],
    count: Tensor | None,
    owner: Tensor,
    opened: Tensor,
    scale: float,
    q_mem: Tensor | None = None,
) -> Tensor:
    """`longkv.caches.routed.routed_attention` written out per row, query head and query.

    q (B, H, T, D); entries: "sinks", "window" (before the chunk), "chunk" (the T queries' own
    tokens: query t sees the first t + 1), "leaves" and, with count, "slots" (the units'
    read-outs), each (keys (B, Hkv, n, D), values (B, Hkv, n, Dv)); count (B, Hkv, U) the units'
    tokens, or None (no read-outs); owner (B, Hkv, n) the unit of each leaf; opened (B, H, T, U)
    bool, the units each query head and query opens. One softmax over the sinks, the window,
    the chunk up to the query, the opened units' leaves and the closed units' read-outs (logit +
    log count); q_mem (B, H, T, D), where given, meets the leaves and read-outs in place of q.
    Returns (B, H, T, Dv).
    """
    B, H, T, _ = q.shape
    Hkv = owner.shape[1]
    out = torch.zeros(B, H, T, entries["sinks"][1].shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)  # the KV head of query head h
            for t in range(T):
                x = q[b, h, t]

                xm = x if q_mem is None else q_mem[b, h, t]

                def logit(key: Tensor, x: Tensor = x) -> float:
                    return scale * float(x @ key)

                units = {i for i in range(opened.shape[-1]) if opened[b, h, t, i]}
                seen: list[tuple[float, Tensor]] = []  # (logit, value) of every visible entry
                for name, upto in (("sinks", None), ("window", None), ("chunk", t + 1)):
                    keys, values = entries[name]
                    n = keys.shape[2] if upto is None else upto
                    seen += [(logit(keys[b, g, j]), values[b, g, j]) for j in range(n)]
                if count is not None:
                    slot_k, slot_v = entries["slots"]
                    seen += [
                        (
                            logit(slot_k[b, g, i], xm) + math.log(float(count[b, g, i])),
                            slot_v[b, g, i],
                        )
                        for i in range(count.shape[-1])
                        if i not in units
                    ]
                leaf_k, leaf_v = entries["leaves"]
                seen += [
                    (logit(leaf_k[b, g, j], xm), leaf_v[b, g, j])
                    for j in range(leaf_k.shape[2])
                    if int(owner[b, g, j]) in units
                ]
                top = max(lg for lg, _ in seen)
                weights = [math.exp(lg - top) for lg, _ in seen]
                total = sum(weights)
                out[b, h, t] = sum(w * v for w, (_, v) in zip(weights, seen, strict=True)) / total
    return out


def slot_scores_naive(
    q: Tensor, leaf_k: Tensor, owner: Tensor, units: int, scale: float, variance: float = 0.0
) -> Tensor:  # fmt: skip
    """Two-level KVM-Fold's slot scores written out from the leaves: for each query head and
    query of q (B, H, T, D) and each of `units` units, owning the leaves leaf_k (B, Hkv, n, D)
    of its KV head whose owner (B, Hkv, n) it is, scale q . mean + log(count) + variance * 1/2
    scale^2 |q|^2 (mean |k|^2 - |mean k|^2) / D. Returns (B, H, T, units)."""
    B, H, T, D = q.shape
    Hkv = leaf_k.shape[1]
    out = torch.zeros(B, H, T, units, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for u in range(units):
                members = leaf_k[b, g][owner[b, g] == u]
                mean = members.mean(0)
                spread = float((members * members).sum(-1).mean()) - float(mean @ mean)
                for t in range(T):
                    x = q[b, h, t]
                    term = 0.5 * scale**2 * float(x @ x) * max(spread, 0.0) / D
                    score = scale * float(x @ mean) + math.log(len(members)) + variance * term
                    out[b, h, t, u] = score
    return out


def bound_scores_naive(
    q: Tensor, leaf_k: Tensor, owner: Tensor, units: int, scale: float
) -> Tensor:
    """Unit scores by key bounds (Quest's page score) written out: for each query head and
    query of q (B, H, T, D) and each of `units` units, owning the leaves leaf_k (B, Hkv, n, D)
    of its KV head whose owner (B, Hkv, n) it is, scale times the sum over channels of the
    largest q_c * k_c among the unit's keys. Returns (B, H, T, units)."""
    B, H, T, _ = q.shape
    Hkv = leaf_k.shape[1]
    out = torch.zeros(B, H, T, units, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for t in range(T):
                for u in range(units):
                    members = leaf_k[b, g][owner[b, g] == u]
                    best = [
                        max(float(q[b, h, t, c] * k[c]) for k in members)
                        for c in range(q.shape[-1])
                    ]
                    out[b, h, t, u] = scale * sum(best)
    return out


def representatives_naive(keys: Tensor, scores: Tensor, r: int) -> Tensor:
    """`longkv.caches.infllm.representatives` written out: for each row and query head, the
    mean of the keys (B, Hkv, n, D) of its KV head's r tokens with the highest scores (B, H, n),
    the earlier on ties. Returns (B, H, D)."""
    B, H, _ = scores.shape
    out = torch.zeros(B, H, keys.shape[-1], dtype=keys.dtype)
    for b in range(B):
        for h in range(H):
            g = h // (H // keys.shape[1])
            best = top_units_naive(scores[b, h], r)
            out[b, h] = sum(keys[b, g, j] for j in best) / len(best)
    return out


def infllm_attention_naive(
    q: Tensor, q_mem: Tensor, entries: dict[str, tuple[Tensor, Tensor]], scale: float
) -> tuple[Tensor, Tensor]:
    """InfLLM's attention written out per row, query head and query: one softmax over the
    memory (entries "memory": the initial tokens and the opened blocks' leaves, met by q_mem
    (B, H, T, D)) and the local tokens ("window", then "chunk", the T queries' own, causal; met
    by q). Returns the output (B, H, T, Dv) and the probability each local token received,
    summed over the queries (B, H, window + T)."""
    B, H, T, _ = q.shape
    Hkv = entries["window"][0].shape[1]
    W = entries["window"][0].shape[2]
    out = torch.zeros(B, H, T, entries["window"][1].shape[-1], dtype=q.dtype)
    received = torch.zeros(B, H, W + T, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for t in range(T):
                window_k, window_v = entries["window"]
                chunk_k, chunk_v = entries["chunk"]
                memory_k, memory_v = entries["memory"]
                local = [(scale * float(q[b, h, t] @ window_k[b, g, j]), window_v[b, g, j])
                         for j in range(W)]  # fmt: skip
                local += [(scale * float(q[b, h, t] @ chunk_k[b, g, j]), chunk_v[b, g, j])
                          for j in range(t + 1)]  # fmt: skip
                memory = [(scale * float(q_mem[b, h, t] @ memory_k[b, g, j]), memory_v[b, g, j])
                          for j in range(memory_k.shape[2])]  # fmt: skip
                seen = local + memory
                top = max(lg for lg, _ in seen)
                total = sum(math.exp(lg - top) for lg, _ in seen)
                out[b, h, t] = sum(math.exp(lg - top) * v for lg, v in seen) / total
                for j, (lg, _) in enumerate(local):
                    received[b, h, j] += math.exp(lg - top) / total
    return out, received
