"""A request's prompt in two parts: the context, read once and kept, and the rest, read for
each request on a fork of the kept read.

The split follows the prompt `longkv ask` builds (`document.prompt`): the last user message
"{document}\n\n{question}" splits at its last blank line, the document's side (with everything
the chat template puts before it) the context and the question's side (with the assistant's
turn opened) the rest; a last user message without a blank line leaves the context at its
start (the system message and the earlier turns). A text prompt (`/v1/completions`) splits at
its last blank line the same way. Each part is tokenized on its own, so the context's tokens
never depend on the question, and a chat request whose last message is "{document}\n\n{question}"
reads the same tokens as `longkv ask`. A prompt with no context to keep reads all but its last
token as the context.
"""

from __future__ import annotations

from typing import Any

from longkv.checks import require
from longkv.document.prompt import DOCUMENT_MARK, encode

SPLIT = "\n\n"  # where a message or a text prompt splits into context and rest


def chat_parts(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(context ids, rest ids) of chat messages ({"role", "content"} each) in the tokenizer's
    chat template, the assistant's turn opened."""
    require(
        bool(getattr(tokenizer, "chat_template", None)), None, "messages",
        "the model's tokenizer has no chat template; send a text prompt to /v1/completions",
    )  # fmt: skip
    require(bool(messages), None, "messages", "is empty; send at least one message")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    last = users[-1] if users else len(messages) - 1
    head, sep, tail = messages[last]["content"].rpartition(SPLIT)
    marked = {**messages[last], "content": f"{head}{DOCUMENT_MARK}{sep}{tail}"}
    turns = [*messages[:last], marked, *messages[last + 1 :]]
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    if DOCUMENT_MARK not in text:  # a template that rewrites the message: no split
        plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return at_last_token(encode(tokenizer, plain, False))
    before, after = text.split(DOCUMENT_MARK, 1)
    return both(encode(tokenizer, before, False), encode(tokenizer, after, False))


def text_parts(tokenizer: Any, prompt: str) -> tuple[list[int], list[int]]:
    """(context ids, rest ids) of a text prompt: the context with the tokens the tokenizer adds
    to a text (its BOS), as `longkv ask --no-chat` reads a document."""
    require(bool(prompt), None, "prompt", "is empty; send a prompt")
    head, sep, tail = prompt.rpartition(SPLIT)
    if not head:
        return at_last_token(encode(tokenizer, prompt, True))
    return both(encode(tokenizer, head, True), encode(tokenizer, sep + tail, False))


def both(context: list[int], rest: list[int]) -> tuple[list[int], list[int]]:
    """The two parts, each with a token: one that is empty takes the other's edge token."""
    if not context or not rest:
        return at_last_token(context + rest)
    return context, rest


def at_last_token(ids: list[int]) -> tuple[list[int], list[int]]:
    """All but the last token as the context, the last as the rest."""
    require(len(ids) >= 2, None, "prompt", f"has {len(ids)} token; send at least two")
    return ids[:-1], ids[-1:]
