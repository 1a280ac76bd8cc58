"""The token-by-token reference of OVQ attention: one query, head and token at a time, the
dictionary as plain lists of running sums (spec ovq.md sections 2-4, read literally)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from longkv.ovq.config import OVQConfig


def unit(x: Tensor) -> Tensor:
    """x / (|x| + 1e-5), as the reference normalises."""
    return x / (float(torch.linalg.vector_norm(x)) + 1e-5)


@dataclass
class Slot:
    """A centroid: the sums of its tokens' unit keys and values, and their number."""

    key_sum: Tensor
    value_sum: Tensor
    count: int = 0

    def mean(self) -> tuple[Tensor, Tensor]:
        return self.key_sum / self.count, self.value_sum / self.count


@dataclass
class Dictionary:
    """One (batch row, KV head)'s centroids and open chunk."""

    slots: list[Slot] = field(default_factory=list)
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (unit key, value)


@dataclass
class NaiveOVQState:
    """Every (batch row, KV head)'s dictionary, and the tokens seen."""

    dictionaries: dict[tuple[int, int], Dictionary]
    seen: int = 0


def ovq_attention_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: OVQConfig,
    beta: Tensor | None = None,
    state: NaiveOVQState | None = None,
) -> tuple[Tensor, NaiveOVQState]:
    """As `functional.ovq_attention`, one token at a time: out (B, H, T, Dv) and the state."""
    B, H, T, Dk = q.shape
    Hkv, Dv, C = k.shape[1], v.shape[-1], config.chunk_len
    if state is None:
        state = NaiveOVQState({(b, h): Dictionary() for b in range(B) for h in range(Hkv)})
    out = q.new_zeros(B, H, T, Dv)
    for t in range(T):
        committed = state.seen - state.seen % C
        visible = config.size(committed)
        for b in range(B):
            for h in range(Hkv):
                book = state.dictionaries[b, h]
                book.pending.append((unit(k[b, h, t]), v[b, h, t]))
            for h in range(H):
                book = state.dictionaries[b, h // (H // Hkv)]
                scale = math.sqrt(Dk) * (1.0 if beta is None else float(beta[h]))
                query = unit(q[b, h, t]) * scale
                logits, values = [], []
                for slot in book.slots[:visible]:
                    key, value = slot.mean()
                    bias = math.log(slot.count) if config.count_bias else 0.0
                    logits.append(float(query @ key) + bias)
                    values.append(value)
                for key, value in book.pending:  # the open chunk up to this token
                    logits.append(float(query @ key))
                    values.append(value)
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                out[b, h, t] = sum(w / total * x for w, x in zip(weights, values, strict=True))
        state.seen += 1
        if state.seen % C == 0:
            for book in state.dictionaries.values():
                commit_naive(book, config, state.seen - C)
    return out, state


def commit_naive(book: Dictionary, config: OVQConfig, committed: int) -> None:
    """The complete chunk book.pending (starting at token `committed`) joins the dictionary."""
    C = len(book.pending)
    d = config.size(committed)
    m = config.size(committed + C) - d
    keys = [key for key, _ in book.pending]
    if d == 0:  # the first chunk's rule: novelty against the chunk's first key
        slot_of = [0] * C
        similarity = [math.inf] + [float(key @ keys[0]) for key in keys[1:]]
        order = sorted(range(C), key=lambda i: (similarity[i], i))
        for rank, i in enumerate(order[: max(m - 1, 0)]):
            slot_of[i] = 1 + rank
        rows = max(m, 1)
    else:
        means = [slot.mean()[0] for slot in book.slots[:d]]
        slot_of, best = [], []
        for key in keys:
            sims = [float(key @ mean) for mean in means]
            j = max(range(d), key=lambda j: (sims[j], -j))  # the first of equal maxima
            slot_of.append(j)
            best.append(sims[j])
        order = sorted(range(C), key=lambda i: (best[i], i))
        for rank, i in enumerate(order[:m]):
            slot_of[i] = d + rank
        rows = d + m
    Dk, Dv = keys[0].shape[0], book.pending[0][1].shape[0]
    like = keys[0]
    while len(book.slots) < rows:
        book.slots.append(Slot(like.new_zeros(Dk), like.new_zeros(Dv)))
    for (key, value), j in zip(book.pending, slot_of, strict=True):
        slot = book.slots[j]
        slot.key_sum = slot.key_sum + key
        slot.value_sum = slot.value_sum + value
        slot.count += 1
    book.pending = []
