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
prose from the corpus (`ESSAY_FILES`: Austen's six novels in publication order, then
Moby-Dick from chapter 1), paragraphs of fewer than five words or without a lowercase letter
(titles, chapter headings) dropped, `_italic_` marks removed, whitespace collapsed, split into
sentences by a regular expression (common abbreviations kept whole) and sentences of more than
`MAX_UNIT_WORDS` words split further at `;`/`:`/dash and then comma boundaries, so a unit is
at most ~120 GPT-2 tokens (119 here). Sentences are joined by single spaces, starting at a seeded
random sentence and wrapping around the corpus if needed. `passkey`: the noise line repeated,
joined by spaces, with the needle `The pass key is {v}. Remember it. {v} is the pass key.` (a
random 5-digit key), under the Landmark header and the question `What is the pass key?` with
the answer prefix ` The pass key is`. Only the essay tasks read the corpus.

Depth. The haystack is a list of units (lines or sentences). The needle that carries
`answers[0]` goes to the unit boundary whose token offset (sum of the units' token counts) is
nearest to `depth` times the haystack's token count: 0 is before the first unit, 1 after the
last whole unit. The other needles of multikey_1, multivalue and multiquery go to boundaries at
seeded uniform random fractions (RULER places all of them at random depths). `needle_positions`
is parallel to `answers`: entry i is the token index in `input_ids` where the needle carrying
`answers[i]` starts (the first token holding the needle's first character; with the essay's
space joiner that token also holds the space, e.g. GPT-2's " One"). Distractor needles
(multikey_1's three other keys, every line of the needle haystack) are not listed.

Exact length. With `target = context_len - answer_budget`: (1) count each unit's tokens (the unit
with its joiner in front) and take as many whole units as fit beside the header, question and
needles; (2) tokenize the whole prompt and move to the largest number of whole units whose
prompt fits (a bracketing search guided by the unit counts); (3) fill the remaining gap, under
about one unit, with a fragment at the end of the haystack: joiner + a character prefix of the
next unit (word ends preferred), picked by the prefixes' own token counts and corrected by
re-tokenizing the whole prompt until `len(input_ids) == target`. When no prefix of the next few
units gives the exact count (with GPT-2: a one-token gap in the noise and needle haystacks,
whose lines each start with a newline token; about 1 length in 20), one or two extra joiners
are used instead: a blank line (or a space) before the question. In all these cases
`input_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]` (no BOS). Last resort,
for tokenizers whose merges leave the count unreachable that way: the ids are spliced (the ids
of header + whole units, the first k ids of the following units, the question's ids), exact by
construction, and `prompt = tokenizer.decode(input_ids)`; re-tokenizing that prompt may merge
differently at the two seams. So the haystack usually ends with a partial sentence or line (for
the needle haystack a truncated distractor line, never one with an asked key).

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

import functools
import itertools
import os
import random
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longkv.data.corpus import corpus_dir as corpus_dir_of
from longkv.data.corpus import read_text

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
ESSAY_FILES: tuple[str, ...] = (
    "austen/sensesensibility.txt.gz",
    "austen/prideprejudice.txt.gz",
    "austen/mansfieldpark.txt.gz",
    "austen/emma.txt.gz",
    "austen/northangerabbey.txt.gz",
    "austen/persuasion.txt.gz",
    "mobydick.txt.gz",
)
MAX_UNIT_WORDS = 60

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
    """One prompt: `prompt` is the full text the model continues; `input_ids` its tokens.

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
        sentences = _essay_sentences(corpus_dir_of(corpus_dir))
        start = rng.randrange(len(sentences))
        units = _Units(tokenizer, " ", itertools.cycle(sentences[start:] + sentences[:start]))
    elif spec.haystack == "needle":
        stream = random.Random(rng.getrandbits(64))
        units = _Units(tokenizer, "\n", _distractors(spec, stream, needles, answers))
    else:
        units = _Units(tokenizer, _JOINERS[spec.haystack], itertools.repeat(NOISE_LINE))
    builder = _Builder(tokenizer, header, footer, needles, [float(depth), *others], units)
    prompt, ids, starts = builder.fit(context_len - answer_budget, task, context_len, answer_budget)
    positions = [_token_start(tokenizer, prompt, ids, s, needles[i][0]) for i, s in starts]
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


# --- haystack units -------------------------------------------------------------------------


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


class _Units:
    """Lazily materialised haystack units with their token counts (joiner included)."""

    def __init__(self, tokenizer: Any, joiner: str, source: Iterator[str]) -> None:
        self.tokenizer = tokenizer
        self.joiner = joiner
        self.source = source
        self.texts: list[str] = []
        self.counts: list[int] = []
        self._cache: dict[str, int] = {}

    def ensure(self, n: int) -> None:
        """Materialise at least n units."""
        while len(self.texts) < n:
            batch = [next(self.source) for _ in range(max(64, n - len(self.texts)))]
            new = [t for t in dict.fromkeys(batch) if t not in self._cache]
            if new:
                encoded = _encode_many(self.tokenizer, [self.joiner + t for t in new])
                self._cache.update({t: len(ids) for t, ids in zip(new, encoded, strict=True)})
            self.texts.extend(batch)
            self.counts.extend(self._cache[t] for t in batch)

    def count(self, i: int) -> int:
        """Token count of unit i."""
        self.ensure(i + 1)
        return self.counts[i]


# --- essay corpus ---------------------------------------------------------------------------


_ABBREV = re.compile(
    r"(?:\b(?:Mr|Mrs|Ms|Dr|St|Messrs|Mme|Esq|Capt|Col|Gen|Lieut|Rev|Sr|Jr|No|vs|viz|etc|i\.e|e\.g)"
    r"|\b[A-Z])\.$"
)
_SENT_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s+[\"'“‘(\[]*[A-Z0-9])")
_CLAUSE_END = re.compile(r"[;:](?=\s)|—|--")


def _split_sentences(paragraph: str) -> list[str]:
    out: list[str] = []
    start = 0
    for m in _SENT_END.finditer(paragraph):
        piece = paragraph[start : m.end()].strip()
        if _ABBREV.search(piece):
            continue
        out.append(piece)
        start = m.end()
    rest = paragraph[start:].strip()
    if rest:
        out.append(rest)
    return [u for s in out for u in _split_long(s)]


def _split_long(sentence: str) -> list[str]:
    """Split a sentence over MAX_UNIT_WORDS words at clause, then comma, boundaries."""
    if len(sentence.split()) <= MAX_UNIT_WORDS:
        return [sentence]
    for pattern in (_CLAUSE_END, re.compile(r",(?=\s)")):
        cuts = [m.end() for m in pattern.finditer(sentence)]
        # greedy packing of clauses into units of at most MAX_UNIT_WORDS words
        pieces, begin, last = [], 0, 0
        for cut in [*cuts, len(sentence)]:
            if len(sentence[begin:cut].split()) > MAX_UNIT_WORDS and last > begin:
                pieces.append(sentence[begin:last].strip())
                begin = last
            last = cut
        pieces.append(sentence[begin:].strip())
        pieces = [p for p in pieces if p]
        if len(pieces) > 1:
            return [u for p in pieces for u in _split_long(p)]
    return [sentence]


@functools.lru_cache(maxsize=4)
def _essay_sentences(corpus_dir: Path) -> tuple[str, ...]:
    """The essay haystack's sentence units, from ESSAY_FILES in order."""
    sentences: list[str] = []
    for name in ESSAY_FILES:
        text = read_text(name, corpus_dir)
        if name.startswith("mobydick"):
            text = text[max(0, text.find("CHAPTER 1.")) :]
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.replace("_", "").split())
            if len(para.split()) < 5 or not re.search(r"[a-z]", para):
                continue
            sentences.extend(_split_sentences(para))
    return tuple(sentences)


# --- prompt assembly and exact length -------------------------------------------------------


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_many(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


class _Builder:
    """Assembles header + haystack with needles + footer and sizes it to a token target."""

    def __init__(
        self,
        tokenizer: Any,
        header: str,
        footer: str,
        needles: list[tuple[str, bool]],
        fractions: list[float],
        units: _Units,
    ) -> None:
        self.tok = tokenizer
        self.header, self.footer = header, footer
        self.needles, self.fractions, self.units = needles, fractions, units
        self.joiner = units.joiner

    def build(self, n: int, fragment: str = "") -> tuple[str, list[int], list[tuple[int, int]]]:
        """Prompt with n whole units (+ fragment): text, ids, and (needle, char start) pairs."""
        self.units.ensure(n)
        bounds = [0]
        for c in self.units.counts[:n]:
            bounds.append(bounds[-1] + c)
        total = bounds[-1]
        slots = []
        for i, f in enumerate(self.fractions):
            j = min(range(n + 1), key=lambda b, f=f: (abs(bounds[b] - f * total), b))
            slots.append((j, i))
        slots.sort()
        pieces: list[tuple[str, int]] = []  # (text, needle index or -1)
        k = 0
        for j in range(n + 1):
            while k < len(slots) and slots[k][0] == j:
                pieces.append((self.needles[slots[k][1]][0], slots[k][1]))
                k += 1
            if j < n:
                pieces.append((self.units.texts[j], -1))
        parts = [self.header]
        pos = len(self.header)
        starts: list[tuple[int, int]] = []
        for idx, (text, needle) in enumerate(pieces):
            if idx:
                parts.append(self.joiner)
                pos += len(self.joiner)
            if needle >= 0 and self.needles[needle][1]:
                starts.append((needle, pos))
            parts.append(text)
            pos += len(text)
        parts += [fragment, self.footer]
        prompt = "".join(parts)
        return prompt, _encode(self.tok, prompt), sorted(starts)

    def fit(
        self, target: int, task: str, context_len: int, budget: int
    ) -> tuple[str, list[int], list[tuple[int, int]]]:
        """The longest whole-unit prompt within target tokens, then a fragment to hit it."""
        fixed = len(_encode(self.tok, self.header + self.footer)) + sum(
            len(_encode(self.tok, self.joiner + t)) for t, _ in self.needles
        )
        n, used = 0, fixed
        while used + self.units.count(n) <= target:
            used += self.units.count(n)
            n += 1
        # Largest n whose prompt fits: guesses from the unit counts, kept inside the bracket
        # (lo fits, hi does not), bisecting if the guesses are slow to close it.
        lo: tuple[int, tuple[str, list[int], list[tuple[int, int]]]] | None = None
        hi: int | None = None
        for step in range(64):
            out = self.build(n)
            size = len(out[1])
            if size <= target:
                lo = (n, out)
                m = n
                gap = target - size
                while self.units.count(m) <= gap:
                    gap -= self.units.count(m)
                    m += 1
                m = max(m, n + 1)
            else:
                if n == 0:
                    raise ValueError(
                        f"context_len={context_len} is too small for {task}: the prompt template"
                        f" and needle(s) alone take {size} tokens; with answer_budget={budget}"
                        f" that needs context_len >= {size + budget}"
                    )
                hi = n
                m, excess = n, size - target
                while m > 0 and excess > 0:
                    m -= 1
                    excess -= self.units.count(m)
                m = min(m, n - 1)
            if lo is not None and hi is not None:
                if hi == lo[0] + 1:
                    break
                m = (lo[0] + hi) // 2 if step >= 8 else min(max(m, lo[0] + 1), hi - 1)
            n = m
        if lo is None or hi is None or hi != lo[0] + 1:
            raise RuntimeError(f"could not size the {task} haystack to {target} tokens")
        n, best = lo
        if len(best[1]) == target:
            return best
        budget = [16]  # whole-prompt tokenizations the fragment search may spend
        for source in range(n, n + 4):
            self.units.ensure(source + 1)
            found = self._fragment(n, self.units.texts[source], target, len(best[1]), budget)
            if found is not None:
                return found
        for repeats in range(1, 3):  # blank line(s) or spaces before the question
            out = self.build(n, self.joiner * repeats)
            if len(out[1]) == target:
                return out
        return self._splice(n, target)

    def _fragment(
        self, n: int, unit: str, target: int, base: int, budget: list[int]
    ) -> tuple[str, list[int], list[tuple[int, int]]] | None:
        """Append joiner + a prefix of `unit`, its length re-tuned until the prompt is exact.

        Each prefix's token count is estimated on its own (`joiner + prefix`); the first try
        measures the offset between that estimate and the real growth of the whole prompt,
        later tries only take prefixes whose corrected estimate is exact. Cuts after whole
        words are preferred, then the longest cut.
        """
        cuts = [c for c in range(1, len(unit) + 1) if unit[:c].strip()]
        if not cuts:
            return None
        texts = [self.joiner + unit[:c] for c in cuts]
        local = [len(ids) for ids in _encode_many(self.tok, texts)]
        tried: set[int] = set()
        want = target - base  # wanted local count: the prompt must grow by target - base
        while budget[0] > 0:
            options = [i for i in range(len(cuts)) if i not in tried]
            if tried:
                options = [i for i in options if local[i] == want]
            if not options:
                return None
            i = min(options, key=lambda i: (abs(local[i] - want), not _word_end(unit, cuts[i]), -i))
            tried.add(i)
            budget[0] -= 1
            out = self.build(n, texts[i])
            if len(out[1]) == target:
                return out
            want = target - len(out[1]) + local[i]  # the growth was len - base, not local[i]
        return None

    def _splice(self, n: int, target: int) -> tuple[str, list[int], list[tuple[int, int]]]:
        """Last resort: ids of header + n units, the next units' first ids, the footer's ids.

        The result is exact by construction; the prompt is `decode(input_ids)`, and
        re-tokenizing it may merge tokens differently where the three parts meet.
        """
        footer_ids = _encode(self.tok, self.footer)
        for m in range(n, -1, -1):
            prompt, _, starts = self.build(m)
            body_ids = _encode(self.tok, prompt[: len(prompt) - len(self.footer)])
            k = target - len(body_ids) - len(footer_ids)
            if k < 0:
                continue
            stream: list[int] = []
            j = m
            while len(stream) < k:
                self.units.ensure(j + 1)
                stream += _encode(self.tok, self.joiner + self.units.texts[j])
                j += 1
            ids = body_ids + stream[:k] + footer_ids
            text = self.tok.decode(ids)
            found = [(i, text.find(self.needles[i][0])) for i, _ in starts]
            if all(c >= 0 for _, c in found):
                return text, ids, found
        raise RuntimeError(f"could not make a prompt of exactly {target} tokens")


def _word_end(text: str, cut: int) -> bool:
    return cut == len(text) or text[cut].isspace()


def _token_start(tokenizer: Any, prompt: str, ids: list[int], char: int, needle: str) -> int:
    """Index of the token holding the needle's first character (prompt[char:] starts it)."""
    guess = len(_encode(tokenizer, prompt[:char]))
    span = len(_encode(tokenizer, needle)) + 4
    hits = [
        p
        for p in range(max(0, guess - 4), min(len(ids), guess + 5))
        if tokenizer.decode(ids[p : p + span]).lstrip().startswith(needle)
    ]
    if not hits:
        raise RuntimeError(f"needle {needle!r} not found near token {guess}")
    return max(hits)
