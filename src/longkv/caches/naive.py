"""Plain references of the fold's fast paths, one token and one head at a time."""

from __future__ import annotations

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
                best = max(range(len(sims)), key=lambda i: (sims[i], -i))
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
