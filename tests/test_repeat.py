"""Where an answer stops (`document.repeat.AnswerWatch`): a repeat of 8 tokens within a line,
a repeated line, a base model's first line; what it shows as the answer comes never holds the
cut part; random token streams stop where the rule written out says."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from longkv.document.repeat import NGRAM, AnswerWatch
from longkv.train.tokenizer import gpt2_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return gpt2_tokenizer()


def stream(watch: AnswerWatch, tokens: list[int]) -> tuple[list[str], int]:
    """Feed tokens until the watch stops: the shown text after each, and the tokens fed."""
    shown = []
    for i, token in enumerate(tokens):
        stop = watch(torch.tensor([token]))
        shown.append(watch.text[: watch.shown])
        if stop:
            return shown, i + 1
    return shown, len(tokens)


@pytest.mark.parametrize(
    ("said", "one_line", "answer"),
    [
        (
            "I am not sure of the number of people. I am not sure of the number of people. I am",
            False,
            "I am not sure of the number of people.",
        ),
        (
            "Miss Taylor is a most excellent and excellent friend to Emma. She is a\nkind friend, "
            "and has been a most excellent and excellent\nfriend to Emma. She is a most "
            "excellent and excellent friend to Emma.",
            False,  # no half sentence left: the one the repeat starts in goes too
            "Miss Taylor is a most excellent and excellent friend to Emma. She is a\nkind friend, "
            "and has been a most excellent and excellent\nfriend to Emma.",
        ),
        (  # the repeat's characters stand before its first place too ("t" of "excellent")
            "The most excellent, and most just, and most just, and most just, and most",
            False,  # the answer ends at a word's end, not inside "just"
            "The most excellent, and most just",
        ),
        ("Kitty.\nThe answer is:\nThe answer is:\nLongbourn", False, "Kitty.\nThe answer is:"),
        ("The answer is, two.\nThe answer is, two.\nThe", False, "The answer is, two."),
        (" Mr. Bingley.\nQuestion: Who is he?\nAnswer:", True, "Mr. Bingley."),
        (' Mr. Bingley. "I am not so sure of that," said Jane', True, "Mr. Bingley."),
        (" Dr. J. Smith, of St. Albans, came. He said", True, "Dr. J. Smith, of St. Albans, came."),
        (" Who knows? Perhaps not", True, "Who knows?"),
        (" It was at Camberwell. Then he", True, "It was at Camberwell."),  # a long word's period
        ("Mr. Bingley.\nQuestion: Who is he?\nAnswer:", False, None),  # no repeat: all of it
        ("Mr. Bingley and Mr. Bingley's sister, Miss Bingley, came.", False, None),
    ],
)
def test_an_answer_stops_where_it_repeats_and_never_shows_the_repeat(
    tokenizer: Any, said: str, one_line: bool, answer: str | None
) -> None:
    tokens = tokenizer(said)["input_ids"]
    watch = AnswerWatch(tokenizer, one_line=one_line)
    shown, used = stream(watch, tokens)
    final = watch.final()
    assert final == (said.lstrip() if answer is None else answer)
    assert watch.stopped == (answer is not None) and (used < len(tokens)) == watch.stopped
    assert all(final.startswith(s) for s in shown), shown  # nothing shown is taken back
    assert AnswerWatch(tokenizer, one_line=one_line).cut(tokens) == (final, used)


def test_without_stops_the_watch_shows_everything_and_never_stops(tokenizer: Any) -> None:
    said = "Kitty.\nKitty.\nKitty."
    tokens = tokenizer(said)["input_ids"]
    watch = AnswerWatch(tokenizer, stops=False)
    shown, used = stream(watch, tokens)
    assert used == len(tokens) and watch.final() == said and shown[-1] == said


def test_a_character_cut_between_tokens_is_not_shown_until_it_is_whole(tokenizer: Any) -> None:
    tokens = tokenizer("café ☕")["input_ids"]  # the cup takes three byte tokens
    watch = AnswerWatch(tokenizer)
    shown, _ = stream(watch, tokens)
    assert all("\ufffd" not in s for s in shown) and watch.final() == "café ☕"


def first_repeat(tokens: list[int], n: int) -> int | None:
    """The rule written out: the first count of tokens whose last n occur earlier in them."""
    for i in range(n + 1, len(tokens) + 1):
        prefix = tokens[:i]
        if any(prefix[j : j + n] == prefix[-n:] for j in range(i - n)):
            return i
    return None


@pytest.mark.parametrize("seed", range(20))
def test_random_streams_stop_where_the_rule_written_out_says(tokenizer: Any, seed: int) -> None:
    """Tokens drawn from a few words (no newline): the watch stops at the first n-gram repeat
    and the answer is the text before it starts."""
    rng = random.Random(seed)
    words = [tokenizer(w)["input_ids"][0] for w in (" a", " b", " c")]
    tokens = [rng.choice(words) for _ in range(60)]
    stop = first_repeat(tokens, NGRAM)
    watch = AnswerWatch(tokenizer)
    shown, used = stream(watch, tokens)
    assert used == (len(tokens) if stop is None else stop)
    want = tokenizer.decode(tokens if stop is None else tokens[: stop - NGRAM]).strip()
    assert watch.final() == (want if stop is not None else tokenizer.decode(tokens).lstrip())
    assert all(watch.final().startswith(s) for s in shown)


@pytest.mark.parametrize("one_line", [False, True])
def test_random_sentences_never_show_what_is_cut_and_the_first_streams_by_token(
    tokenizer: Any, one_line: bool
) -> None:
    """Streams of a few words, sentence marks and newlines: what is shown is never taken back
    (200 seeds), and the first sentence is shown before it ends."""
    pieces = [" a", " b", " c", " I", "I", " am", ".", "!", "\n", " Mr", "."]
    ids = [tokenizer(p)["input_ids"] for p in pieces]
    assert all(len(i) == 1 for i in ids)
    for seed in range(200):
        rng = random.Random(seed)
        tokens = [rng.choice(ids)[0] for _ in range(80)]
        watch = AnswerWatch(tokenizer, one_line=one_line)
        shown, _ = stream(watch, tokens)
        assert all(watch.final().startswith(s) for s in shown), (seed, shown)
    first = tokenizer(" Charlotte Lucas is a friend of Elizabeth Bennet.")["input_ids"]
    watch = AnswerWatch(tokenizer, one_line=one_line)
    shown, _ = stream(watch, first)
    assert shown[2] == "Charlotte Lucas is"  # before its sentence ends
