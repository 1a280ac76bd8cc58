"""OpenAI's request bodies as pydantic models, and errors in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error answered as OpenAI answers one: {"error": {message, type, param, code}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        """The error as the response OpenAI's clients read."""
        kind = {401: "authentication_error", 404: "not_found_error", 500: "server_error",
                503: "server_error"}  # fmt: skip
        error = {
            "message": self.message, "type": kind.get(self.status, "invalid_request_error"),
            "param": self.param, "code": self.code,
        }  # fmt: skip
        return JSONResponse({"error": error}, self.status, headers=self.headers)


class TextPart(BaseModel):
    """A part of a message's content; only text is read."""

    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat message: its role and its content (a text, or text parts)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        """The content as one text (its parts joined)."""
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class StreamOptions(BaseModel):
    """Whether a stream ends with a chunk of usage."""

    include_usage: bool = False


class Sampling(BaseModel):
    """What OpenAI's completion requests share: the model, how many tokens and how they are
    picked (greedy unless a temperature above 0 is given), streaming."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0
    n: int = Field(1, ge=1, le=1, description="one answer per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None

    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk of usage."""
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def turns(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def asked_tokens(self) -> int | None:
        """The answer tokens the request asks at most (None: not said)."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    def text(self) -> str:
        """The one prompt of the request."""
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, "prompt: send one prompt per request", "prompt")
        return self.prompt[0]

    def asked_tokens(self) -> int | None:
        """The answer tokens the request asks at most."""
        return self.max_tokens


def parse(body: bytes, model: type[BaseModel]) -> Any:
    """The request body as `model`, or an ApiError naming what is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not JSON: {err}") from None
    try:
        parsed = model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}", where) from None
    if getattr(parsed, "stop", None):
        raise ApiError(400, "stop: stop sequences are not supported; leave stop out", "stop")
    return parsed
