"""RULER-style needle-in-a-haystack samples (NVIDIA/RULER `niah`) and their scoring.

Spec: docs/evals.md section 1. `make_sample(task, tokenizer, context_len, depth, seed)`
builds one prompt that the model continues; `string_match_all` scores the continuations.

Tasks (RULER names; `passkey` is the Landmark-attention passkey test):

| task            | haystack | key -> value     | needles                          |
|-----------------|----------|------------------|----------------------------------|
| niah_single_1   | noise    | word -> number   | 1                                |
| niah_single_2   | essay    | word -> number   | 1                                |
| niah_single_3   | essay    | word -> uuid     | 1                                |
| niah_multikey_1 | essay    | word -> number   | 4 keys, 1 asked                  |
| niah_multikey_2 | needle   | word -> number   | 1 asked; every other line a      |
|                 |          |                  | distractor needle                |
| niah_multikey_3 | needle   | uuid -> uuid     | as multikey_2                    |
| niah_multivalue | essay    | word -> number   | 4 values of one key, all asked   |
| niah_multiquery | essay    | word -> number   | 4 keys, all asked                |
| passkey         | noise    | - -> 5 digits    | 1                                |

Text. A needle is `One of the special magic {type_v} for {key} is: {value}.` with the plural
type_v ("numbers", "uuids") whatever the count, exactly as RULER writes it. Words are
`adjective-noun` from the built-in lists `ADJECTIVES` x `NOUNS`, numbers have 7 digits, UUIDs are
random version-4 UUIDs. The prompt is the RULER template followed by its answer prefix:

    Some special magic {type_v} are hidden within the following text. Make sure to memorize it.
    I will quiz you about the {type_v} afterwards.\\n{context}\\nWhat are all the special magic
    {type_v} for {query} mentioned in the provided text? The special magic {type_v} for {query}
    mentioned in the provided text are

(one line in the prompt; `{query}` is `k1, k2, k3, and k4` for multiquery). Singular wording:
when one key is asked for one value (every task but multivalue and multiquery) the template
is changed the way RULER's `niah.py` does it ("Some" -> "A", "are all" -> "is", "are" -> "is",
type_v loses its "s": "numbers" -> "number", "uuids" -> "uuid"), giving

    A special magic number is hidden within the following text. Make sure to memorize it. I
    will quiz you about the number afterwards.\\n{context}\\nWhat is the special magic number
    for {query} mentioned in the provided text? The special magic number for {query}
    mentioned in the provided text is

Haystacks. `noise`: the line "The grass is green. The sky is blue. The sun is yellow. Here we go.
There and back again." repeated, one per line. `needle`: every line is a distractor needle with a
fresh key (never an asked key; distinct from each other until the word pool of
len(ADJECTIVES) * len(NOUNS) keys runs out) and a fresh value (never an expected value). `essay`:
sentences of prose from the corpus (`ESSAY_FILES` in `longkv.evals.haystack`, which says how
the text is cut into units), joined by single spaces, starting at a seeded random sentence and
wrapping around the corpus if needed. `passkey`: the noise line repeated, joined by spaces, with
the needle `The pass key is {v}. Remember it. {v} is the pass key.` (a random 5-digit key),
under the Landmark header and the question `What is the pass key?` with the answer prefix
` The pass key is`. Only the essay tasks read the corpus.

Depth. The haystack is a list of units (lines or sentences). The needle that carries
`answers[0]` goes to the unit boundary whose token offset (sum of the units' token counts) is
nearest to `depth` times the haystack's token count: 0 is before the first unit, 1 after the
last whole unit. The other needles of multikey_1, multivalue and multiquery go to boundaries at
seeded uniform random fractions (RULER places all of them at random depths). `needle_positions`
is parallel to `answers`: entry i is the token index in `input_ids` where the needle carrying
`answers[i]` starts (the first token holding the needle's first character; with the essay's
space joiner that token also holds the space, e.g. GPT-2's " One"). Distractor needles
(multikey_1's three other keys, every line of the needle haystack) are not listed.

Special tokens. `input_ids` starts with the ids the tokenizer puts before a text
(`longkv.data.corpus.special_prefix`: Gemma's `<bos>`; none for GPT-2 or SmolLM2), as the model
was trained to read; `prompt` is the text after them.

Exact length. `len(input_ids) == context_len - answer_budget`: whole units, then a fragment of
the next unit (`longkv.evals.haystack` gives the method and its fallbacks), so the haystack
usually ends with a partial sentence or line (for the needle haystack a truncated distractor
line, never one with an asked key).

Seeds. Everything random comes from `random.Random(f"longkv-niah:{task}:{seed}")`, in a fixed
order (keys, values, other needles' depths, haystack start or distractor stream), so the sample
is a function of (task, tokenizer, context_len, depth, seed, answer_budget, corpus) alone. The
random state does not depend on context_len or depth: the cells of a length x depth grid with
the same seed share keys, values and haystack start, and differ only in what the grid varies.

Scoring (RULER `string_match_all`): a sample scores the fraction of its expected values that
occur in the prediction as case-insensitive substrings; the metric is the mean over samples,
times 100.
"""

from __future__ import annotations

import itertools
import os
import random
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from longkv.data.corpus import corpus_dir as corpus_dir_of
from longkv.data.corpus import special_prefix
from longkv.evals.haystack import PromptBuilder, Units, essay_sentences, token_start

TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "passkey",
)

ANSWER_BUDGET = 128
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NOISE_LINE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
PASSKEY_NEEDLE = "The pass key is {value}. Remember it. {value} is the pass key."
PASSKEY_HEADER = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize them. I will quiz you about the important information there.\n"
)
PASSKEY_FOOTER = "\nWhat is the pass key? The pass key is"

# Keys are f"{adjective}-{noun}". No adjective ends another and no noun begins another, so one
# key is never a substring of a different key.
ADJECTIVES: tuple[str, ...] = (
    "amber", "ancient", "bitter", "brave", "breezy", "bright", "brisk", "calm", "candid",
    "cheerful", "chilly", "clever", "cosmic", "crimson", "curious", "dapper", "daring", "dizzy",
    "dusty", "eager", "elegant", "fancy", "fearless", "fierce", "fluffy", "frosty", "fuzzy",
    "gentle", "giant", "gloomy", "golden", "graceful", "grumpy", "hasty", "hollow", "humble",
    "hungry", "icy", "jolly", "jumpy", "keen", "lavish", "lazy", "little", "lively", "lonely",
    "lucky", "lush", "majestic", "mellow", "merry", "mighty", "misty", "modest", "muddy",
    "nimble", "noble", "noisy", "odd", "orange", "pale", "patient", "polite", "proud",
    "purple", "quaint", "quick", "quiet", "rapid", "rosy", "rustic", "salty", "scarlet", "shiny",
    "silent", "silver", "sleepy", "slim", "smooth", "snowy", "solid", "steady", "stormy",
    "sturdy", "sunny", "swift", "tender", "thirsty", "tidy", "tiny", "vast", "velvet", "violet",
    "vivid", "wandering", "wary", "wild", "witty", "wooden", "zesty",
)  # fmt: skip
NOUNS: tuple[str, ...] = (
    "anchor", "apple", "badger", "balloon", "banjo", "beacon", "biscuit", "blanket", "bottle",
    "bridge", "bucket", "cactus", "camera", "candle", "canyon", "carrot", "castle", "cello",
    "cherry", "chimney", "cobra", "comet", "compass", "cottage", "crayon", "cricket", "dolphin",
    "dragon", "eagle", "ember", "falcon", "feather", "ferry", "fiddle", "forest", "fountain",
    "garden", "glacier", "goblet", "gravel", "hammer", "harbor", "harp", "helmet", "hermit",
    "island", "jacket", "jungle", "kettle", "kitten", "ladder", "lantern", "lemon", "lizard",
    "magnet", "maple", "meadow", "mirror", "monkey", "mountain", "nectar", "oasis", "orchard",
    "otter", "paddle", "panda", "parrot", "pebble", "pencil", "pepper", "piano", "pillow",
    "pirate", "planet", "pocket", "puzzle", "quartz", "rabbit", "raven", "ribbon", "river",
    "rocket", "saddle", "salmon", "scarf", "shovel", "spider", "sponge", "squirrel", "teapot",
    "thunder", "tiger", "tulip", "turtle", "violin", "walnut", "whistle", "willow", "window",
    "wizard", "yogurt", "zebra",
)  # fmt: skip
WORD_KEYS: tuple[str, ...] = tuple(f"{a}-{n}" for a in ADJECTIVES for n in NOUNS)


@dataclass(frozen=True)
class _Spec:
    haystack: str  # "noise", "essay", "needle" or "passkey"
    key_type: str  # "words" or "uuids"
    value_type: str  # "numbers", "uuids" or "passkey"
    num_keys: int
    num_values: int
    num_queries: int


_SPECS: dict[str, _Spec] = {
    "niah_single_1": _Spec("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": _Spec("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": _Spec("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": _Spec("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": _Spec("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": _Spec("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": _Spec("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": _Spec("essay", "words", "numbers", 4, 1, 4),
    "passkey": _Spec("passkey", "words", "passkey", 1, 1, 1),
}
_JOINERS = {"noise": "\n", "needle": "\n", "essay": " ", "passkey": " "}


@dataclass(frozen=True)
class NiahSample:
    """One prompt: `prompt` is the full text the model continues; `input_ids` its tokens, after
    the tokenizer's special prefix (its BOS, where it adds one).

    `len(input_ids) + answer_budget == context_len`. `needle_positions[i]` is the token index
    where the needle carrying `answers[i]` starts (distractor needles are not listed).
    """

    task: str
    context_len: int
    depth: float
    prompt: str
    input_ids: list[int]
    answers: list[str]
    needle_positions: list[int]
    seed: int


def answer_span(tokenizer: Any, sample: NiahSample, i: int = 0) -> tuple[int, int]:
    """Token range [lo, hi) of `sample.input_ids` that spells answers[i] in its needle: the
    shortest range after the needle's start whose decoded text holds the answer."""
    ids, answer = sample.input_ids, sample.answers[i]
    start = hi = sample.needle_positions[i]
    while answer not in tokenizer.decode(ids[start:hi]):
        if hi == len(ids):
            raise ValueError(f"answer {answer!r} not found after token {start}")
        hi += 1
    lo = hi - 1
    while answer not in tokenizer.decode(ids[lo:hi]):
        lo -= 1
    return lo, hi


def sample_score(prediction: str, answers: Sequence[str]) -> float:
    """Fraction (0..1) of `answers` found in `prediction` (case-insensitive substring)."""
    if not answers:
        raise ValueError("sample_score needs at least one expected answer")
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_all(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """RULER's string_match_all: mean over samples of `sample_score`, times 100 (0..100)."""
    if len(predictions) != len(answers):
        raise ValueError(
            f"{len(predictions)} predictions but {len(answers)} answer lists; they must pair up"
        )
    if not predictions:
        raise ValueError("string_match_all needs at least one sample")
    return (
        100.0
        * sum(sample_score(p, a) for p, a in zip(predictions, answers, strict=True))
        / len(answers)
    )


def make_sample(
    task: str,
    tokenizer: Any,
    context_len: int,
    depth: float,
    seed: int,
    *,
    answer_budget: int = ANSWER_BUDGET,
    corpus_dir: str | os.PathLike[str] | None = None,
) -> NiahSample:
    """Build one sample with `len(input_ids) + answer_budget == context_len` exactly.

    `tokenizer` is a Hugging Face tokenizer (called as `tokenizer(text,
    add_special_tokens=False)` and `tokenizer.decode(ids)`). `depth` in [0, 1] places the needle
    of `answers[0]`; `corpus_dir` (essay tasks only) defaults to $LONGKV_CORPUS_DIR, else the
    texts shipped with longkv. See the module docstring for the method.
    """
    if task not in _SPECS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    if answer_budget < 0:
        raise ValueError(f"answer_budget must be >= 0, got {answer_budget}")
    spec = _SPECS[task]
    rng = random.Random(f"longkv-niah:{task}:{seed}")
    header, footer, needles, answers = _needles_and_template(spec, rng)
    others = [rng.random() for _ in needles[1:]]
    if spec.haystack == "essay":
        sentences = essay_sentences(corpus_dir_of(corpus_dir))
        start = rng.randrange(len(sentences))
        units = Units(tokenizer, " ", itertools.cycle(sentences[start:] + sentences[:start]))
    elif spec.haystack == "needle":
        stream = random.Random(rng.getrandbits(64))
        units = Units(tokenizer, "\n", _distractors(spec, stream, needles, answers))
    else:
        units = Units(tokenizer, _JOINERS[spec.haystack], itertools.repeat(NOISE_LINE))
    builder = PromptBuilder(tokenizer, header, footer, needles, [float(depth), *others], units)
    prefix = special_prefix(tokenizer)
    target = context_len - answer_budget - len(prefix)
    prompt, ids, starts = builder.fit(target, task, context_len)
    positions = [
        len(prefix) + token_start(tokenizer, prompt, ids, s, needles[i][0]) for i, s in starts
    ]
    ids = prefix + ids
    return NiahSample(
        task=task,
        context_len=context_len,
        depth=float(depth),
        prompt=prompt,
        input_ids=ids,
        answers=answers,
        needle_positions=positions,
        seed=seed,
    )


# --- keys, values, needles and template ---------------------------------------------------


def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "passkey":
        return str(rng.randint(10**4, 10**5 - 1))
    return rng.choice(WORD_KEYS)


def _distinct(kind: str, rng: random.Random, count: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        v = _random_value(kind, rng)
        if v not in out:
            out.append(v)
    return out


def _needles_and_template(
    spec: _Spec, rng: random.Random
) -> tuple[str, str, list[tuple[str, bool]], list[str]]:
    """Header, footer, needles as (text, expected), and answers; needles[i] carries answers[i]."""
    keys = _distinct(spec.key_type, rng, spec.num_keys)
    values = _distinct(spec.value_type, rng, spec.num_keys * spec.num_values)
    if spec.value_type == "passkey":
        text = PASSKEY_NEEDLE.format(value=values[0])
        return PASSKEY_HEADER, PASSKEY_FOOTER, [(text, True)], values
    nv, nq = spec.num_values, spec.num_queries
    per_key = [values[i * nv : (i + 1) * nv] for i in range(spec.num_keys)]
    needles = [
        (NEEDLE.format(type_v=spec.value_type, key=k, value=v), i < nq)
        for i, (k, vs) in enumerate(zip(keys, per_key, strict=True))
        for v in vs
    ]
    answers = [v for vs in per_key[:nq] for v in vs]
    asked = keys[:nq]
    query = asked[0] if nq == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    if nq * nv == 1:
        tv = spec.value_type[:-1]
        header = (
            f"A special magic {tv} is hidden within the following text. "
            f"Make sure to memorize it. I will quiz you about the {tv} afterwards.\n"
        )
        footer = (
            f"\nWhat is the special magic {tv} for {query} mentioned in the provided text?"
            f" The special magic {tv} for {query} mentioned in the provided text is"
        )
    else:
        tv = spec.value_type
        header = (
            f"Some special magic {tv} are hidden within the following text. "
            f"Make sure to memorize it. I will quiz you about the {tv} afterwards.\n"
        )
        footer = (
            f"\nWhat are all the special magic {tv} for {query} mentioned in the provided text?"
            f" The special magic {tv} for {query} mentioned in the provided text are"
        )
    return header, footer, needles, answers


# --- the needle haystack --------------------------------------------------------------------


def _distractors(
    spec: _Spec, rng: random.Random, needles: list[tuple[str, bool]], answers: list[str]
) -> Iterator[str]:
    """Endless distractor needle lines whose keys and values avoid the real needles'."""
    taken = {text.split(" for ", 1)[1].split(" is: ", 1)[0] for text, _ in needles}
    banned_values = set(answers)
    while True:
        if spec.key_type == "words":
            pool = [k for k in WORD_KEYS if k not in taken]
            rng.shuffle(pool)
            keys = iter(pool)
        else:
            keys = iter(lambda: _random_value("uuids", rng), None)
        for key in keys:
            if key in taken:
                continue
            value = _random_value(spec.value_type, rng)
            while value in banned_values:
                value = _random_value(spec.value_type, rng)
            yield NEEDLE.format(type_v=spec.value_type, key=key, value=value)
