"""Where an answer starts to repeat itself, or a base model's answer line ends: decoding stops
there, and the text shown as the answer comes never includes what is cut.

A small model that has said what it knows often says it again ("I am not sure. I am not
sure. ..."), within a line or line by line, until the token limit. `AnswerWatch` watches the tokens
as they come (B = 1) and stops decoding at the first of:
- its last `NGRAM` tokens occur earlier in the answer: the answer ends where they start, or
  where the sentence they start in starts, if that sentence is not the one they repeat (so no
  half sentence is left: "...friend to Emma. She" cut at "She is a most excellent friend");
- a finished line repeats an earlier non-empty line: the answer ends before it;
- with `one_line` (a prompt without a chat template, "...\\nAnswer:", whose base model would go
  on to the next "Question:", or on with the story), the end of a sentence or line after some
  text: the answer is its first sentence ("Mr. Bingley." of 'Mr. Bingley. "I am not so sure of
  that," said Jane, ...').
What may still turn out to be cut is held back from `shown`: the sentence being written, but
for the answer's first (so an answer streams token by token until its first sentence ends, then
sentence by sentence), the longest run of last tokens that occurs earlier in the answer with the
word it starts in, and a line so far that an earlier line begins with. So a printer that shows
`text[:shown]` as it grows never shows what is cut, and at the end shows the rest of `text`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from longkv.document.prompt import uses_template

# an answer stops where its last NGRAM tokens occur earlier in it: a repeated clause of a
# sentence, not a repeated name or phrase of a few tokens
NGRAM = 8
# where a sentence ends: its mark, closing quotes or brackets, then white space; or a newline
SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+|\n")
# a word whose period ends no sentence ("Mr. Bingley"), besides an initial ("J. Smith")
ABBREVIATIONS = frozenset(
    {"Mr", "Mrs", "Ms", "Messrs", "Dr", "St", "Sr", "Jr", "Rev", "Col", "Capt", "Gen", "Lt",
     "Prof", "vs", "etc"}
)  # fmt: skip
WORD_BEFORE = re.compile(r"\w+$")
# how far back a mark's word is read: a longer word is no abbreviation nor initial either
WORD_SPAN = max(map(len, ABBREVIATIONS)) + 1


def sentence_ends(text: str, at: int) -> list[int]:
    """Where the sentences of text[:at] end (after the white space that follows each), an
    abbreviation's or initial's period left out."""
    ends = []
    for m in SENTENCE_END.finditer(text, 0, at):
        word = WORD_BEFORE.search(text, max(0, m.start() - WORD_SPAN), m.start())
        if text[m.start()] == "." and word:
            w = word.group()
            if w in ABBREVIATIONS or (len(w) == 1 and w.isupper()):
                continue
        ends.append(m.end())
    return ends


def sentence_start(text: str, at: int) -> int:
    """Where the sentence that position `at` of text is in starts (0: the text's start)."""
    ends = sentence_ends(text, at)
    return ends[-1] if ends else 0


class AnswerWatch:
    """An answer's tokens as they come (`__call__`: True to stop decoding; never with `stops`
    False), its `text` so far (`final`: the answer, cut before a repeat) and `shown`, how much of
    that text no repeat can take back."""

    def __init__(
        self, tokenizer: Any, one_line: bool = False, stops: bool = True, ngram: int = NGRAM
    ) -> None:  # fmt: skip
        self.tokenizer, self.one_line, self.stops, self.ngram = tokenizer, one_line, stops, ngram
        self.tokens: list[int] = []
        self.text = ""
        self.shown = 0
        self.stopped = False

    @classmethod
    def of_prompt(cls, tokenizer: Any, chat: bool, stops: bool = True) -> AnswerWatch:
        """The watch of an answer to a prompt built with or without the chat template
        (`prompt.uses_template`): one line where there is none."""
        return cls(tokenizer, one_line=not uses_template(tokenizer, chat), stops=stops)

    def decode(self, tokens: list[int]) -> str:
        """The text of the answer's first tokens, without the white space it starts with (a
        base model's " Mr. Weston." after "Answer:")."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True).lstrip()

    def echo(self) -> tuple[int, int]:
        """(k, j): the longest run of last tokens, k of them (up to ngram), that occurs earlier
        in the answer, at token j (its first place; (0, 0) if none)."""
        t, n = self.tokens, len(self.tokens)
        for k in range(min(self.ngram, n - 1), 0, -1):
            last = t[n - k :]
            j = next((j for j in range(n - k) if t[j : j + k] == last), None)
            if j is not None:
                return k, j
        return 0, 0

    def start_of(self, text: str, k: int, j: int) -> int:
        """Where in text the last k tokens' repeat of tokens j.. starts, moved back over the
        characters before it that also stand before its earlier place (" I am ..." repeating
        "I am ...": the repeat starts at "I", though the token " I" is not the token "I") but
        never into a word (", and most just" repeating after "excellent": "jus" is not cut from
        its "t"), and back to the start of its sentence where that sentence starts after the
        earlier place."""
        at = len(self.decode(self.tokens[: len(self.tokens) - k]))
        earlier = len(self.decode(self.tokens[:j]))
        while earlier > 0 and at > earlier and text[at - 1] == text[earlier - 1]:
            at, earlier = at - 1, earlier - 1
        while 0 < at < len(text) and text[at - 1].isalnum() and text[at].isalnum():
            at += 1  # to the end of the word it fell in
        begun = sentence_start(text, at)
        return begun if begun > earlier else at

    def __call__(self, ids: torch.Tensor) -> bool:
        self.tokens.append(int(ids[0]))
        text = self.decode(self.tokens)
        safe = len(text)
        if self.stops:
            k, j = self.echo()
            if k >= self.ngram:  # the answer ends where the repeated tokens start
                return self.stop(self.start_of(text, k, j), text)
            lines = text.split("\n")
            start = len(text) - len(lines[-1])  # where the line being written starts
            if self.one_line:  # its first sentence (or line) once it has ended
                ends = [e for e in sentence_ends(text, len(text)) if text[:e].strip()]
                if ends:
                    return self.stop(ends[0], text)
            if len(lines) > 1:
                finished = lines[-2].strip()
                if finished and finished in {line.strip() for line in lines[:-2]}:
                    return self.stop(start - len(lines[-2]) - 1, text)
            # a repeat may yet take the sentence being written back to its start, unless it is
            # the answer's first: no earlier sentence for it to repeat
            safe = sentence_start(text, len(text)) or len(text)
            if k:  # nor the run of last tokens said before, from the word it starts in
                safe = min(safe, text.rfind(" ", 0, self.start_of(text, k, j)) + 1)
            current = lines[-1].strip()
            if current and any(line.strip().startswith(current) for line in lines[:-1]):
                safe = min(safe, start)
        if text.endswith("\ufffd"):  # a character cut between tokens waits for the next
            safe = min(safe, len(text) - 1)
        self.text, self.shown = text, max(self.shown, len(text[:safe].rstrip()))
        return False

    def stop(self, cut: int, text: str) -> bool:
        """Stop decoding: the answer is the text before `cut`."""
        self.text, self.stopped = text[: max(cut, 0)].rstrip(), True
        return True

    def final(self) -> str:
        """The answer's text once decoding ended: cut where it stopped, else all of it."""
        return self.text if self.stopped else self.decode(self.tokens)

    def cut(self, tokens: list[int]) -> tuple[str, int]:
        """Watch `tokens` (decoded to their end without stopping) as decoding would have: the
        answer's text and the number of tokens decoding would have made."""
        for i, token in enumerate(tokens):
            if self(torch.tensor([token])):
                return self.text, i + 1
        return self.final(), len(tokens)
