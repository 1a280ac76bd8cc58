"""Synthetic recall for small trained models: multi-query associative recall (MQAR) with a gap.

A row is `num_pairs` key-value pairs, then `gap` filler tokens, then `num_queries` queries; a
query is a key of an earlier pair followed by that pair's value, and only the value tokens of
the queries are scored (docs/evals.md section 2). Everything is a pure function of the settings
(`MQARConfig`, seed included): the same settings give the same batch.

Layout of one row (value_len = L, pairs P, queries Q, gap G, lead E):

    f ... f (E) | k_1 v_1 ... k_P v_P | f f ... f (G) | k_q1 v_q1 ... k_qQ v_qQ   (each v L tokens)

The lead (none by default) is filler before the pairs, so that rows with different gaps can
have one length: training rows of one length whose gaps range from 0 up teach recall at every
distance (with only long gaps, models sit at chance for longer, docs/evals.md section 2). A
lead of its own ids (`lead_kind` "novel" or "repeated", `lead_vocab` ids) puts the facts after
a long context that competes for a memory's room: "novel" draws each lead token uniformly from
the lead ids (with hundreds of ids, almost every token is new), "repeated" cycles through the
first PATTERN_LEN of them (the contrast: it merges away).

Vocabulary: with n = (vocab_size - filler_vocab - lead_vocab) // 2, keys are ids [0, n), values
[n, 2n), filler [2n, 2n + filler_vocab) and lead ids the lead_vocab after them; an odd leftover
id is unused. Within a row the keys are distinct, and so is each value's first token, as in
Zoology (values sampled without replacement); the queried keys are distinct pairs in random
order.

Targets follow `LongKVForCausalLM`'s loss, which shifts the labels inside: `labels[b, t]` is the
token at position t itself (a value token of a query) and -100 elsewhere, so
`model(input_ids, labels=labels).loss` is the mean cross entropy of exactly the answer tokens,
each predicted from the logits at t - 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

import torch
from torch import Tensor

from longkv.checks import require
from longkv.data import IGNORE

Filler = Literal["repeated", "random"]
FILLERS: tuple[str, ...] = ("repeated", "random")
LEAD_KINDS: tuple[str, ...] = ("filler", "novel", "repeated")
PATTERN_LEN = 4  # the "repeated" filler (and lead) cycles through the first PATTERN_LEN ids


@dataclass(frozen=True)
class MQARConfig:
    """Settings of an MQAR batch; `seq_len` follows from them exactly (see the module doc).

    filler "repeated" cycles through min(PATTERN_LEN, filler_vocab) filler ids (little
    novelty); "random" draws each filler token uniformly from the filler ids (novel
    distractors, never a key or a value). value_len > 1 makes each value several tokens, all
    scored. lead: tokens before the pairs (unscored); lead_kind "filler": filler of the same
    kind; "novel": drawn uniformly from the lead_vocab lead ids; "repeated": cycling through
    min(PATTERN_LEN, lead_vocab) of them. The lead ids are none of the keys, values or fillers
    (with a filler lead they are reserved and unused: the vocabulary of a model that is also
    scored on novel leads).
    """

    num_pairs: int = 8
    num_queries: int = 8
    gap: int = 0
    filler: Filler = "random"
    value_len: int = 1
    vocab_size: int = 64
    filler_vocab: int = 16
    seed: int = 0
    lead: int = 0
    lead_kind: str = "filler"
    lead_vocab: int = 0

    def __post_init__(self) -> None:
        require(
            self.lead_kind in LEAD_KINDS,
            self,
            "lead_kind",
            f"must be one of {LEAD_KINDS}, got {self.lead_kind!r}",
        )
        lows = {
            "num_pairs": 1,
            "num_queries": 1,
            "value_len": 1,
            "filler_vocab": 1,
            "gap": 0,
            "lead": 0,
            "lead_vocab": 0 if self.lead_kind == "filler" else 1,
        }
        for name, low in lows.items():
            value = getattr(self, name)
            require(
                isinstance(value, int) and value >= low,
                self,
                name,
                f"must be an int >= {low}, got {value!r}",
            )
        require(
            self.num_queries <= self.num_pairs,
            self,
            "num_queries",
            f"must be <= num_pairs = {self.num_pairs} (each query asks a distinct pair), got "
            f"{self.num_queries}; lower num_queries or raise num_pairs",
        )
        require(
            self.filler in FILLERS,
            self,
            "filler",
            f"must be one of {FILLERS}, got {self.filler!r}",
        )
        need = 2 * self.num_pairs + self.filler_vocab + self.lead_vocab
        require(
            isinstance(self.vocab_size, int) and self.vocab_size >= need,
            self,
            "vocab_size",
            f"must be >= 2 * num_pairs + filler_vocab + lead_vocab = {need} (distinct keys and "
            f"values per row, disjoint from the filler and lead ids), got {self.vocab_size!r}; "
            "raise vocab_size or lower num_pairs, filler_vocab or lead_vocab",
        )
        require(isinstance(self.seed, int), self, "seed", f"must be an int, got {self.seed!r}")

    @property
    def key_vocab(self) -> int:
        """n: keys are ids [0, n), values [n, 2n)."""
        return (self.vocab_size - self.filler_vocab - self.lead_vocab) // 2

    @property
    def filler_start(self) -> int:
        """First filler id (2n); filler ids are [filler_start, filler_start + filler_vocab)."""
        return 2 * self.key_vocab

    @property
    def lead_start(self) -> int:
        """First lead id; lead ids are [lead_start, lead_start + lead_vocab)."""
        return self.filler_start + self.filler_vocab

    @property
    def pair_len(self) -> int:
        """Tokens per pair or query: one key and value_len value tokens."""
        return 1 + self.value_len

    @property
    def query_start(self) -> int:
        """Position of the first query's key."""
        return self.lead + self.num_pairs * self.pair_len + self.gap

    @property
    def seq_len(self) -> int:
        """T = lead + (num_pairs + num_queries) * (1 + value_len) + gap."""
        return self.query_start + self.num_queries * self.pair_len


@dataclass(frozen=True)
class MQARBatch:
    """input_ids (B, T) long; labels (B, T) long: the token itself at scored positions, -100
    elsewhere; scored (B, T) bool: labels != -100; distance (B, T) long: at a scored position,
    the query key's position minus its pair's key position, 0 elsewhere; value_positions
    (Q, L) long: the positions of query j's value tokens, the same in every row."""

    input_ids: Tensor
    labels: Tensor
    scored: Tensor
    distance: Tensor
    value_positions: Tensor


def _distinct(gen: torch.Generator, batch: int, n: int, k: int) -> Tensor:
    """(batch, k) long: per row, k distinct ids of [0, n) in random order."""
    return torch.rand(batch, n, generator=gen).argsort(dim=-1)[:, :k]


def _filler(gen: torch.Generator, kind: str, start: int, vocab: int, b: int, n: int) -> Tensor:
    """(b, n) long: ids [start, start + vocab) drawn uniformly ("random") or cycling through the
    first min(PATTERN_LEN, vocab) of them ("repeated")."""
    if kind == "random":
        return start + torch.randint(vocab, (b, n), generator=gen)
    return (start + torch.arange(n) % min(PATTERN_LEN, vocab)).expand(b, n)


def make_mqar(config: MQARConfig, batch_size: int) -> MQARBatch:
    """A batch of `batch_size` MQAR rows drawn from `config.seed` (see the module doc)."""
    require(
        isinstance(batch_size, int) and batch_size >= 1,
        None,
        "batch_size",
        f"must be an int >= 1, got {batch_size!r}",
    )
    c, b = config, batch_size
    gen = torch.Generator().manual_seed(c.seed)
    p, q, n, lv = c.num_pairs, c.num_queries, c.key_vocab, c.value_len
    keys = _distinct(gen, b, n, p)  # (B, P)
    values = n + torch.stack([_distinct(gen, b, n, p) for _ in range(lv)], dim=-1)  # (B, P, L)
    asked = _distinct(gen, b, p, q)  # (B, Q): which pair each query asks
    own_lead = c.lead_kind != "filler"
    f = c.gap + (0 if own_lead else c.lead)  # filler tokens: the lead (of filler), then the gap
    filler = _filler(gen, c.filler, c.filler_start, c.filler_vocab, b, f)
    pairs = torch.cat([keys.unsqueeze(-1), values], dim=-1)  # (B, P, 1 + L)
    queries = pairs.gather(1, asked.unsqueeze(-1).expand(b, q, c.pair_len))  # (B, Q, 1 + L)
    if own_lead:
        kind = "random" if c.lead_kind == "novel" else "repeated"
        lead, gap = _filler(gen, kind, c.lead_start, c.lead_vocab, b, c.lead), filler
    else:
        lead, gap = filler.split([c.lead, c.gap], dim=1)
    input_ids = torch.cat([lead, pairs.flatten(1), gap, queries.flatten(1)], dim=1)

    query_keys = c.query_start + c.pair_len * torch.arange(q)  # (Q,)
    value_positions = query_keys.unsqueeze(-1) + torch.arange(1, lv + 1)  # (Q, L)
    flat = value_positions.flatten().expand(b, q * lv)
    scored = torch.zeros(b, c.seq_len, dtype=torch.bool)
    scored[:, value_positions.flatten()] = True
    labels = torch.where(scored, input_ids, IGNORE)
    query_distance = query_keys - c.lead - c.pair_len * asked  # (B, Q)
    distance = torch.zeros(b, c.seq_len, dtype=torch.long)
    distance.scatter_(1, flat, query_distance.repeat_interleave(lv, dim=1))
    return MQARBatch(input_ids, labels, scored, distance, value_positions)


def predictions(logits: Tensor) -> Tensor:
    """(B, T) long: the argmax token for each position t from logits (B, T, V) at t - 1, so it
    lines up with input_ids and labels; position 0 has no prediction (-1)."""
    pred = torch.full(logits.shape[:2], -1, dtype=torch.long, device=logits.device)
    pred[:, 1:] = logits[:, :-1].argmax(dim=-1)
    return pred


def query_correct(logits_or_predictions: Tensor, batch: MQARBatch) -> Tensor:
    """(B, Q) bool: a query is right only if every one of its value tokens is predicted right.

    Takes logits (B, T, V) (predicted by `predictions`) or predictions (B, T) already aligned
    with input_ids (predictions[b, t] is the guess for input_ids[b, t]).
    """
    x = logits_or_predictions
    pred = predictions(x) if x.dim() == 3 else x
    if pred.shape != batch.input_ids.shape:
        raise ValueError(
            f"predictions of shape {tuple(pred.shape)} do not match input_ids "
            f"{tuple(batch.input_ids.shape)}; pass logits (B, T, V) or predictions (B, T)"
        )
    pos = batch.value_positions
    ok = pred[:, pos] == batch.input_ids[:, pos].to(pred.device)  # (B, Q, L)
    return ok.all(dim=-1)


def query_distance(batch: MQARBatch) -> Tensor:
    """(B, Q) long: each query's key-to-query distance."""
    return batch.distance[:, batch.value_positions[:, 0]]


def accuracy(logits_or_predictions: Tensor, batch: MQARBatch) -> float:
    """Fraction of queries answered right (all value tokens), over the whole batch."""
    return query_correct(logits_or_predictions, batch).float().mean().item()


@dataclass(frozen=True)
class Bucket:
    """Queries with low <= distance < high: how many, and the fraction answered right (nan
    when count is 0)."""

    low: int
    high: int
    count: int
    accuracy: float


def accuracy_by_distance(
    logits_or_predictions: Tensor, batch: MQARBatch, edges: Sequence[int]
) -> list[Bucket]:
    """Per-query accuracy in the buckets [edges[i], edges[i+1]) of key-to-query distance;
    queries outside [edges[0], edges[-1]) are not counted."""
    edges = list(edges)
    if len(edges) < 2 or any(a >= b for a, b in pairwise(edges)):
        raise ValueError(
            f"edges must be at least two strictly increasing distances, got {edges}; "
            "e.g. [0, 64, 256, 1024]"
        )
    right = query_correct(logits_or_predictions, batch).cpu()
    dist = query_distance(batch).cpu()
    out = []
    for low, high in pairwise(edges):
        inside = (dist >= low) & (dist < high)
        count = int(inside.sum())
        acc = right[inside].float().mean().item() if count else math.nan
        out.append(Bucket(low, high, count, acc))
    return out
