"""Routing recall: how much of full attention's probability mass a bounded cache attends exactly.

For the query of one input token, full attention (the exact fold, `full_attention_at`) gives
per layer and query head a probability p(t) over the tokens t up to it. A bounded cache's query
of the same token attends some tokens as they are (`BoundedRunner.exact_tokens`: the sinks, the
window, the chunk up to itself and, in a retrieval cache, the leaves of the units it opened),
e(t) = 1, and the rest through a read-out or not at all. Per layer and query head:

- `mass`: sum_t p(t) e(t), the share of full attention's mass the cache attends exactly;
- on a span of tokens A (a needle's answer), `answer` sum_{t in A} p(t) and `answer_exact`
  sum_{t in A} p(t) e(t);
- `entries`: sum_t e(t), the tokens attended exactly.

`recall` sums them over layers and heads: the answer recall is sum answer_exact / sum answer,
each head weighted by the mass it puts on the answer, so that the heads which never look at the
answer do not dilute it (a median over heads cannot tell a routing failure from a healthy
cache); the mass recall is the mean of `mass` over heads. Only the layers the cache bounds are
measured (a sliding-window layer keeps its own window either way).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longkv.caches.bounded import BoundedRunner
from longkv.caches.model import layer_windows
from longkv.fold import compat
from longkv.fold.attention import Attend, AttentionHooks, hooked
from longkv.fold.fold import FOLD_CHUNK, kv_fold


def capture(store: dict[int, Tensor], layer: int) -> Attend:
    """Softmax attention of a layer's queries (B, H, L, D) over all its cached keys (B, Hkv, Lk,
    D) (the queries' own last; L must be 1), computed in at least float32, that keeps each
    query head's probabilities (B, H, Lk) in store[layer]."""

    def attend(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        B, H, L, D = q.shape
        if L != 1:
            raise ValueError(f"q: capture attends one query at a time, got {L}")
        Hkv, high = keys.shape[1], torch.promote_types(q.dtype, torch.float32)
        qg = q.to(high).view(B, Hkv, H // Hkv, 1, D)
        probs = (qg @ keys.to(high).unsqueeze(2).transpose(-1, -2) * scale).softmax(-1)
        store[layer] = probs.reshape(B, H, -1).float()
        out = probs @ values.to(high).unsqueeze(2)  # (B, Hkv, G, 1, Dv)
        return out.reshape(B, H, 1, -1).to(q.dtype)

    return attend


@torch.inference_mode()
def full_attention_at(
    model: nn.Module,
    input_ids: Tensor,
    tokens: list[int],
    chunk_size: int = FOLD_CHUNK,
    allow_extrapolation: bool = False,
) -> dict[int, list[Tensor | None]]:
    """Full attention's probabilities at the queries of `tokens` (indices into input_ids (B,
    T)): per token, per layer, (B, H, token + 1) float32 over the tokens up to it (None for a
    sliding-window layer). One exact fold in chunks of chunk_size, each watched token read on
    its own (the fold is the same computation however it is cut)."""
    windows = layer_windows(model)
    out: dict[int, list[Tensor | None]] = {}
    cache, start = None, 0
    for token in sorted(set(tokens)):
        if not 0 <= token < input_ids.shape[1]:
            raise ValueError(f"tokens: {token} is not an index of an input of {input_ids.shape[1]}")
        if token > start:
            cache = kv_fold(
                model, input_ids[:, start:token], chunk_size, cache=cache, score=False,
                allow_extrapolation=allow_extrapolation,
            ).cache  # fmt: skip
        cache = compat.new_cache(model) if cache is None else cache
        store: dict[int, Tensor] = {}
        attend = [None if w else capture(store, i) for i, w in enumerate(windows)]
        position = torch.full((input_ids.shape[0], 1), token, device=input_ids.device)
        with hooked(model, AttentionHooks(attend=attend)):
            compat.forward(model, input_ids[:, token : token + 1], position, cache, "last")
        out[token] = [store.get(i) for i in range(len(windows))]
        start = token + 1
    return out


def head_recall(
    full: list[Tensor | None], exact: list[Tensor | None], span: tuple[int, int] | None = None
) -> dict[str, Tensor]:
    """Per bounded layer and query head (L', H), float64, of one query: `mass`, `entries` and,
    for a span [a, b) of tokens, `answer` and `answer_exact` (module docstring), from full
    attention's probabilities and the cache's exact tokens, per layer (B, H, n) each (the mean
    over batch rows; None: a layer neither measures)."""
    rows: dict[str, list[Tensor]] = {"mass": [], "entries": [], "answer": [], "answer_exact": []}
    for p, e in zip(full, exact, strict=True):
        if p is None or e is None:
            continue
        if p.shape != e.shape:
            raise ValueError(f"exact: shape {tuple(e.shape)} differs from full's {tuple(p.shape)}")
        p, kept = p.double(), p.double() * e
        rows["mass"].append(kept.sum(-1).mean(0))
        rows["entries"].append(e.double().sum(-1).mean(0))
        if span is not None:
            a, b = span
            rows["answer"].append(p[..., a:b].sum(-1).mean(0))
            rows["answer_exact"].append(kept[..., a:b].sum(-1).mean(0))
    return {name: torch.stack(r) for name, r in rows.items() if r}


def recall(heads: dict[str, Tensor]) -> dict[str, float]:
    """Over layers and heads (`head_recall`): `mass`, the mean share of full attention's mass
    attended exactly; `entries`, the mean tokens attended exactly per head; with a span,
    `answer`, the answer recall (each head weighted by its answer mass; 1.0 where full attention
    puts none on it) and `answer_mass`, full attention's mean mass on the answer per head."""
    out = {"mass": float(heads["mass"].mean()), "entries": float(heads["entries"].mean())}
    if "answer" in heads:
        total = float(heads["answer"].sum())
        out["answer"] = float(heads["answer_exact"].sum()) / total if total > 0 else 1.0
        out["answer_mass"] = float(heads["answer"].mean())
    return out


def cache_recall(
    runner: BoundedRunner,
    full: dict[int, list[Tensor | None]],
    spans: dict[int, tuple[int, int]] | None = None,
) -> dict[int, dict[str, float]]:
    """`recall` of each token of `full` (`full_attention_at`) that the runner watched and
    has read, on the span given for it in `spans` (none: mass and entries only)."""
    spans = spans or {}
    return {
        token: recall(head_recall(probs, runner.exact_tokens(token), spans.get(token)))
        for token, probs in full.items()
    }
