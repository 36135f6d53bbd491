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
(/health stays open); `max_requests` bounds the requests running the model at once; `max_body_bytes` and
`max_prompt_bytes` bound a request's body and its text (defaults follow the model's context window). The key,
the body's bound, the slots and the metrics are in server_gate.py; what a request may hold, and every check made
of it before the engine sees it (its settings included: every RepairConfig field can be given per request), in
server_requests.py.

Errors come in OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for bad input (what the
engine's checks refuse, a message OpenAI would refuse, or what this server does not support; param names the
field, e.g. messages[0].role), 404 for another model's name or an unknown route, 401 for a missing or wrong API key
(code "invalid_api_key"), 413 for a body or a text over its bound (code "request_too_large"), 429 when
`max_requests` requests are in flight already (code "queue_full", with a Retry-After header). A request is
checked in full before it takes a slot: a malformed one never holds one.

Every engine step (the prefill, then one decode step) runs on a worker thread of the engine's pool
(`serving.astream_pieces`), so the event loop stays free, and concurrent requests' decode steps run as one
batched forward (`batching.py`); a stream whose client goes away is closed after the step it is in. A prompt is
rendered and tokenized on that thread outside the engine's lock, so that it never delays another request's
forward.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .config import ConfigError
from .engine import Generation, KVBoost, StreamPiece
from .llm import request_figures
from .server_gate import DEFAULT_MAX_REQUESTS, Gate, QueueFull, ServerMetrics, error_body
from .server_requests import (
    APIError,
    Call,
    ChatRequest,
    CompletionRequest,
    DocumentsRequest,
    chat_messages,
    check_documents,
    limits_for,
    make_call,
    prompt_text,
)
from .serving import astream_pieces

# The engine's names for the settings it refuses (ConfigError.field) -> the request's names.
_PARAM_NAMES = {"max_new_tokens": "max_tokens"}


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


def _open(engine: KVBoost, call: Call) -> AsyncIterator[StreamPiece]:
    # The stream's first step, on an engine worker thread, renders and tokenizes the prompt and prefills it: none of
    # it blocks the event loop (call.options were checked on it already, in make_call).
    return astream_pieces(engine, engine.stream(call.prompt, **call.options))


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
    """FastAPI's list of validation errors as one line, and the first field it names (OpenAI's way: messages[0])."""
    parts, param = [], None
    for item in error.errors():
        loc = [x for x in item.get("loc", ()) if x != "body"]
        path = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
        if param is None and loc:
            head = [str(loc[0])]  # the field, and the indices right after it (not pydantic's union branch names)
            for x in loc[1:]:
                if not isinstance(x, int):
                    break
                head.append(f"[{x}]")
            param = "".join(head)
        parts.append(f"{path or 'body'}: {item.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts), param


class _ErrorResponse(JSONResponse):
    """An error in OpenAI's shape, in ASCII JSON: a message that quotes the request (a model's name, a field's
    value) may hold a lone surrogate, which JSON escapes but UTF-8 cannot encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return _ErrorResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, e: QueueFull) -> JSONResponse:
        return _ErrorResponse(error_body(str(e), "rate_limit_error", None, "queue_full"), status_code=429,
                              headers={"Retry-After": str(e.retry_after_s)})

    @app.exception_handler(ValueError)
    async def bad_input(_: Request, e: ValueError) -> JSONResponse:
        status, message, type, param = _describe(e)
        return _ErrorResponse(error_body(message, type, param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)
        return _ErrorResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _ErrorResponse(error_body(str(e.detail), kind), status_code=e.status_code)


def _take_slot(http: Request) -> None:
    """Hold one of the server's max_requests slots from here to the response's end (server_gate.Slot), or 429."""
    slot = http.scope.get("kvboost.slot")
    if slot is not None:
        slot.take()


# ---- the app ---------------------------------------------------------------------------------------


def create_app(engine: KVBoost, *, model_name: str | None = None, api_key: str | None = None,
               max_requests: int = DEFAULT_MAX_REQUESTS, max_prompt_bytes: int | None = None,
               max_body_bytes: int | None = None) -> FastAPI:
    """An OpenAI-compatible app serving `engine` under `model_name` (default: the engine's model id).

    api_key: when given, the bearer token every /v1/* route and /metrics require (None: no key).
    max_requests: the requests running the model at once (prefill or decoding, streamed or not); one more gets 429.
    max_prompt_bytes, max_body_bytes: the most UTF-8 bytes of text a request (or one document) may hold, and the most
    bytes its body may; over either, 413. None: follow the model's context window (server_requests.limits_for).
    """
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: give a key, or None for no key")
    if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
        raise ValueError(f"max_requests must be a whole number >= 1, got {max_requests!r}")
    limits = limits_for(engine.adapter.max_context, max_prompt_bytes, max_body_bytes)
    metrics = ServerMetrics(engine, max_requests)
    server = _Server(engine, model_name or engine.model_id, metrics)
    app = FastAPI(title="kvboost-rag", summary="OpenAI-compatible API over reused document KV caches")
    _install_error_handlers(app)
    app.add_middleware(Gate, routes=app.router.routes, metrics=metrics, api_key=api_key, max_requests=max_requests,
                       max_body_bytes=limits.max_body_bytes)

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

    # Each route checks its request in full, on the event loop and before any tokenizing, then takes a slot.
    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest, http: Request):
        server.check_model(request.model)
        newer = request.max_completion_tokens is not None
        call = make_call(request, chat_messages(request.messages, limits), engine, limits,
                         max_tokens=request.max_completion_tokens if newer else request.max_tokens,
                         max_tokens_name="max_completion_tokens" if newer else "max_tokens")
        _take_slot(http)
        return await server.complete(CHAT, call)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request):
        server.check_model(request.model)
        call = make_call(request, prompt_text(request.prompt, limits), engine, limits, max_tokens=request.max_tokens)
        _take_slot(http)
        return await server.complete(TEXT, call)

    @app.post("/v1/documents")
    async def documents(request: DocumentsRequest, http: Request) -> dict:
        check_documents(request.documents, limits)
        _take_slot(http)
        return await server.ingest(request)

    return app
