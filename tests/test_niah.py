"""RULER-style needle-in-a-haystack samples: exact length, needle placement, answers, scoring."""

from __future__ import annotations

import gzip
import itertools
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import bos_gpt2
from longkv.data.corpus import BUNDLED_CORPUS
from longkv.evals.haystack import ESSAY_FILES
from longkv.evals.niah import (
    _SPECS,
    ADJECTIVES,
    NOUNS,
    TASKS,
    WORD_KEYS,
    NiahSample,
    _distractors,
    _needles_and_template,
    make_sample,
    sample_score,
    string_match_all,
)
from longkv.train.tokenizer import gpt2_tokenizer

BUDGET = 128

NIAH = [t for t in TASKS if t != "passkey"]
ESSAY = ["niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery"]
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")
NUMBER = re.compile(r"\d{7}")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
WORD_KEY = re.compile(r"[a-z]+-[a-z]+")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@pytest.fixture(scope="module")
def tok() -> Any:
    """The GPT-2 BPE shipped with longkv (no network)."""
    tokenizer = gpt2_tokenizer()
    assert len(tokenizer) == 50257
    return tokenizer


@pytest.fixture(scope="module")
def corpus() -> Path:
    """The texts shipped with longkv: every essay file the haystacks read."""
    return BUNDLED_CORPUS


def sample(tok: Any, corpus: Path, task: str, length: int, depth: float, seed: int = 0, **kw):
    return make_sample(task, tok, length, depth, seed, corpus_dir=corpus, **kw)


def encode(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def split_prompt(s: NiahSample) -> tuple[str, str, str]:
    """(header, context, footer): the header ends at the first newline, the footer starts at
    the last one (the question and answer prefix hold no newline)."""
    a, b = s.prompt.index("\n") + 1, s.prompt.rindex("\n")
    return s.prompt[:a], s.prompt[a:b], s.prompt[b:]


def needle_for(s: NiahSample, answer: str) -> str:
    if s.task == "passkey":
        return f"The pass key is {answer}. Remember it. {answer} is the pass key."
    hits = [m.group(0) for m in NEEDLE_RE.finditer(s.prompt) if m.group(3) == answer]
    assert len(hits) == 1, (answer, hits)
    return hits[0]


def question_keys(s: NiahSample) -> list[str]:
    m = re.search(
        r"What (?:is|are all) the special magic \w+ for (.+?) mentioned in the provided text\?",
        s.prompt,
    )
    assert m, s.prompt[-300:]
    return re.split(r", and |, ", m.group(1))


# --- exact length ---------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1024, 1500, 4096])
@pytest.mark.parametrize("task", TASKS)
def test_exact_length(tok: Any, corpus: Path, task: str, length: int) -> None:
    s = sample(tok, corpus, task, length, 0.5, seed=length)
    assert len(s.input_ids) + BUDGET == length
    assert s.context_len == length and s.task == task and s.seed == length
    assert encode(tok, s.prompt) == s.input_ids  # the ids are the prompt's own tokenization


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_2", "niah_multikey_3"])
def test_exact_length_every_length_line_haystacks(tok: Any, corpus: Path, task: str) -> None:
    # Consecutive lengths hit every remainder, including the one-token gap that no line
    # prefix can fill (each line starts with its own newline token).
    for length in range(700, 730):
        s = sample(tok, corpus, task, length, (length % 5) / 4, seed=length)
        assert len(s.input_ids) + BUDGET == length, length
        assert encode(tok, s.prompt) == s.input_ids


def test_exact_length_long_and_other_budget(tok: Any, corpus: Path) -> None:
    for task in ("niah_single_2", "niah_multikey_2"):
        s = sample(tok, corpus, task, 16384, 0.25, seed=3)
        assert len(s.input_ids) + BUDGET == 16384
    s = sample(tok, corpus, "niah_multivalue", 2000, 0.7, answer_budget=64)
    assert len(s.input_ids) + 64 == 2000


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_3", "passkey"])
def test_a_tokenizer_that_adds_a_bos_gets_it_first(tok: Any, corpus: Path, task: str) -> None:
    """The BOS takes one of the prompt's tokens; the prompt's text and needles follow it."""
    bos = bos_gpt2()
    s = sample(bos, corpus, task, 1024, 0.5)
    assert len(s.input_ids) + BUDGET == 1024
    assert s.input_ids[0] == 50256 and encode(tok, s.prompt) == s.input_ids[1:]
    for pos, answer in zip(s.needle_positions, s.answers, strict=True):
        needle = needle_for(s, answer)
        n = len(encode(tok, needle))
        assert tok.decode(s.input_ids[pos : pos + n + 1]).lstrip().startswith(needle)
    with pytest.raises(ValueError, match="too small") as err:
        sample(bos, corpus, task, 150, 0.5)
    least = int(re.search(r"context_len >= (\d+)", str(err.value)).group(1))
    with pytest.raises(ValueError, match=f"context_len >= {least - 1}"):
        sample(tok, corpus, task, 150, 0.5)  # one token less without the BOS
    assert len(sample(bos, corpus, task, least, 0.5).input_ids) + BUDGET == least


def test_exact_length_sentencepiece_style_tokenizer(corpus: Path) -> None:
    """A Metaspace BPE trained here, whose merges (e.g. '.\\n') break the GPT-2 additivity."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = gzip.decompress((corpus / ESSAY_FILES[0]).read_bytes()).decode()[:100_000]
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<unk>"],
        initial_alphabet=list("0123456789abcdef-:.\n"),
        show_progress=False,
    )
    raw.train_from_iterator([text], trainer)
    sp = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    for task in ("niah_single_1", "niah_single_2", "niah_multikey_3", "passkey"):
        for length in range(600, 612):
            s = make_sample(task, sp, length, 0.5, length, corpus_dir=corpus)
            assert len(s.input_ids) + BUDGET == length, (task, length)
            for pos, answer in zip(s.needle_positions, s.answers, strict=True):
                window = sp.decode(s.input_ids[pos : pos + 400]).lstrip()
                assert window.startswith(("One of the special magic", "The pass key is"))
                assert answer in window


# --- needles and depth ----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("task", TASKS)
def test_needle_positions_and_depth(tok: Any, corpus: Path, task: str, depth: float) -> None:
    s = sample(tok, corpus, task, 4096, depth, seed=11)
    assert len(s.needle_positions) == len(s.answers)
    for pos, answer in zip(s.needle_positions, s.answers, strict=True):
        needle = needle_for(s, answer)
        assert s.prompt.count(needle) == 1
        n = len(encode(tok, needle))
        assert tok.decode(s.input_ids[pos : pos + n + 1]).lstrip().startswith(needle)
        first = tok.decode(s.input_ids[pos : pos + 1]).lstrip()
        assert first and needle.startswith(first)  # pos is the needle's first token
    header, _, footer = split_prompt(s)
    start = len(encode(tok, header))
    end = len(s.input_ids) - len(encode(tok, footer))
    rel = (s.needle_positions[0] - start) / (end - start)
    if depth == 0.0:
        assert s.needle_positions[0] == start  # the first thing in the haystack
    # Tolerance: the needle goes to the unit boundary nearest the depth, so it is off by at
    # most half a unit (essay units are cut at 60 words, <= ~120 GPT-2 tokens), plus the other
    # needles placed before it (<= 3 x ~25 tokens); at depth 1 it is followed by itself
    # (<= ~65 tokens) and the end fragment (< 1 unit). That is < 200 tokens of the ~3.85k
    # haystack tokens: 5%. (Observed worst over 15 seeds: 3.1%, uuid needle haystack.)
    assert abs(rel - depth) <= 0.05, rel


def test_depth_moves_only_the_needle(tok: Any, corpus: Path) -> None:
    a = sample(tok, corpus, "niah_single_2", 3000, 0.2, seed=5)
    b = sample(tok, corpus, "niah_single_2", 3000, 0.8, seed=5)
    assert a.answers == b.answers
    assert b.needle_positions[0] - a.needle_positions[0] > 0.5 * 2800
    needle = needle_for(a, a.answers[0])
    assert a.prompt.replace(needle + " ", "") == b.prompt.replace(needle + " ", "")
    assert question_keys(a) == question_keys(b)


# --- answers and haystacks ------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_answers_and_keys(tok: Any, corpus: Path, task: str) -> None:
    s = sample(tok, corpus, task, 2048, 0.5, seed=7)
    expected = {"niah_multivalue": 4, "niah_multiquery": 4}.get(task, 1)
    assert len(s.answers) == expected
    assert len(set(s.answers)) == expected
    fmt = {"niah_single_3": UUID, "niah_multikey_3": UUID, "passkey": re.compile(r"\d{5}")}
    for answer in s.answers:
        assert fmt.get(task, NUMBER).fullmatch(answer), answer
        assert s.prompt.count(answer) == (2 if task == "passkey" else 1)
    if task == "passkey":
        assert s.prompt.startswith("There is an important info hidden")
        assert s.prompt.endswith("\nWhat is the pass key? The pass key is")
        return
    keys = question_keys(s)
    assert len(keys) == (4 if task == "niah_multiquery" else 1)
    key_re = UUID if task == "niah_multikey_3" else WORD_KEY
    assert all(key_re.fullmatch(k) for k in keys)
    _, context, _ = split_prompt(s)
    found = {m.group(3): m.group(2) for m in NEEDLE_RE.finditer(context)}
    for answer in s.answers:  # each answer sits in a needle for an asked key
        assert found[answer] in keys
    if task == "niah_multivalue":
        assert {found[a] for a in s.answers} == set(keys)
    if task == "niah_multiquery":
        assert [found[a] for a in s.answers] == keys
    if task == "niah_multikey_1":
        needles = list(NEEDLE_RE.finditer(context))
        assert len(needles) == 4 and len({m.group(2) for m in needles}) == 4
        assert sum(m.group(2) == keys[0] for m in needles) == 1
    if task in ESSAY:  # needles only where expected: essay text holds no other needle
        want = {"niah_multikey_1": 4}.get(task, expected)
        assert len(NEEDLE_RE.findall(context)) == want


def test_prompt_wording(tok: Any, corpus: Path) -> None:
    single = sample(tok, corpus, "niah_single_1", 1024, 0.5)
    key = question_keys(single)[0]
    assert single.prompt.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize "
        "it. I will quiz you about the number afterwards.\n"
    )
    assert single.prompt.endswith(
        f"\nWhat is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )
    assert f"One of the special magic numbers for {key} is: {single.answers[0]}." in single.prompt
    uuid_single = sample(tok, corpus, "niah_single_3", 1024, 0.5)
    assert uuid_single.prompt.startswith("A special magic uuid is hidden")
    assert "One of the special magic uuids for " in uuid_single.prompt
    multi = sample(tok, corpus, "niah_multiquery", 1024, 0.5)
    k = question_keys(multi)
    query = f"{k[0]}, {k[1]}, {k[2]}, and {k[3]}"
    assert multi.prompt.startswith(
        "Some special magic numbers are hidden within the following text. Make sure to "
        "memorize it. I will quiz you about the numbers afterwards.\n"
    )
    assert multi.prompt.endswith(
        f"\nWhat are all the special magic numbers for {query} mentioned in the provided text? "
        f"The special magic numbers for {query} mentioned in the provided text are"
    )
    assert sample(tok, corpus, "niah_multivalue", 1024, 0.5).prompt.startswith("Some special")


@pytest.mark.parametrize("task", ["niah_multikey_2", "niah_multikey_3"])
def test_needle_haystack_lines(tok: Any, corpus: Path, task: str) -> None:
    s = sample(tok, corpus, task, 4096, 0.5, seed=2)
    tv, key_re, val_re = (
        ("numbers", WORD_KEY, NUMBER) if task == "niah_multikey_2" else ("uuids", UUID, UUID)
    )
    line_re = re.compile(rf"One of the special magic {tv} for (\S+) is: (\S+)\.")
    (key,) = question_keys(s)
    _, context, _ = split_prompt(s)
    lines = [line for line in context.split("\n") if line]  # a blank line may fill one token
    full = [line_re.fullmatch(line) for line in lines]
    assert all(full[:-1]), [line for line, m in zip(lines, full, strict=True) if not m][:3]
    if full[-1] is None:  # the end fragment: a truncated distractor line
        head = f"One of the special magic {tv} for "
        assert head.startswith(lines[-1]) or lines[-1].startswith(head)
    matches = [m for m in full if m]
    assert len(matches) > (100 if task == "niah_multikey_2" else 50)
    for m in matches:
        assert key_re.fullmatch(m.group(1)) and val_re.fullmatch(m.group(2))
    assert context.count(key) == 1
    asked = [m for m in matches if m.group(1) == key]
    assert len(asked) == 1 and asked[0].group(2) == s.answers[0]
    assert sum(m.group(2) == s.answers[0] for m in matches) == 1
    keys = [m.group(1) for m in matches]
    assert len(set(keys)) == len(keys)  # distinct while the word pool lasts


def test_distractor_stream_avoids_asked_keys_and_answers() -> None:
    """Long needle haystacks: the asked key never recurs, even after the word pool runs out."""
    spec = _SPECS["niah_multikey_2"]
    _, _, needles, answers = _needles_and_template(spec, random.Random(0))
    asked = NEEDLE_RE.fullmatch(needles[0][0]).group(2)
    lines = list(itertools.islice(_distractors(spec, random.Random(1), needles, answers), 25_000))
    keys = [NEEDLE_RE.fullmatch(line).group(2) for line in lines]
    assert asked not in keys
    assert len(set(keys[: len(WORD_KEYS) - 1])) == len(WORD_KEYS) - 1
    assert not set(answers) & {NEEDLE_RE.fullmatch(line).group(3) for line in lines}


def test_noise_haystack(tok: Any, corpus: Path) -> None:
    s = sample(tok, corpus, "niah_single_1", 2048, 0.3, seed=4)
    _, context, _ = split_prompt(s)
    lines = [line for line in context.split("\n") if line]
    needle = needle_for(s, s.answers[0])
    assert lines.count(needle) == 1
    rest = [line for line in lines if line != needle]
    assert all(line == NOISE for line in rest[:-1])
    assert NOISE.startswith(rest[-1])  # whole line or the end fragment
    assert len(rest) > 50


def test_essay_haystack_is_corpus_prose(tok: Any, corpus: Path) -> None:
    text = " ".join(
        " ".join(gzip.decompress((corpus / name).read_bytes()).decode().replace("_", "").split())
        for name in ESSAY_FILES
    )
    for seed in range(3):
        s = sample(tok, corpus, "niah_single_2", 2048, 0.5, seed=seed)
        _, context, _ = split_prompt(s)
        needle = needle_for(s, s.answers[0])
        before, after = context.split(needle)
        for piece in (before[:150], before[-150:], after[1:150]):
            if len(piece.strip()) > 40:
                assert piece.strip()[:40] in text, piece[:40]
        assert len(context.split()) > 1000  # English prose, ~1.3 tokens a word


def test_word_lists() -> None:
    assert len(ADJECTIVES) >= 50 and len(NOUNS) >= 50
    assert len(set(ADJECTIVES)) == len(ADJECTIVES) and len(set(NOUNS)) == len(NOUNS)
    assert all(w.isalpha() and w.islower() for w in ADJECTIVES + NOUNS)
    # so that no key "adj-noun" is a substring of another key
    assert not [(a, b) for a in ADJECTIVES for b in ADJECTIVES if a != b and b.endswith(a)]
    assert not [(a, b) for a in NOUNS for b in NOUNS if a != b and b.startswith(a)]


# --- determinism ----------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_seeded(tok: Any, corpus: Path, task: str) -> None:
    a = sample(tok, corpus, task, 1500, 0.4, seed=123)
    b = sample(tok, corpus, task, 1500, 0.4, seed=123)
    c = sample(tok, corpus, task, 1500, 0.4, seed=124)
    assert a == b
    assert a.answers != c.answers
    assert a.prompt != c.prompt


def test_tasks() -> None:
    assert len(TASKS) == 9 and len(set(TASKS)) == 9
    assert set(NIAH) == {
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
    }


# --- scoring --------------------------------------------------------------------------------


def test_string_match_all() -> None:
    preds = ["the numbers are 1234567 and 7654321", "nothing"]
    assert string_match_all(preds, [["1234567", "7654321"], ["42"]]) == 50.0
    assert string_match_all(["only 1234567 here"], [["1234567", "7654321"]]) == 50.0
    u = "3de3efac-0232-4c66-a0dc-b53ca09f836f"
    assert string_match_all([f"It is {u.upper()}."], [[u]]) == 100.0
    assert string_match_all(["x"], [["y"]]) == 0.0
    three = string_match_all(["1 2 3", "1", "none"], [["1", "2", "3"], ["1", "2"], ["7"]])
    assert math.isclose(three, 100 * (1 + 0.5 + 0) / 3)
    assert sample_score("A 1 b", ["a", "B", "c"]) == pytest.approx(2 / 3)
    assert sample_score("abc", ["ABC"]) == 1.0
    with pytest.raises(ValueError, match="pair up"):
        string_match_all(["a"], [["a"], ["b"]])
    with pytest.raises(ValueError):
        sample_score("a", [])


# --- errors ---------------------------------------------------------------------------------


def test_bad_arguments(tok: Any, corpus: Path) -> None:
    with pytest.raises(ValueError, match="unknown task 'niah_single_9'"):
        sample(tok, corpus, "niah_single_9", 1024, 0.5)
    for depth in (-0.01, 1.01, float("nan")):
        with pytest.raises(ValueError, match="depth"):
            sample(tok, corpus, "niah_single_1", 1024, depth)
    for task in TASKS:
        with pytest.raises(ValueError, match="too small") as err:
            sample(tok, corpus, task, 150, 0.5)
        # the message names the minimum; it holds exactly the template, needles and budget
        least = int(re.search(r"context_len >= (\d+)", str(err.value)).group(1))
        assert 180 < least < 320
        s = sample(tok, corpus, task, least, 0.5)
        assert len(s.input_ids) + BUDGET == least
        with pytest.raises(ValueError, match="too small"):
            sample(tok, corpus, task, least - 1, 0.5)


def test_missing_corpus(tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "no_such_corpus"
    with pytest.raises(FileNotFoundError) as err:
        make_sample("niah_single_2", tok, 1024, 0.5, 0, corpus_dir=missing)
    msg = str(err.value)
    assert str(missing) in msg and "corpus_dir=" in msg and "LONGKV_CORPUS_DIR" in msg
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / ESSAY_FILES[0]))):
        make_sample("niah_single_2", tok, 1024, 0.5, 0, corpus_dir=tmp_path)  # empty folder
    monkeypatch.setenv("LONGKV_CORPUS_DIR", str(missing))
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        make_sample("niah_multiquery", tok, 1024, 0.5, 0)
    # haystacks that are not essays need no corpus
    assert make_sample("niah_single_1", tok, 1024, 0.5, 0, corpus_dir=missing).answers


def test_corpus_dir_default_env_and_argument(
    tok: Any, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LONGKV_CORPUS_DIR", raising=False)
    default = make_sample("niah_single_2", tok, 1024, 0.5, 0)  # the shipped texts
    assert default == sample(tok, corpus, "niah_single_2", 1024, 0.5)
    other = tmp_path / "other"  # another corpus with the same file names
    for name in ESSAY_FILES:
        (other / name).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(other / name, "wt") as f:
            f.write("The whale swam far away from the ship today.\n\n" * 100)
    monkeypatch.setenv("LONGKV_CORPUS_DIR", str(other))
    from_env = make_sample("niah_single_2", tok, 1024, 0.5, 0)
    assert "The whale swam far away" in from_env.prompt and from_env != default
    assert make_sample("niah_single_2", tok, 1024, 0.5, 0, corpus_dir=corpus) == default
