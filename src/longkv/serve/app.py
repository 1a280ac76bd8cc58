"""The HTTP side of `longkv serve`: OpenAI's endpoints over a `Worker` (Starlette).

`POST /v1/chat/completions` and `POST /v1/completions` (streamed as server-sent events or not,
with usage; `usage.prompt_tokens_details.cached_tokens`: the prompt's tokens a kept read had
read), `GET /v1/models`, `GET /health`, and at `/` a page to paste a document and ask it
questions (`page.html`: plain HTML and JavaScript, the answer streamed). Errors come in OpenAI's
shape (`api.ApiError`): a body that is not JSON or not a valid request 400, a model other than
the served one 404, a prompt the method cannot read 400 naming the limit, a body over the limit
413, a missing or wrong key 401 (with an API key set), a full queue 503 with Retry-After. A
client that leaves stops its answer (or drops it from the queue)."""

from __future__ import annotations

import asyncio
import html
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from longkv.checks import SettingError
from longkv.decoding import Pick, Sampler, greedy
from longkv.serve.api import ApiError, ChatRequest, CompletionRequest, Sampling, parse
from longkv.serve.prompt import chat_parts, text_parts
from longkv.serve.worker import Job, Outcome, Reader, Worker


@dataclass(frozen=True)
class Limits:
    """What a server allows: the model's name in requests, answer tokens at most (a request
    asking more gets this many), the body's bytes, the API key (None: none asked), the seconds
    a client told the queue is full waits before trying again."""

    model: str
    max_tokens: int = 1024
    body_bytes: int = 64 << 20
    api_key: str | None = None
    retry_after: int = 5


def make_app(reader: Reader, worker: Worker, limits: Limits) -> Starlette:
    """The server's app: its routes over the worker; reader refuses what it cannot read."""

    page = (
        resources.files("longkv.serve").joinpath("page.html").read_text(encoding="utf-8")
        .replace("__MODEL__", html.escape(limits.model, quote=True))
        .replace("__KEY__", "required" if limits.api_key else "")
    )  # fmt: skip

    async def home(request: Request) -> Response:
        return HTMLResponse(page)

    async def health(request: Request) -> Response:
        load = {"running": worker.running, "waiting": worker.jobs.qsize()}
        return JSONResponse({"status": "ok", "kept_reads": len(reader.kept), **load})

    async def models(request: Request) -> Response:
        check_key(request, limits)
        card = {"id": limits.model, "object": "model", "created": 0, "owned_by": "longkv"}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat(request: Request) -> Response:
        req: ChatRequest = await body_of(request, ChatRequest, limits)
        parts = await run_in_threadpool(refused, chat_parts, reader.tokenizer, req.turns())
        return await respond(request, req, parts, "chat.completion", reader, worker, limits)

    async def completions(request: Request) -> Response:
        req: CompletionRequest = await body_of(request, CompletionRequest, limits)
        parts = await run_in_threadpool(refused, text_parts, reader.tokenizer, req.text())
        return await respond(request, req, parts, "text_completion", reader, worker, limits)

    def guarded(endpoint: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            try:
                return await endpoint(request)
            except ApiError as err:
                return err.response()

        return run

    routes = [
        Route("/", home),
        Route("/health", guarded(health)),
        Route("/v1/models", guarded(models)),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
    ]
    return Starlette(routes=routes)


def check_key(request: Request, limits: Limits) -> None:
    """Refuse (401) a request without the server's API key, where it has one."""
    if limits.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {limits.api_key}".encode()):
        raise ApiError(401, "the API key is missing or wrong: send Authorization: Bearer KEY")


async def body_of(request: Request, model: type[Sampling], limits: Limits) -> Any:
    """The request's body as `model`, its key and size checked first, and its model name."""
    check_key(request, limits)
    too_big = ApiError(413, f"the body passes the server's limit of {limits.body_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.body_bytes:
        raise too_big
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limits.body_bytes:
            raise too_big
    req = parse(bytes(body), model)
    if req.model != limits.model:
        raise ApiError(404, f"model {req.model!r} is not served here; it serves {limits.model!r}",
                       "model", "model_not_found")  # fmt: skip
    return req


def refused(split: Callable[..., tuple[list[int], list[int]]], *args: Any) -> Any:
    """The prompt's parts, a refusal of it as a 400."""
    try:
        return split(*args)
    except ValueError as err:  # a SettingError among them
        raise ApiError(400, str(err)) from None


def pick_of(req: Sampling) -> Pick:
    """Greedy unless the request asks a temperature above 0: then a `Sampler` seeded by it."""
    if not req.temperature:
        return greedy
    generator = torch.Generator().manual_seed(req.seed)
    return Sampler(req.temperature, None, req.top_p, generator)


@dataclass
class Reply:
    """The objects OpenAI answers a request with: whole, or in chunks as the text comes."""

    kind: str  # "chat.completion" or "text_completion"
    model: str
    id: str
    created: int

    @classmethod
    def to(cls, kind: str, model: str) -> Reply:
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return cls(kind, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def head(self, streamed: bool) -> dict[str, Any]:
        suffix = ".chunk" if streamed and self.kind == "chat.completion" else ""
        return {"id": self.id, "object": self.kind + suffix, "created": self.created,
                "model": self.model}  # fmt: skip

    def piece(self, text: str | None, finish: str | None = None) -> dict[str, Any]:
        """A streamed chunk: text (None: none, as the last chunk) and its finish reason."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.kind == "chat.completion":
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        return {**self.head(True), "choices": [choice]}

    def opening(self) -> dict[str, Any]:
        """A chat stream's first chunk: the assistant's role."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                  "logprobs": None}  # fmt: skip
        return {**self.head(True), "choices": [choice]}

    def usage(self, out: Outcome) -> dict[str, Any]:
        done = len(out.answer.tokens)
        return {
            "prompt_tokens": out.prompt_tokens, "completion_tokens": done,
            "total_tokens": out.prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        }  # fmt: skip

    def whole(self, out: Outcome, max_tokens: int) -> dict[str, Any]:
        finish = out.finish_reason(max_tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": out.answer.text}
        else:
            choice["text"] = out.answer.text
        return {**self.head(False), "choices": [choice], "usage": self.usage(out)}


async def respond(
    request: Request, req: Sampling, parts: tuple[list[int], list[int]], kind: str,
    reader: Reader, worker: Worker, limits: Limits,
) -> Response:  # fmt: skip
    """Queue the request's job and answer it, streamed or whole."""
    context, rest = parts
    max_tokens = min(req.asked_tokens() or limits.max_tokens, limits.max_tokens)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def put(kind: str) -> Callable[[Any], object]:
        return lambda item: loop.call_soon_threadsafe(events.put_nowait, (kind, item))

    positions = len(context) + len(rest) + max_tokens - 1  # the last answer token is not read
    try:  # before the queue: a prompt the method cannot read
        settings = reader.settings_for(positions)
    except SettingError as err:
        raise ApiError(400, str(err), None, "context_length_exceeded") from None
    chat = kind == "chat.completion"  # a chat answer stops where it repeats; a completion runs on
    job = Job(settings, context, rest, max_tokens, pick_of(req), chat, put("text"), put("done"))
    if not worker.submit(job):
        raise ApiError(503, "the server's queue is full; try again later", None, None,
                       {"Retry-After": str(limits.retry_after)})  # fmt: skip
    reply = Reply.to(kind, limits.model)
    if req.stream:
        sse = streamed(events, job, reply, req.include_usage())
        return StreamingResponse(sse, media_type="text/event-stream")
    while True:
        try:
            event, item = await asyncio.wait_for(events.get(), 0.5)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel.set()
                return Response(status_code=499)
            continue
        if event == "done":
            break
    return JSONResponse(reply.whole(outcome(item), max_tokens))


def outcome(item: Outcome | BaseException) -> Outcome:
    """A job's outcome, or its failure as an ApiError (a refusal 400, anything else 500)."""
    if isinstance(item, SettingError):
        raise ApiError(400, str(item))
    if isinstance(item, BaseException):
        raise ApiError(500, f"the answer failed: {type(item).__name__}: {item}")
    return item


def event(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def streamed(
    events: asyncio.Queue[tuple[str, Any]], job: Job, reply: Reply, usage: bool
) -> AsyncIterator[str]:
    """The answer as server-sent events, as OpenAI streams one; a client that leaves (the
    generator closed) cancels the job."""
    try:
        if reply.kind == "chat.completion":
            yield event(reply.opening())
        while True:
            kind, item = await events.get()
            if kind == "text":
                yield event(reply.piece(item))
                continue
            try:
                out = outcome(item)
            except ApiError as err:
                yield event({"error": {"message": err.message, "code": err.code}})
                break
            yield event(reply.piece(None, out.finish_reason(job.max_tokens)))
            if usage:
                yield event({**reply.head(True), "choices": [], "usage": reply.usage(out)})
            break
        yield event("[DONE]")
    finally:
        job.cancel.set()
