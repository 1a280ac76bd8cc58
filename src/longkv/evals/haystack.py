"""The haystack text of the NIAH samples (`longkv.evals.niah`): the essay's sentence units,
haystack units with their token counts, and the builder that places the needles between units
and sizes the prompt to an exact number of tokens.

Essay. Prose from the corpus (`ESSAY_FILES`: Austen's six novels in publication order, then
Moby-Dick from chapter 1), paragraphs of fewer than five words or without a lowercase letter
(titles, chapter headings) dropped, `_italic_` marks removed, whitespace collapsed, split into
sentences by a regular expression (common abbreviations kept whole) and sentences of more than
`MAX_UNIT_WORDS` words split further at `;`/`:`/dash and then comma boundaries, so a unit is
at most ~120 GPT-2 tokens (119 here).

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
`input_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]` (the sample puts the
tokenizer's special prefix before them, `longkv.evals.niah`). Last resort,
for tokenizers whose merges leave the count unreachable that way: the ids are spliced (the ids
of header + whole units, the first k ids of the following units, the question's ids), exact by
construction, and `prompt = tokenizer.decode(input_ids)`; re-tokenizing that prompt may merge
differently at the two seams.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from longkv.data.corpus import read_text

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


class Units:
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
def essay_sentences(corpus_dir: Path) -> tuple[str, ...]:
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


class PromptBuilder:
    """Assembles header + haystack with needles + footer and sizes it to a token target."""

    def __init__(
        self,
        tokenizer: Any,
        header: str,
        footer: str,
        needles: list[tuple[str, bool]],
        fractions: list[float],
        units: Units,
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
        self, target: int, task: str, context_len: int
    ) -> tuple[str, list[int], list[tuple[int, int]]]:
        """The longest whole-unit prompt within target tokens, then a fragment to hit it (the
        rest of context_len is the answer budget and the tokenizer's special tokens)."""
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
                        f" and needle(s) alone take {size} tokens; with the answer budget and"
                        f" special tokens that needs context_len >= {size + context_len - target}"
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


def token_start(tokenizer: Any, prompt: str, ids: list[int], char: int, needle: str) -> int:
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
