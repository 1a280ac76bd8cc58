"""MQAR batches: exact layout, vocabulary, seeds, labels against the model's loss, scoring."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_longkv
from longkv.checks import SettingError
from longkv.evals.synthetic import (
    Bucket,
    MQARBatch,
    MQARConfig,
    accuracy,
    accuracy_by_distance,
    make_mqar,
    predictions,
    query_correct,
    query_distance,
)

SETTINGS = [
    MQARConfig(num_pairs=5, num_queries=3, gap=7, filler="random", value_len=1, vocab_size=40),
    MQARConfig(num_pairs=4, num_queries=4, gap=9, filler="repeated", value_len=3, vocab_size=30),
    MQARConfig(num_pairs=1, num_queries=1, gap=0, filler="random", value_len=2, vocab_size=18),
    MQARConfig(num_pairs=3, num_queries=2, gap=2, filler="random", vocab_size=30, lead=5),
    MQARConfig(num_pairs=2, num_queries=2, gap=0, filler="repeated", value_len=2, lead=7),
]


def one_hot_logits(batch, vocab_size: int):
    """(B, T, V) logits one-hot on the next input token: a model that is always right."""
    logits = torch.full((*batch.input_ids.shape, vocab_size), -1e4, dtype=torch.float64)
    nxt = batch.input_ids[:, 1:]
    logits[:, :-1].scatter_(-1, nxt.unsqueeze(-1), 1e4)
    return logits


@pytest.mark.parametrize("c", SETTINGS)
def test_layout_lengths_and_vocabulary(c: MQARConfig) -> None:
    batch = make_mqar(c, 6)
    p, q, lv = c.num_pairs, c.num_queries, c.value_len
    assert c.seq_len == c.lead + (p + q) * (1 + lv) + c.gap
    assert batch.input_ids.shape == (6, c.seq_len) and batch.input_ids.dtype == torch.long
    assert batch.labels.shape == batch.scored.shape == batch.distance.shape == (6, c.seq_len)
    ids = batch.input_ids
    n = c.key_vocab
    pairs = ids[:, c.lead : c.lead + p * (1 + lv)].view(6, p, 1 + lv)
    gap = torch.cat([ids[:, : c.lead], ids[:, c.lead + p * (1 + lv) : c.query_start]], dim=1)
    queries = ids[:, c.query_start :].view(6, q, 1 + lv)
    assert ((pairs[..., 0] >= 0) & (pairs[..., 0] < n)).all()  # keys
    assert ((pairs[..., 1:] >= n) & (pairs[..., 1:] < 2 * n)).all()  # values
    assert ((gap >= 2 * n) & (gap < 2 * n + c.filler_vocab)).all()  # lead and gap: filler
    assert ids.max() < c.vocab_size
    for row in range(6):
        keys = pairs[row, :, 0].tolist()
        assert len(set(keys)) == p and len(set(pairs[row, :, 1].tolist())) == p
        value_of = {k: pairs[row, i, 1:].tolist() for i, k in enumerate(keys)}
        asked = queries[row, :, 0].tolist()
        assert len(set(asked)) == q
        for j, k in enumerate(asked):  # each query repeats its pair: key, then its value
            assert queries[row, j, 1:].tolist() == value_of[k]


@pytest.mark.parametrize("c", SETTINGS)
def test_labels_and_distances(c: MQARConfig) -> None:
    batch = make_mqar(c, 4)
    lv = c.value_len
    expect = torch.zeros(c.seq_len, dtype=torch.bool)
    for j in range(c.num_queries):
        start = c.query_start + j * (1 + lv) + 1
        expect[start : start + lv] = True
    assert (batch.scored == expect).all()
    assert (batch.labels[batch.scored] == batch.input_ids[batch.scored]).all()
    assert (batch.labels[~batch.scored] == -100).all()
    ids = batch.input_ids
    for row in range(4):
        for t in batch.scored[row].nonzero().flatten().tolist():
            qk = (t - c.query_start) // (1 + lv) * (1 + lv) + c.query_start
            pairs = ids[row, c.lead : c.lead + c.num_pairs * (1 + lv)].tolist()
            key_pos = c.lead + pairs.index(ids[row, qk].item())
            assert batch.distance[row, t] == qk - key_pos
    assert (batch.distance[~batch.scored] == 0).all()


@pytest.mark.parametrize("gap", [6, 10, 17])
def test_pairs_lie_outside_a_window_no_longer_than_the_gap(gap: int) -> None:
    window = 6
    c = MQARConfig(num_pairs=6, num_queries=6, gap=gap, value_len=2, vocab_size=40)
    dist = query_distance(make_mqar(c, 8))
    assert (dist >= gap).all() and (dist >= window).all()
    # the largest distance is the first pair asked by the last query
    assert dist.max() <= (c.num_pairs + c.num_queries - 1) * 3 + gap


def test_filler_kinds() -> None:
    base = dict(num_pairs=3, num_queries=2, gap=40, vocab_size=40, filler_vocab=16)
    rep = make_mqar(MQARConfig(filler="repeated", **base), 3)
    c = MQARConfig(filler="repeated", **base)
    gap = rep.input_ids[:, 6 : c.query_start]
    assert (gap == c.filler_start + torch.arange(40) % 4).all()  # one short pattern
    rnd = make_mqar(MQARConfig(filler="random", **base), 3)
    gap = rnd.input_ids[:, 6 : c.query_start]
    assert len(set(gap.flatten().tolist())) > 4  # novel tokens, not one pattern
    assert not (gap[0] == gap[1]).all()


def test_seed_gives_the_same_batch_and_another_seed_a_different_one() -> None:
    c = SETTINGS[0]
    a, b = make_mqar(c, 5), make_mqar(c, 5)
    for name in ("input_ids", "labels", "scored", "distance"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    other = make_mqar(MQARConfig(**{**c.__dict__, "seed": 1}), 5)
    assert not torch.equal(a.input_ids, other.input_ids)


def test_model_loss_scores_exactly_the_answers() -> None:
    c = MQARConfig(num_pairs=3, num_queries=2, gap=4, value_len=2, vocab_size=53)
    batch = make_mqar(c, 2)
    model = tiny_longkv(["swa"], vocab_size=53)
    out = model(batch.input_ids, labels=batch.labels)
    logp = out.logits.log_softmax(-1)
    rows, ts = batch.scored.nonzero(as_tuple=True)
    by_hand = -logp[rows, ts - 1, batch.input_ids[rows, ts]].mean()
    assert abs(out.loss.item() - by_hand.item()) < 1e-10
    # a different set of positions gives a different loss: the check can fail
    shifted = -logp[rows, ts, batch.input_ids[rows, ts]].mean()
    assert abs(out.loss.item() - shifted.item()) > 1e-6
    # and it equals the cross entropy with the labels shifted by one
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), batch.labels[:, 1:].flatten())
    assert abs(out.loss.item() - ce.item()) < 1e-10


def test_one_hot_logits_score_one_and_one_wrong_value_token_fails_its_query() -> None:
    c = MQARConfig(num_pairs=4, num_queries=3, gap=5, value_len=3, vocab_size=40)
    batch = make_mqar(c, 2)
    logits = one_hot_logits(batch, c.vocab_size)
    assert accuracy(logits, batch) == 1.0
    pred = predictions(logits)
    assert (pred[:, 1:] == batch.input_ids[:, 1:]).all() and (pred[:, 0] == -1).all()
    # the last value token of query 1 in row 0 is wrong: only that query is wrong
    t = batch.value_positions[1, -1].item()
    wrong = logits.clone()
    wrong[0, t - 1] = 0.0
    wrong[0, t - 1, (batch.input_ids[0, t] + 1) % c.vocab_size] = 1.0
    right = query_correct(wrong, batch)
    assert right.tolist() == [[True, False, True], [True, True, True]]
    assert accuracy(wrong, batch) == pytest.approx(5 / 6)
    # a wrong token outside the answers changes nothing
    off = logits.clone()
    off[0, c.query_start - 1] = 0.0
    assert accuracy(off, batch) == 1.0


def test_accuracy_by_distance_hand_case() -> None:
    c = MQARConfig(num_pairs=4, num_queries=4, gap=0, value_len=1, vocab_size=24)
    batch = make_mqar(c, 1)
    pred = batch.input_ids.clone()
    dist = query_distance(batch)[0]  # query j at 8 + 2j asks pair i at 2i: 8 + 2(j - i)
    pred[0, batch.value_positions[0, 0]] = -5  # query 0 wrong
    d0 = dist[0].item()
    # a bucket edge at d0 puts query 0 in the upper bucket: low is inclusive
    buckets = accuracy_by_distance(pred, batch, [0, d0, 100])
    lower = (dist < d0).sum().item()
    assert [(b.low, b.high, b.count) for b in buckets] == [(0, d0, lower), (d0, 100, 4 - lower)]
    assert buckets[1].accuracy == pytest.approx((4 - lower - 1) / (4 - lower))
    if lower:
        assert buckets[0].accuracy == 1.0
    else:
        assert math.isnan(buckets[0].accuracy)
    # high is exclusive: an upper edge at d0 leaves query 0 out
    top = accuracy_by_distance(pred, batch, [0, d0])[0]
    assert top.count == lower


def test_accuracy_by_distance_handmade_batch() -> None:
    # two rows, two one-token queries whose values sit at positions 3 and 5
    ids = torch.tensor([[0, 10, 0, 10, 1, 11], [1, 12, 1, 12, 1, 12]])
    scored = torch.zeros(2, 6, dtype=torch.bool)
    scored[:, [3, 5]] = True
    distance = torch.zeros(2, 6, dtype=torch.long)
    distance[:, [3, 5]] = torch.tensor([[4, 8], [8, 12]])
    batch = MQARBatch(
        ids, torch.where(scored, ids, -100), scored, distance, torch.tensor([[3], [5]])
    )
    pred = ids.clone()
    pred[0, 5] = 13  # row 0, query 1 (distance 8) wrong
    assert query_correct(pred, batch).tolist() == [[True, False], [True, True]]
    assert accuracy(pred, batch) == 0.75
    buckets = accuracy_by_distance(pred, batch, [4, 8, 12])
    # low edges are inclusive, high edges exclusive: distance 12 falls outside
    assert [(b.low, b.high, b.count, b.accuracy) for b in buckets] == [
        (4, 8, 1, 1.0),
        (8, 12, 2, 0.5),
    ]
    empty = accuracy_by_distance(pred, batch, [0, 4])[0]
    assert empty.count == 0 and math.isnan(empty.accuracy)
    assert accuracy_by_distance(pred, batch, [9, 13])[0] == Bucket(9, 13, 1, 1.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_pairs=0), "MQARConfig.num_pairs"),
        (dict(num_queries=9, num_pairs=8), "MQARConfig.num_queries"),
        (dict(gap=-1), "MQARConfig.gap"),
        (dict(lead=-2), "MQARConfig.lead"),
        (dict(filler="zeros"), "MQARConfig.filler"),
        (dict(value_len=0), "MQARConfig.value_len"),
        (dict(vocab_size=31, num_pairs=8, filler_vocab=16), "MQARConfig.vocab_size"),
        (dict(filler_vocab=0), "MQARConfig.filler_vocab"),
        (dict(seed=1.5), "MQARConfig.seed"),
        (dict(lead_kind="noise"), "MQARConfig.lead_kind"),
        (dict(lead_kind="novel", lead=4), "MQARConfig.lead_vocab"),
        (dict(vocab_size=63, lead_kind="novel", lead_vocab=32), "MQARConfig.vocab_size"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SettingError) as err:
        MQARConfig(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize("kind", ["novel", "repeated"])
def test_a_lead_of_its_own_ids_comes_before_the_pairs_and_shares_no_id(kind: str) -> None:
    c = MQARConfig(num_pairs=4, num_queries=4, gap=6, vocab_size=600, lead=300, lead_kind=kind,
                   lead_vocab=400, seed=3)  # fmt: skip
    batch = make_mqar(c, 5)
    ids, n = batch.input_ids, c.key_vocab
    assert n == 92 and c.lead_start == 2 * n + 16
    assert ids.shape == (5, 300 + 8 * 2 + 6) and c.query_start == 300 + 8 + 6
    lead, rest = ids[:, :300], ids[:, 300:]
    assert ((lead >= c.lead_start) & (lead < c.lead_start + 400)).all()
    assert (rest < c.lead_start).all()  # keys, values and the gap's filler: no lead id
    gap = rest[:, 8:14]
    assert ((gap >= 2 * n) & (gap < 2 * n + 16)).all()
    distinct = [len(set(row.tolist())) for row in lead]
    if kind == "novel":  # 300 draws of 400 ids: about 210 distinct (400 (1 - e^-0.75))
        assert all(180 < d < 240 for d in distinct)
    else:
        assert distinct == [4] * 5 and lead[0, :8].tolist() == [
            c.lead_start + i % 4 for i in range(8)
        ]
    assert torch.equal(make_mqar(c, 5).input_ids, ids)  # seeded
    assert not torch.equal(make_mqar(replace(c, seed=4), 5).input_ids, ids)
    # the same pairs and queries are scored wherever they stand: only positions move
    assert int(batch.scored.sum()) == 5 * 4
    unled = make_mqar(replace(c, lead=0), 5)
    assert torch.equal(batch.distance[batch.scored], unled.distance[unled.scored])


def test_bad_scoring_inputs() -> None:
    batch = make_mqar(MQARConfig(), 2)
    with pytest.raises(ValueError, match="strictly increasing"):
        accuracy_by_distance(batch.input_ids, batch, [5, 5])
    with pytest.raises(ValueError, match="do not match input_ids"):
        accuracy(batch.input_ids[:, 1:], batch)
    with pytest.raises(SettingError, match="batch_size"):
        make_mqar(MQARConfig(), 0)


def test_worked_example_in_docs() -> None:
    c = MQARConfig(
        num_pairs=3, num_queries=2, gap=6, filler="repeated", value_len=2, vocab_size=32,
        filler_vocab=8,
    )  # fmt: skip
    b = make_mqar(c, 1)
    assert b.input_ids[0].tolist() == [
        2, 12, 23, 3, 18, 15, 4, 13, 22, 24, 25, 26, 27, 24, 25, 2, 12, 23, 4, 13, 22,
    ]  # fmt: skip
    assert b.scored[0].nonzero().flatten().tolist() == [16, 17, 19, 20]
    assert query_distance(b)[0].tolist() == [15, 12]
