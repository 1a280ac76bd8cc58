"""The prompt of a question about a document, in two parts: the document's (read once and kept)
and the question's (read for each question after it).

With a chat template (`chat` and the tokenizer has one), document and question are one user turn,
"{document}\n\n{question}", and the assistant's turn is opened: the document's part is the
template up to the end of the document, the question's part the rest. Without one: the document
as the tokenizer encodes a text, then "\n\nQuestion: {question}\nAnswer:". Each part is tokenized
on its own, so the document's tokens never depend on the question; a fresh read of
`prompt_ids` and a kept read continued by `question_ids` read the same tokens.

`first=True` also states the question before the document (the opening of the user turn, or of
the text, is "Question: {question}\n\n"), as long-context QA prompts do; such a document part
depends on its question, so no read of it can be kept for another.
"""

from __future__ import annotations

from typing import Any

# stand-ins for the document and the question, to find where a chat template puts them
DOCUMENT_MARK, QUESTION_MARK = "\x00longkv-document\x00", "\x00longkv-question\x00"


def uses_template(tokenizer: Any, chat: bool) -> bool:
    """Whether the prompt goes into the tokenizer's chat template."""
    return chat and bool(getattr(tokenizer, "chat_template", None))


def template_parts(tokenizer: Any) -> tuple[str, str]:
    """The chat template's text before the user's content and after it (the assistant's turn
    opened), for content "{document}\n\n{question}"."""
    turn = [{"role": "user", "content": f"{DOCUMENT_MARK}\n\n{QUESTION_MARK}"}]
    text = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    if DOCUMENT_MARK not in text or QUESTION_MARK not in text:
        raise ValueError(
            "tokenizer: its chat template does not put the user's message in the prompt as "
            "given; ask without the template (chat=False, --no-chat)"
        )
    return text[: text.index(DOCUMENT_MARK)], text[text.index(QUESTION_MARK) + len(QUESTION_MARK) :]


def encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    """Token ids of text; special: with the tokens the tokenizer adds to a text (its BOS)."""
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def document_ids(
    tokenizer: Any, document: str, chat: bool = True, question: str | None = None
) -> list[int]:
    """The document's part of the prompt; with `question`, stated before the document."""
    first = "" if question is None else f"Question: {question}\n\n"
    if uses_template(tokenizer, chat):
        return encode(tokenizer, template_parts(tokenizer)[0] + first + document, False)
    return encode(tokenizer, first + document, True)


def question_ids(tokenizer: Any, question: str, chat: bool = True) -> list[int]:
    """The question's part of the prompt, read after the document's."""
    if uses_template(tokenizer, chat):
        return encode(tokenizer, f"\n\n{question}" + template_parts(tokenizer)[1], False)
    return encode(tokenizer, f"\n\nQuestion: {question}\nAnswer:", False)


def prompt_ids(
    tokenizer: Any, document: str, question: str, chat: bool = True, first: bool = False
) -> list[int]:
    """The whole prompt's token ids: `document_ids` then `question_ids` (first: the question
    stated before the document too)."""
    before = question if first else None
    return document_ids(tokenizer, document, chat, before) + question_ids(tokenizer, question, chat)
