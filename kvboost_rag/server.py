"""An OpenAI-compatible HTTP server over one engine (`kvboost-rag serve`; FastAPI).

    app = create_app(KVBoost.from_pretrained())
    uvicorn.run(app, host="127.0.0.1", port=8000)

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[...],
                                   extra_body={"strategy": "cacheblend"})

Routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions` (both with `stream`, as
Server-Sent Events ending with `data: [DONE]`), `GET /health`, `GET /metrics` (Prometheus text), and one
extension, `POST /v1/documents` ({"documents": [str, ...], "pin": bool} -> their ids), to ingest documents
before the requests that quote them. A request may pick the reuse strategy with the extra field `strategy`
(the openai client's `extra_body`); every response carries, next to OpenAI's `usage`, a `kvboost` object with
the request's figures (ttft_ms, reused_tokens, exact_tokens, recomputed_tokens, strategy, total_ms, and the fidelity
guard's fidelity_estimate, recompute_budget, fell_back and exact_from); `fidelity` picks the guard's level per request.
`usage.prompt_tokens_details.cached_tokens` is OpenAI's name for the reused tokens.

`create_app(engine, api_key=...)` makes every /v1/* route and /metrics require `Authorization: Bearer KEY`
(/health stays open); `max_requests` bounds the requests running the model at once. Both, and the metrics,
are in server_gate.py.

Errors come in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for bad input
(what the engine refuses with a ValueError, or what this server does not support), 404 for another
model's name or an unknown route, 401 for a missing or wrong API key (code "invalid_api_key"), 429 when
`max_requests` requests are in flight already (code "queue_full", with a Retry-After header).

Every engine step (the prefill, then one decode step) runs on a worker thread of the engine's pool
(`serving.astream_pieces`), so the event loop stays free, and concurrent requests' decode steps run as one
batched forward (`batching.py`); a stream whose client goes away is closed after the step it is in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from .config import ConfigError
from .engine import Generation, KVBoost, StreamPiece
from .llm import request_figures
from .server_gate import DEFAULT_MAX_REQUESTS, Gate, ServerMetrics, error_body
from .serving import astream_pieces

# OpenAI's default is "up to the context window"; the engine reserves room for the answer before the
# prefill, so a bound is needed. A request over the window is refused saying so.
DEFAULT_MAX_TOKENS = 256
# OpenAI's default sampling (temperature 1); send temperature=0 for greedy answers.
DEFAULT_TEMPERATURE = 1.0

# The engine's names for the settings it refuses (ConfigError.field) -> the request's names.
_PARAM_NAMES = {"max_new_tokens": "max_tokens"}


# ---- requests --------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both completion routes take. Unknown fields are kept so that the ones that would change the
    answer, unsupported here, are refused by name instead of silently ignored (see _UNSUPPORTED)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's, but a common extension
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    strategy: str | None = None  # kvboost: how the prompt's KV is reused (kvboost_rag.repair.names())
    fidelity: str | float | None = None  # kvboost: RepairConfig.fidelity for this request ("fast", "strict", ...)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given


class CompletionRequest(_Sampling):
    prompt: str | list[str]


class DocumentsRequest(BaseModel):
    documents: list[str]
    pin: bool = False


# Request fields that would change the answer and that this server does not implement, with the value
# each may have anyway (their "off" value, as clients often send it explicitly).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
    "response_format": (None, {"type": "text"}),
}


class APIError(Exception):
    """A request refused with OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def _refuse_unsupported(request: _Sampling) -> None:
    if request.n not in (None, 1):
        raise APIError(400, f"n={request.n} is not supported: this server returns one choice per request; "
                            "send n=1 (or leave it out) and make several requests", param="n")
    for name, value in (request.model_extra or {}).items():
        allowed = _UNSUPPORTED.get(name)
        if allowed is not None and value not in allowed:
            raise APIError(400, f"{name}={value!r} is not supported by kvboost-rag's server; leave it out",
                           param=name)


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    """OpenAI takes one stop string or a list; the engine takes a list."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _chat_messages(messages: list[Message]) -> list[dict]:
    """The request's messages as the chat template takes them: text content only."""
    if not messages:
        raise APIError(400, "messages is empty: send at least one message", param="messages")
    chat = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise APIError(400, f"messages[{i}]: only text content parts are supported", param="messages")
            content = "".join(part.text for part in content)
        # Chat templates know "system"; OpenAI's newer "developer" role means the same.
        role = "system" if message.role == "developer" else message.role
        chat.append({"role": role, "content": content or ""})
    return chat


def _prompt_text(prompt: str | list[str]) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) != 1:
        raise APIError(400, f"prompt holds {len(prompt)} prompts: send one prompt per request", param="prompt")
    return prompt[0]


@dataclass(frozen=True)
class Call:
    """One request, checked: what to send `KVBoost.stream` and how to answer."""

    prompt: str | list[dict]
    options: dict  # KVBoost.stream keyword arguments
    stream: bool
    include_usage: bool


def _call(request: _Sampling, prompt: str | list[dict], max_tokens: int | None) -> Call:
    _refuse_unsupported(request)
    options = dict(max_new_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                   temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
                   top_p=1.0 if request.top_p is None else request.top_p, top_k=request.top_k or 0,
                   stop=_stop(request.stop), seed=request.seed)
    if request.strategy is not None:  # else the engine's default
        options["strategy"] = request.strategy
    if request.fidelity is not None:
        options["fidelity"] = request.fidelity
    include_usage = bool(request.stream and request.stream_options and request.stream_options.include_usage)
    return Call(prompt, options, bool(request.stream), include_usage)


# ---- responses -------------------------------------------------------------------------------------


def _usage(result: Generation) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.generated_tokens,
            "total_tokens": result.prompt_tokens + result.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": result.reused_tokens}}


def _sse(data: dict | str) -> str:
    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {body}\n\n"


class _Kind:
    """What differs between chat and text completions: object names and where a choice's text goes."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.id_prefix = "chatcmpl-" if chat else "cmpl-"

    def choice(self, text: str, finish_reason: str | None) -> dict:
        if self.chat:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, text: str | None, finish_reason: str | None = None, *, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


CHAT, TEXT = _Kind(chat=True), _Kind(chat=False)


# ---- stepping the engine ---------------------------------------------------------------------------


def _pieces(engine: KVBoost, call: Call) -> Iterator[StreamPiece]:
    # Called on an engine worker thread at the first step: the checks and the prefill never block the loop.
    options = dict(call.options)
    if "fidelity" in options:  # a ConfigError (400) names the field when the value is out of range
        options["repair"] = dataclasses.replace(engine.config.repair, fidelity=options.pop("fidelity"))
    yield from engine.stream(call.prompt, **options)


def _open(engine: KVBoost, call: Call) -> AsyncIterator[StreamPiece]:
    return astream_pieces(engine, _pieces(engine, call))


async def _prepend(first: StreamPiece, rest: AsyncIterator[StreamPiece]) -> AsyncIterator[StreamPiece]:
    yield first
    async for piece in rest:
        yield piece


class _ClosingStream(StreamingResponse):
    """A streaming response that closes its body and the engine stream under it when it ends for any
    reason. Starlette stops iterating a body whose client went away but leaves it open; closed here, the
    engine stream ends after the step in flight, not whenever the garbage collector finalizes it."""

    def __init__(self, events: AsyncIterator[str], pieces: AsyncIterator[StreamPiece]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.pieces = pieces

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.pieces.aclose()  # when the body never started, closing it closed nothing


class _Server:
    """The routes' work over one engine; create_app binds it to FastAPI."""

    def __init__(self, engine: KVBoost, model_name: str, metrics: ServerMetrics):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.created = int(time.time())
        self.fingerprint = f"kvboost-{engine.fingerprint[:16]}"

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model {name!r} does not exist: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvboost-rag"}

    def _head(self, object: str, request_id: str, created: int) -> dict:
        return {"id": request_id, "object": object, "created": created, "model": self.model_name,
                "system_fingerprint": self.fingerprint}

    async def complete(self, kind: _Kind, call: Call):
        """A whole response, or a stream of events when the request asks for one."""
        request_id, created = kind.id_prefix + uuid.uuid4().hex, int(time.time())
        pieces = _open(self.engine, call)
        try:
            # The first step is the prefill: a prompt the engine refuses gets a 400 before any event is sent.
            first = await anext(pieces)
        except BaseException:
            await pieces.aclose()
            raise
        if call.stream:
            return _ClosingStream(self._events(kind, call, _prepend(first, pieces), request_id, created), pieces)
        async with aclosing(pieces):
            result = first.result
            async for piece in pieces:
                result = piece.result or result
        self.metrics.observe(result)
        return {**self._head(kind.object, request_id, created),
                "choices": [kind.choice(result.text, result.finish_reason)], "usage": _usage(result),
                "kvboost": request_figures(result)}

    async def _events(self, kind: _Kind, call: Call, pieces: AsyncIterator[StreamPiece], request_id: str,
                      created: int) -> AsyncIterator[str]:
        head = self._head(kind.chunk_object, request_id, created)
        # With include_usage, OpenAI sends "usage": null on every chunk but the last, which holds it.
        usage = {"usage": None} if call.include_usage else {}
        result = None
        async with aclosing(pieces):
            if kind.chat:
                yield _sse({**head, "choices": [kind.delta("", first=True)], **usage})
            try:
                async for piece in pieces:
                    if piece.text:
                        yield _sse({**head, "choices": [kind.delta(piece.text)], **usage})
                    result = piece.result or result
            except ValueError as e:  # after the first event no status can be sent: the error is an event
                yield _sse(error_body(*_describe(e)[1:]))
                return
            self.metrics.observe(result)
            yield _sse({**head, "choices": [kind.delta(None, result.finish_reason)], **usage,
                        "kvboost": request_figures(result)})
            if call.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(result)})
            yield _sse("[DONE]")

    async def ingest(self, request: DocumentsRequest) -> dict:
        # Off the event loop: the engine takes its lock per document, between other requests' steps.
        ids = await asyncio.to_thread(self.engine.ingest, request.documents, pin=request.pin, progress=False)
        return {"object": "list", "data": [{"object": "document", "id": doc_id} for doc_id in ids],
                "ids": ids, "pinned": request.pin}


# ---- errors ----------------------------------------------------------------------------------------


def _describe(error: ValueError) -> tuple[int, str, str, str | None]:
    """(status, message, type, param) for a ValueError from the engine: bad input, named where known."""
    param = None
    message = str(error)
    if isinstance(error, ConfigError):
        param = _PARAM_NAMES.get(error.field, error.field)
        message = f"invalid {param}: {message}"
    return 400, message, "invalid_request_error", param


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """FastAPI's list of validation errors as one line, and the first field it names."""
    parts, param = [], None
    for item in error.errors():
        loc = [str(x) for x in item.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {item.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(ValueError)
    async def bad_input(_: Request, e: ValueError) -> JSONResponse:
        status, message, type, param = _describe(e)
        return JSONResponse(error_body(message, type, param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)


# ---- the app ---------------------------------------------------------------------------------------


def create_app(engine: KVBoost, *, model_name: str | None = None, api_key: str | None = None,
               max_requests: int = DEFAULT_MAX_REQUESTS) -> FastAPI:
    """An OpenAI-compatible app serving `engine` under `model_name` (default: the engine's model id).

    api_key: when given, the bearer token every /v1/* route and /metrics require (None: no key).
    max_requests: the requests running the model at once (prefill or decoding, streamed or not); one more gets 429.
    """
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: give a key, or None for no key")
    if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
        raise ValueError(f"max_requests must be a whole number >= 1, got {max_requests!r}")
    metrics = ServerMetrics(engine, max_requests)
    server = _Server(engine, model_name or engine.model_id, metrics)
    app = FastAPI(title="kvboost-rag", summary="OpenAI-compatible API over reused document KV caches")
    _install_error_handlers(app)
    app.add_middleware(Gate, routes=app.router.routes, metrics=metrics, api_key=api_key, max_requests=max_requests)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": server.model_name}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        server.check_model(model)
        return server.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        server.check_model(request.model)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        return await server.complete(CHAT, _call(request, _chat_messages(request.messages), max_tokens))

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        server.check_model(request.model)
        return await server.complete(TEXT, _call(request, _prompt_text(request.prompt), request.max_tokens))

    @app.post("/v1/documents")
    async def documents(request: DocumentsRequest) -> dict:
        return await server.ingest(request)

    return app
