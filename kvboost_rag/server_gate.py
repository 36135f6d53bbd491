"""What stands in front of the HTTP server's routes (server.py): the API key, the bound on a request's body, the
bound on requests in flight, and the Prometheus metrics `GET /metrics` exposes.

`Gate`, one ASGI middleware, checks the key and the body's size, hands the routes that run the model their `Slot`,
and counts every request by route and status.
`ServerMetrics` keeps the metrics in a registry of the app's own (not prometheus_client's global one), so several
apps in one process never collide.

The API key: when one is set, every /v1/* route and /metrics need `Authorization: Bearer KEY`; it is compared
in constant time, and a missing or wrong key gets 401 (code "invalid_api_key"). /health stays open for probes
and load balancers. /metrics is protected too: traffic and store figures are the operator's, and a scraper
can send the key as a bearer token (Prometheus' `authorization` setting).

The body: one over `max_body_bytes` gets 413 (code "request_too_large") before it is read when its Content-Length
says so, else as soon as that many bytes have come; no route, parser or tokenizer sees it (issue 40).

The bound on requests in flight: a request to a route that runs the model (POST /v1/chat/completions,
/v1/completions, /v1/documents) takes a slot (`Slot.take`, called by the route once the request is checked, so that
a malformed one never holds one) and holds it until its response ends, streamed or not, or until its client goes
away. A request that finds `max_requests` slots held gets 429 at once (code "queue_full", a Retry-After header)
instead of waiting, unbounded, behind them.

A client's refusals come slower once it sends many: each 4xx but 429 takes a token from its address's bucket
(ERROR_BURST tokens, ERROR_RATE more a second), and one that finds it empty is answered ERROR_DELAY_S later. A client
sending malformed requests back to back keeps the event loop's thread busy refusing them, and with it the GIL that
the engine's thread needs between its kernels: 350 refusals a second made valid requests 2.3x slower on 2 cores
(docs/load_test.md). The wait is an asyncio sleep, which costs the server nothing, and a client that waits for each
answer is held to about ERROR_RATE refusals a second; valid requests, of any client, are never delayed.

The metrics (prefix kvboost_): requests_total{route, status}; requests_in_flight and max_requests (gauges);
requests_rejected_total (the 429s); ttft_seconds (a histogram of the engine's time to first token); prompt_tokens_total,
reused_tokens_total (the store's reuse ratio is reused over prompt) and completion_tokens_total, of the requests that
ran to their end; store_bytes (the KV held in the store's memory tier, read at each scrape); with online calibration
(shadow.py), shadow_* (the guard's predictions against what the checks found) and shadow_floor_*{floor} (each floor's
curve, at the judged tokens, against where the floor's token differed from full's).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import time
from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match

from . import fidelity
from .engine import Generation, KVBoost

# More than serving.WORKERS streams step at once; the rest of the bound waits for a worker.
DEFAULT_MAX_REQUESTS = 64
RETRY_AFTER_S = 1
# The routes that run the model, and so hold a slot while they do.
ENGINE_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/documents"})
# Seconds; from a tiny model's milliseconds to a long prompt's full prefill on a CPU.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A client's refusals: a burst at once, then this many a second, those beyond answered this much later (well within
# the 100 ms a refusal may take, issue 40). Addresses remembered at most: the least recent forgotten.
ERROR_BURST, ERROR_RATE, ERROR_DELAY_S, ERROR_CLIENTS = 20, 10.0, 0.05, 4096


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of their own."""

    def __init__(self, engine: KVBoost, max_requests: int):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("kvboost_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=registry)
        self.rejected = Counter("kvboost_requests_rejected",
                                "Requests refused with 429 because max_requests were in flight", registry=registry)
        self.in_flight = Gauge("kvboost_requests_in_flight", "Requests to the model's routes being served now",
                               registry=registry)
        Gauge("kvboost_max_requests", "The bound on requests in flight", registry=registry).set(max_requests)
        self.ttft = Histogram("kvboost_ttft_seconds", "The engine's time to first token, of finished requests",
                              buckets=TTFT_BUCKETS_S, registry=registry)
        self.prompt_tokens = Counter("kvboost_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.reused_tokens = Counter("kvboost_reused_tokens", "Prompt tokens whose KV came from the store, not "
                                     "recomputed (over kvboost_prompt_tokens_total: the reuse ratio)",
                                     registry=registry)
        self.completion_tokens = Counter("kvboost_completion_tokens", "Tokens generated by finished requests",
                                         registry=registry)
        self.document_tokens = Counter("kvboost_document_tokens", "Own tokens of the ingested documents found in "
                                       "finished requests' prompts", registry=registry)
        self.document_tokens_reused = Counter("kvboost_document_tokens_reused", "Of those, tokens served from the "
                                              "store (seam tokens fused with the text around a document, and "
                                              "evicted chunks, are computed)", registry=registry)
        shadow = getattr(engine, "shadow", None)
        if shadow is not None:  # online calibration (shadow.py): the guard's predictions against what checks found
            for key, what in (("checks", "served answers checked against a full prefill"),
                              ("predicted_flips", "flip chances the guard gave the checked served tokens, summed"),
                              ("observed_flips", "checked served tokens a full prefill chose otherwise"),
                              ("predicted_differ", "chances of a differing answer the guard gave the checked answers"),
                              ("observed_differ", "checked answers that differ from a full prefill's")):
                Gauge(f"kvboost_shadow_{key}", what, registry=registry).set_function(
                    lambda key=key: shadow.figures()[key])
            for key, what in (("tokens", "judged tokens the checks ran a floor's full prefill at"),
                              ("predicted_flips", "chances the floor's curve gave that its token differs from "
                                                  "full's there, summed"),
                              ("observed_flips", "of those tokens, where the floor's token differs from full's")):
                gauge = Gauge(f"kvboost_shadow_floor_{key}", f"{what}, by floor (order: the documents reversed; "
                              "dtype: bf16)", ["floor"], registry=registry)
                for floor in fidelity.FLOOR_NAMES:
                    gauge.labels(floor).set_function(
                        lambda key=key, floor=floor: shadow.figures()["floors"][floor][key])
        batcher = getattr(engine, "batcher", None)
        if batcher is not None:  # decode steps (batching.py) and the draft tokens they checked (lookahead.py)
            for key, what in (("batches", "decode forwards run, each for one or more streams"),
                              ("rows", "stream steps those forwards ran"),
                              ("drafted", "draft tokens copied from the prompt that lone streams' steps checked"),
                              ("drafts_used", "of those, tokens decoding chose: each a forward saved")):
                Gauge(f"kvboost_decode_{key}", what, registry=registry).set_function(
                    lambda key=key: batcher.counters[key])
        routes = getattr(engine, "routes", None)
        if routes is not None:  # the guard's ladder (repair/routes.py): steps measured not to pay, skipped or tried
            for key, what in (("skipped", "steps of the guard's ladder skipped: measured to cost more than they save"),
                              ("explored", "such steps tried anyway, now and then, to follow what is asked")):
                Gauge(f"kvboost_ladder_{key}", what, registry=registry).set_function(
                    lambda key=key: routes.counters[key])
            if shadow is not None:  # where the engine runs shadow checks, those trials are made off the request's path
                gauge = Gauge("kvboost_ladder_trials", "skipped steps' trials made after their request, by outcome "
                              "(held: the step's cache would have served the whole answer; dropped: the checks' queue "
                              "was full)", ["outcome"], registry=registry)
                for outcome in ("held", "refused", "dropped"):
                    gauge.labels(outcome).set_function(lambda outcome=outcome: shadow.figures()["trials"][outcome])
        accounts = getattr(engine, "accounts", None)
        if accounts:  # the levels held on average (fidelity.Account): floor risk lent from answer to answer
            for key, what in (("credit", "floor risk the level's answers left unspent, to lend now"),
                              ("loans", "tokens served from a reused cache on floor risk lent by earlier answers"),
                              ("borrowed", "the floor risk those loans took, summed")):
                gauge = Gauge(f"kvboost_floor_credit_{key}", f"{what}, by fidelity level", ["level"],
                              registry=registry)
                for level, account in accounts.items():
                    gauge.labels(level).set_function(lambda key=key, account=account: account.figures()[key])
        if hasattr(engine.store, "nbytes"):  # every store make_store builds; a custom KVStore may not say
            store = engine.store
            Gauge("kvboost_store_bytes", "Bytes of KV held in the engine store's memory tier",
                  registry=registry).set_function(lambda: store.nbytes)

    def observe(self, result: Generation) -> None:
        """A request that ran to its end."""
        self.ttft.observe(result.ttft_ms / 1e3)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.reused_tokens.inc(result.reused_tokens)
        self.completion_tokens.inc(result.generated_tokens)
        self.document_tokens.inc(result.document_tokens)
        self.document_tokens_reused.inc(result.document_tokens_reused)

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _refusal(status: int, message: str, type: str, code: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, None, code), status_code=status, headers=headers)


class QueueFull(Exception):
    """`max_requests` requests hold a slot: answered 429 with Retry-After (server.py's handler)."""

    retry_after_s = RETRY_AFTER_S


class Slot:
    """One request's claim on the bound of requests in flight: taken by its route once the request is checked,
    given back by the Gate when its response has ended (or its client has gone away)."""

    def __init__(self, gate: Gate):
        self.gate, self.held = gate, False

    def take(self) -> None:
        """Hold a slot, or raise QueueFull when every one is held."""
        gate = self.gate
        if self.held:
            return
        if gate.in_flight >= gate.max_requests:
            gate.metrics.rejected.inc()
            raise QueueFull(f"The server is busy: {gate.max_requests} requests are in flight, its bound "
                            f"(max_requests); retry in {RETRY_AFTER_S} s")
        gate.in_flight += 1
        gate.metrics.in_flight.inc()
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.gate.in_flight -= 1
            self.gate.metrics.in_flight.dec()


class Gate:
    """ASGI middleware: the API key, the bound on a request's body, the slots of the bound on requests in flight,
    and the request counter."""

    def __init__(self, app, *, routes: Sequence[BaseRoute], metrics: ServerMetrics, api_key: str | None,
                 max_requests: int, max_body_bytes: int):
        self.app, self.routes, self.metrics, self.max_requests = app, routes, metrics, max_requests
        self.max_body_bytes = max_body_bytes
        self.key = None if api_key is None else api_key.encode()
        self.in_flight = 0  # only the event loop's thread touches it
        self._refusals: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()  # (tokens, at)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route, status = self._route(scope), 500  # 500: what the error middleware answers to an app that raised

        async def counting_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if 400 <= status < 500 and status != 429 and self._over_refusals(scope):
                    await asyncio.sleep(ERROR_DELAY_S)
            await send(message)

        try:
            await self._serve(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()

    def _over_refusals(self, scope) -> bool:
        """Take a token from the bucket of the request's client address: whether it was empty."""
        host = (scope.get("client") or ("unknown",))[0]
        now = time.monotonic()
        tokens, at = self._refusals.pop(host, (ERROR_BURST, now))
        tokens = min(ERROR_BURST, tokens + (now - at) * ERROR_RATE)
        self._refusals[host] = (max(tokens - 1, 0.0), now)
        if len(self._refusals) > ERROR_CLIENTS:
            self._refusals.popitem(last=False)
        return tokens < 1

    async def _serve(self, scope, receive, send) -> None:
        unauthorized = self._check_key(scope)
        if unauthorized is not None:
            await _refusal(401, unauthorized, "invalid_request_error", "invalid_api_key")(scope, receive, send)
            return
        received = await self._bounded_body(scope, receive)
        if isinstance(received, str):
            await _refusal(413, received, "invalid_request_error", "request_too_large")(scope, receive, send)
            return
        replay = self._replaying(received, receive)
        if not (scope["method"] == "POST" and scope["path"] in ENGINE_ROUTES):
            await self.app(scope, replay, send)
            return
        slot = scope["kvboost.slot"] = Slot(self)
        try:
            # Returns when the response has ended, a stream included, or its client has gone away.
            await self.app(scope, replay, send)
        finally:
            slot.release()

    async def _bounded_body(self, scope, receive) -> list[dict] | str:
        """The request's body messages, read whole; or why it is refused, when it is over max_body_bytes (before
        a byte of it is read, when its Content-Length says so). A body is read here, not by the route, so that its
        bound holds whoever reads it, and a client sending one slowly holds no slot meanwhile."""
        limit = self.max_body_bytes
        hint = "send less text per request (the server's --max-body-bytes)"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return f"The request body holds {int(length)} bytes, more than this server takes ({limit}); {hint}"
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away: the route sees it as it would have
                return messages
            size += len(message.get("body", b""))
            if size > limit:
                return f"The request body holds more than {limit} bytes, more than this server takes; {hint}"
            if not message.get("more_body", False):
                return messages

    @staticmethod
    def _replaying(messages: list[dict], receive):
        """A receive that hands the app the body read already, then the client's own messages (a disconnect)."""
        pending = collections.deque(messages)

        async def replay():
            return pending.popleft() if pending else await receive()

        return replay

    def _check_key(self, scope) -> str | None:
        """Why the request may not pass without a key (a message), or None."""
        path = scope["path"]
        if self.key is None or not (path == "/v1" or path.startswith("/v1/") or path == "/metrics"):
            return None
        header = dict(scope["headers"]).get(b"authorization", b"")  # ASGI lowercases header names
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return "Missing API key: send it as the header 'Authorization: Bearer <key>'"
        if not hmac.compare_digest(token, self.key):
            return "Incorrect API key provided"
        return None

    def _route(self, scope) -> str:
        """The route's path template (bounded label values), or "unmatched"."""
        for route in self.routes:
            if route.matches(scope)[0] is not Match.NONE:
                return getattr(route, "path", "unmatched")
        return "unmatched"
