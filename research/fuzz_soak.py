"""Fuzz and soak of `kvboost-rag serve` (issue 40): malformed requests drawn by hypothesis over the request schema,
sent beside valid traffic from --clients concurrent clients, on 127.0.0.1, for a bounded time.

Starts `kvboost-rag serve --documents CORPUS --api-key KEY --max-requests 4` (the bundled model unless --model) on a
free port, with the documents of the first two items of the tiny bench set (six, below the eight calibration waits
for, so that no calibration runs during the soak). Then:

  1. the check set (--check-prompts questions over those documents under a system message the traffic never uses,
     each with `full` and with `cacheblend` at fidelity "fast", greedy, write_back off) is answered once;
  2. --clients valid clients (the real openai client: chat completions, `cacheblend` at fidelity --valid-fidelity,
     greedy, half streamed) run for --warmup-s seconds, after which the server's resident memory is its start level.
     The fidelity is "fast" by default: on six documents the guard is uncalibrated and moves most answers to a full
     prefill after their second token (the ladder's escalation), which makes a request 4x slower and the phases'
     samples too small for their medians;
  3. --rounds rounds of two phases of --phase-s seconds each: "alone" (the valid clients) and "attacked" (the same
     clients, and one more, in a process of its own, sending malformed requests back to back on fresh connections);
  4. the valid clients stop, the check set is answered again, and the server's memory is read once more.

The malformed requests: --examples drawn by hypothesis before the run, each a valid chat, text-completion or
documents request with at least one defect of a kind drawn too: a field of the wrong JSON type, a value out of its
range (every RepairConfig field included), a message OpenAI refuses (role, content, parts, unknown or tool fields,
a lone surrogate), a typo of a field name, an unsupported field, text over --max-prompt-bytes, a body over
--max-body-bytes (sent with and without a Content-Length), JSON that is not an object or not JSON, an unknown
model, a missing or wrong API key; extra unknown fields and any Unicode around them. Three bodies of 20 MB and 30 MB
are always among them.

Checks (PASS or FAIL each; the exit code is 1 when one failed):
  - no 5xx, from any request, and no traceback in the server's log;
  - every malformed request answered 4xx in OpenAI's error shape ({"error": {message, type, param, code}}), none
    accepted, each within --malformed-ms (100 ms), whatever its size (client-side: from the first byte sent to the
    whole response);
  - the valid requests: no error, no 429, their median latency in the attacked phases within --ratio-target (1.10)
    of the alone phases' (same run), and none stalled: the slowest of the attacked phases within 1.5x of the slowest
    of the alone phases;
  - the check set's answers the same before and after;
  - the server's memory back to its start level: the end within --memory-slack (10%) of the start.

    .venv/bin/python research/fuzz_soak.py --json out/fuzz_soak.json          # ~5 min on 2 CPU cores

Needs the serve extra and the test extra (openai, hypothesis, psutil).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import math
import multiprocessing
import pickle
import random
import select
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from load_test import Server, percentile  # research/load_test.py: the server process, one percentile

from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.llm import REPAIR_FIELDS
from kvboost_rag.prompts import rag_messages
from kvboost_rag.server_requests import ROLES, limits_for

MODEL_NAME = "kvboost-fuzz"
KEY = "sk-fuzz-soak"
CHECK_SYSTEM = "Check: answer from the documents, in a few words."
ERROR_FIELDS = {"message", "type", "param", "code"}


# ---- the malformed requests, drawn by hypothesis ------------------------------------------------------------


@dataclass(frozen=True)
class Malformed:
    kind: str  # the defect
    route: str
    body: bytes | None  # None: a body of `size` bytes made by the attacker (too large to keep in the pool)
    size: int = 0
    chunked: bool = False  # sent without a Content-Length
    headers: tuple[tuple[str, str], ...] = ()  # beyond content-type; the API key unless the defect is about it


TEXT = st.text(max_size=40)  # any Unicode but lone surrogates (those are a defect of their own)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), TEXT)
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner,
                                                                                                 max_size=3),
                           max_leaves=6)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# What a field takes (a value failing the test is of the wrong type), and values out of its range.
TYPES = {
    "model": lambda v: isinstance(v, str), "max_tokens": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "temperature": _is_number, "top_p": _is_number, "top_k": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "seed": lambda v: isinstance(v, int) and not isinstance(v, bool), "n": lambda v: isinstance(v, int),
    "stream": lambda v: isinstance(v, bool), "strategy": lambda v: isinstance(v, str),
    "write_back": lambda v: isinstance(v, bool), "stop": lambda v: isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(s, str) for s in v)),
    "stream_options": lambda v: isinstance(v, dict) and all(k != "include_usage" or isinstance(x, bool)
                                                            for k, x in v.items()),
}


def _out_of_range(max_context: int) -> dict:
    big = st.integers(2**64, 2**70)
    return {
        "max_tokens": st.integers(-2**40, 0) | st.integers(max_context, 2**40),
        "temperature": st.floats(max_value=-1e-9) | st.sampled_from([math.nan, math.inf]),
        "top_p": st.floats(max_value=0) | st.floats(min_value=1.0001) | st.just(math.nan),
        "top_k": st.integers(max_value=-1), "seed": st.integers(max_value=-1) | big, "n": st.integers(2, 2**40),
        "stop": st.lists(TEXT.filter(bool), min_size=5, max_size=8) | st.just([""]),
        "strategy": TEXT.filter(lambda s: s not in ("full", "naive", "prefix", "selective", "cacheblend")),
        "boundary_tokens": st.integers(max_value=-1), "check_layer": st.integers(1000, 2**40) | st.integers(
            max_value=-1), "recompute_ratio": st.floats(max_value=-1e-9) | st.floats(min_value=1.0001),
        "taper": st.floats(max_value=0.999), "recency": st.floats(max_value=-1e-9),
        "size_multiple": st.integers(max_value=-2), "drift": JSON_VALUES.filter(lambda v: not isinstance(v, bool)),
        "fidelity": TEXT.filter(lambda s: s not in ("fast", "balanced", "strict")) | st.floats(max_value=0)
        | st.floats(min_value=1.0001),
    }


def _valid_chat(draw) -> dict:
    words = draw(st.lists(st.sampled_from(["tides", "harbour", "mayor", "bridge", "founded", "ale"]), min_size=1,
                          max_size=8))
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": " ".join(words) + "?"}], "max_tokens": 4,
            "temperature": 0}


@st.composite
def malformed(draw, max_context: int, max_prompt_bytes: int, max_body_bytes: int) -> Malformed:
    """One request with at least one defect, drawn from the kinds in the module's docstring."""
    body, route = _valid_chat(draw), "/v1/chat/completions"
    kind = draw(st.sampled_from(["wrong-type", "out-of-range", "bad-message", "typo", "unsupported", "long-text",
                                 "huge-body", "not-json", "unknown-model", "bad-key", "completion", "documents",
                                 "empty-messages", "lone-surrogate"]))
    headers: tuple = (("authorization", f"Bearer {KEY}"),)
    if kind == "wrong-type":
        name = draw(st.sampled_from([*TYPES, "messages", "max_completion_tokens"]))
        check = TYPES.get(name, (lambda v: isinstance(v, list)) if name == "messages" else TYPES["max_tokens"])
        body[name] = draw(JSON_VALUES.filter(lambda v: v is not None and not check(v)))
    elif kind == "out-of-range":
        ranges = _out_of_range(max_context)
        name = draw(st.sampled_from(sorted(ranges)))
        body[name] = draw(ranges[name])
    elif kind == "bad-message":
        message = draw(st.sampled_from([
            {"role": draw(TEXT.filter(lambda r: r not in ROLES)), "content": "hi"},
            {"content": "hi"}, {"role": "user", "content": None}, {"role": "user"},
            {"role": "user", "content": draw(JSON_VALUES.filter(lambda v: not isinstance(v, (str, list))))},
            {"role": "user", "content": []}, {"role": "assistant", "content": None},
            {"role": "user", "content": [{"type": draw(TEXT.filter(lambda t: t != "text")), "text": "x"}]},
            {"role": "user", "content": [{"type": "text", "text": draw(JSON_VALUES.filter(
                lambda v: not isinstance(v, str)))}]},
            {"role": "user", "content": "hi", draw(TEXT.filter(lambda k: k not in (
                "role", "content", "name", "refusal"))): 1},
            {"role": "tool", "content": "hi", "tool_call_id": "1"},
            {"role": "assistant", "content": "x", "tool_calls": [{"id": "1", "type": "function"}]},
            draw(JSON_VALUES.filter(lambda v: not isinstance(v, dict)))]))
        at = draw(st.integers(0, 2))
        body["messages"] = [{"role": "system", "content": "Be brief."}] * at + [message] + body["messages"]
    elif kind == "typo":
        name = draw(st.sampled_from([n for n in (*REPAIR_FIELDS, "temperature", "max_tokens", "strategy",
                                                 "write_back", "stream_options") if len(n) >= 6]))
        at = draw(st.integers(0, len(name) - 1))
        typo = name[:at] + draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_")) + name[at + 1:]
        if typo == name:
            typo = name + "s"
        body[typo] = draw(JSON_VALUES)
    elif kind == "unsupported":
        name, value = draw(st.sampled_from([("logprobs", True), ("top_logprobs", 3), ("tools", [{"type": "function"}]),
                                            ("presence_penalty", 0.5), ("logit_bias", {"1": 5}),
                                            ("response_format", {"type": "json_object"}), ("best_of", 2)]))
        body[name] = value
    elif kind == "long-text":
        unit = draw(st.text(min_size=1, max_size=16))
        repeat = max_prompt_bytes // len(unit.encode()) + 1 + draw(st.integers(0, 1000))
        body["messages"][0]["content"] = unit * repeat
    elif kind == "huge-body":
        size = draw(st.integers(max_body_bytes + 1, 30_000_000))
        return Malformed(kind, route, None, size, draw(st.booleans()), headers)
    elif kind == "not-json":
        raw = draw(st.one_of(st.binary(max_size=200), st.sampled_from([b"[" * 100_000, b'{"messages": [', b"null",
                                                                         b"[]", b'"hi"', b"42", b"{}"])))
        return Malformed(kind, route, raw, headers=headers)
    elif kind == "unknown-model":
        body["model"] = draw(TEXT.filter(lambda m: m != MODEL_NAME))
    elif kind == "bad-key":
        headers = draw(st.sampled_from([(), (("authorization", "Bearer sk-wrong"),), (("authorization", KEY),)]))
    elif kind == "completion":
        route = "/v1/completions"
        body = {"model": MODEL_NAME, "max_tokens": 4, "prompt": draw(st.one_of(
            JSON_VALUES.filter(lambda v: not isinstance(v, (str, list))), st.lists(TEXT, min_size=2, max_size=3),
            st.just("x" * (max_prompt_bytes + 1)), st.just(""), st.lists(st.integers(), min_size=1, max_size=3)))}
    elif kind == "documents":
        route = "/v1/documents"
        body = {"documents": draw(st.one_of(JSON_VALUES.filter(lambda v: not isinstance(v, list)),
                                            st.lists(JSON_VALUES.filter(lambda v: not isinstance(v, str)), min_size=1,
                                                     max_size=3),
                                            st.just(["y" * (max_prompt_bytes + 1)]), st.just([""]), st.just(["  "])))}
    elif kind == "empty-messages":
        body["messages"] = draw(st.sampled_from([[], None]))
        if body["messages"] is None:
            del body["messages"]
    elif kind == "lone-surrogate":
        body["messages"][0]["content"] += chr(draw(st.integers(0xD800, 0xDFFF)))
    # Unknown fields beside the defect, of any name and value (not one of ours: those are the typo kind).
    for name, value in draw(st.dictionaries(st.text(alphabet="xyz", min_size=12, max_size=14), JSON_VALUES,
                                            max_size=2)).items():
        body.setdefault(name, value)
    return Malformed(kind, route, json.dumps(body).encode("ascii"), headers=headers)  # escapes every non-ASCII


def draw_malformed(count: int, seed: int, limits) -> list[Malformed]:
    """`count` malformed requests from hypothesis (generation only: nothing to shrink here), and three large bodies
    always among them."""
    pool: list[Malformed] = []

    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate], derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(malformed(limits.max_context, limits.max_prompt_bytes, limits.max_body_bytes))
    def collect(example: Malformed) -> None:
        pool.append(example)

    collect()
    auth = (("authorization", f"Bearer {KEY}"),)
    pool += [Malformed("huge-body", "/v1/chat/completions", None, 20_000_000, False, auth),
             Malformed("huge-body", "/v1/chat/completions", None, 30_000_000, False, auth),
             Malformed("huge-body", "/v1/chat/completions", None, 30_000_000, True, auth)]
    random.Random(seed).shuffle(pool)
    return pool


# ---- the attacker, in a process of its own ------------------------------------------------------------------


def _huge_body(size: int) -> bytes:
    """A chat request of `size` bytes: one message of that much text (20 MB: the issue's)."""
    head, tail = b'{"model": "' + MODEL_NAME.encode() + b'", "messages": [{"role": "user", "content": "', b'"}]}'
    return head + b"word " * ((size - len(head) - len(tail)) // 5) + tail


def send_raw(base: str, route: str, headers: dict[str, str], body: bytes, chunked: bool) -> tuple[int, bytes]:
    """POST `body` over a socket of our own, reading while sending: the server's answer is timed when it arrives, not
    when the client would have finished sending 30 MB (an HTTP client reads only after that). (status, body)."""
    host, port = base.removeprefix("http://").split(":")
    head = [f"POST {route} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
            "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items())]
    pending = memoryview(("\r\n".join(head) + "\r\n\r\n").encode())
    pieces = iter(body[at:at + 65536] for at in range(0, len(body), 65536))
    received = b""
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.setblocking(False)
        while True:
            readable, writable, _ = select.select([sock], [sock] if pending is not None else [], [], 60)
            if readable:
                data = sock.recv(1 << 16)
                received += data
                if not data or _whole_response(received):
                    break
            elif writable:
                if not pending:
                    piece = next(pieces, None)
                    if piece is None:
                        pending = None if not chunked else memoryview(b"0\r\n\r\n")
                        chunked = False  # the last chunk is on its way
                        continue
                    pending = memoryview(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                try:
                    pending = pending[sock.send(pending):]
                except (BrokenPipeError, ConnectionResetError):  # the server answered and closed: read the answer
                    pending = None
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _whole_response(data: bytes) -> bool:
    head, found, body = data.partition(b"\r\n\r\n")
    if not found:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def attack(pool_path: str, base: str, duration_s: float, start: int, rate: float = 0.0) -> tuple[list[dict], float]:
    """Send the pool's requests from `start` on, one after another (at most `rate` a second; 0: back to back), each
    on a fresh connection, for `duration_s`: a record of each, and the CPU seconds this process spent sending them
    (the machine's CPU the attack takes from the server, beside what the server spends refusing them)."""
    cpu_start = time.process_time()
    pool: list[Malformed] = pickle.loads(Path(pool_path).read_bytes())
    made: dict[int, bytes] = {}
    records, i, stop = [], start, time.monotonic() + duration_s
    with httpx.Client(base_url=base, timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while time.monotonic() < stop:
            if rate and records:
                time.sleep(max(0.0, records[-1]["at"] + 1 / rate - time.monotonic()))
            example = pool[i % len(pool)]
            i += 1
            if example.body is None and example.size not in made:
                made[example.size] = _huge_body(example.size)
            body = example.body if example.body is not None else made[example.size]
            headers = {"content-type": "application/json", **dict(example.headers)}
            record = dict(kind=example.kind, route=example.route, size=len(body), chunked=example.chunked,
                          at=time.monotonic())
            started = time.perf_counter()
            try:
                if example.body is None:  # a body too large for an HTTP client to time its answer
                    status, answer = send_raw(base, example.route, headers, body, example.chunked)
                    record.update(status=status, shape=_error_shape(httpx.Response(status, content=answer)))
                else:
                    reply = client.post(example.route, content=body, headers=headers)
                    record.update(status=reply.status_code, shape=_error_shape(reply))
            except (httpx.HTTPError, OSError, ValueError, IndexError) as e:
                record.update(status=None, error=f"{type(e).__name__}: {e}")
            record["ms"] = (time.perf_counter() - started) * 1e3
            records.append(record)
    return records, time.process_time() - cpu_start


def _error_shape(reply: httpx.Response) -> bool:
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and set(error) == ERROR_FIELDS and isinstance(error["message"], str)


# ---- the valid traffic ----------------------------------------------------------------------------------------


@dataclass
class Valid:
    client: int
    phase: str
    stream: bool
    ms: float = math.nan
    status: int | None = 200
    error: str | None = None
    retried_429: int = 0


@dataclass
class Clock:
    """The phase the run is in; a request is counted in a phase only when it started and ended in it."""

    phase: str = "warmup"
    epoch: int = 0  # bumped at every change of phase

    def set(self, phase: str) -> None:
        self.phase, self.epoch = phase, self.epoch + 1


async def valid_client(index: int, client: openai.AsyncOpenAI, prompts: list[list[dict]], clock: Clock,
                       stop: asyncio.Event, records: list[Valid], max_tokens: int, fidelity: str) -> None:
    rng = random.Random(index)
    while not stop.is_set():
        messages, stream = rng.choice(prompts), rng.random() < 0.5
        phase, epoch = clock.phase, clock.epoch
        record = Valid(index, phase, stream)
        started = time.perf_counter()
        while True:
            try:
                reply = await client.chat.completions.create(
                    model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0, stream=stream,
                    extra_body={"strategy": "cacheblend", "fidelity": fidelity})
                if stream:
                    async for _ in reply:
                        pass
                break
            except openai.RateLimitError:  # never expected: malformed requests take no slot
                record.retried_429 += 1
                await asyncio.sleep(1)
            except openai.APIStatusError as e:
                record.status, record.error = e.status_code, e.message[:200]
                break
            except openai.APIError as e:
                record.status, record.error = None, f"{type(e).__name__}: {e}"[:200]
                break
        record.ms = (time.perf_counter() - started) * 1e3
        if clock.epoch == epoch:
            records.append(record)


async def store_bytes(server: Server) -> float:
    """The KV the server's store holds in memory (kvboost_store_bytes): what it keeps on purpose, beside its RSS."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(f"{server.base}/metrics", headers={"authorization": f"Bearer {KEY}"})).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvboost_store_bytes ")),
                math.nan)


async def check_set(client: openai.AsyncOpenAI, prompts: list[list[dict]]) -> dict[str, str]:
    """Each check prompt with full and with cacheblend (fidelity fast), one at a time: {key: answer}."""
    answers = {}
    for i, messages in enumerate(prompts):
        for strategy in ("full", "cacheblend"):
            reply = await client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
                extra_body={"strategy": strategy, "fidelity": "fast", "write_back": False})
            answers[f"{i}:{strategy}"] = reply.choices[0].message.content
    return answers


# ---- the run --------------------------------------------------------------------------------------------------


@dataclass
class Report:
    command: str
    limits: dict
    valid: dict = field(default_factory=dict)
    malformed: dict = field(default_factory=dict)
    memory_mb: dict = field(default_factory=dict)
    check_set: dict = field(default_factory=dict)
    malformed_rate: float = 0.0  # malformed requests a second, in the attacked phases
    cpu_cores: dict = field(default_factory=dict)  # CPU use per phase, in cores: the server's, and the attacker's
    server_ms_per_malformed: float = 0.0  # the server's CPU beyond its valid requests', per malformed request
    checks: list[tuple[bool, str]] = field(default_factory=list)


def _latency(records: list[Valid]) -> dict:
    ok = [r.ms for r in records if r.error is None]
    return dict(requests=len(records), errors=sum(r.error is not None for r in records),
                retried_429=sum(r.retried_429 for r in records), p50_ms=percentile(ok, 0.5),
                p90_ms=percentile(ok, 0.9), p99_ms=percentile(ok, 0.99), max_ms=max(ok, default=math.nan))


async def run(args: argparse.Namespace, server: Server, pool_path: Path, limits, report: Report) -> None:
    items = load_items(bundled("tiny"))[:2]
    prompts = [rag_messages(list(docs), item.question, item.system)
               for item in items for docs in (item.documents, item.documents[::-1])]
    checks = [rag_messages(list(item.documents), question, CHECK_SYSTEM) for item in items
              for question in (item.question, "Which town is named first?")][:args.check_prompts]
    process = psutil.Process(server.proc.pid)
    rss = lambda: process.memory_info().rss / 2**20  # noqa: E731
    async with openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        before = await check_set(client, checks)
        clock, stop, records = Clock(), asyncio.Event(), []
        peak = [0.0]

        async def sample_memory() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss())
                await asyncio.sleep(0.5)

        before_warmup = rss()
        tasks = [asyncio.create_task(valid_client(i, client, prompts, clock, stop, records, args.max_tokens,
                                                  args.valid_fidelity)) for i in range(args.clients)]
        sampler = asyncio.create_task(sample_memory())
        await asyncio.sleep(args.warmup_s)
        start_mb, store_start = rss(), await store_bytes(server)
        trend = [("before the warm-up", round(before_warmup, 1)), ("start", round(start_mb, 1))]
        attacks: list[dict] = []
        loop = asyncio.get_running_loop()
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            await loop.run_in_executor(pool, time.sleep, 0)  # the attacker's process started before the timing
            # The server's CPU seconds and the wall seconds of each phase, and the attacker's (in the attacked ones).
            cpu = {"alone": [0.0, 0.0], "attacked": [0.0, 0.0], "attacker": [0.0, 0.0]}

            def account(phase: str, since: tuple[float, float]) -> tuple[float, float]:
                now = (sum(process.cpu_times()[:2]), time.monotonic())
                cpu[phase][0] += now[0] - since[0]
                cpu[phase][1] += now[1] - since[1]
                return now

            for round_ in range(args.rounds):
                clock.set("alone")
                mark = (sum(process.cpu_times()[:2]), time.monotonic())
                await asyncio.sleep(args.phase_s)
                mark = account("alone", mark)
                clock.set("attacked")
                trend.append((f"round {round_ + 1} alone", round(rss(), 1)))
                sent, attacker_cpu = await loop.run_in_executor(pool, attack, str(pool_path), server.base,
                                                                args.phase_s, round_ * 100_000 % 7919, args.attack_rate)
                attacks += sent
                cpu["attacker"][0] += attacker_cpu
                cpu["attacker"][1] += time.monotonic() - mark[1]
                account("attacked", mark)
                trend.append((f"round {round_ + 1} attacked", round(rss(), 1)))
        clock.set("done")
        stop.set()
        await asyncio.gather(*tasks, sampler)
        after = await check_set(client, checks)
        await asyncio.sleep(2)
        end_mb, store_end = rss(), await store_bytes(server)
        trend.append(("end", round(end_mb, 1)))

    alone = [r for r in records if r.phase == "alone"]
    attacked = [r for r in records if r.phase == "attacked"]
    report.valid = dict(alone=_latency(alone), attacked=_latency(attacked), warmup=_latency(
        [r for r in records if r.phase == "warmup"]))
    ratio = report.valid["attacked"]["p50_ms"] / report.valid["alone"]["p50_ms"]
    report.valid["p50_ratio_attacked_over_alone"] = ratio
    report.valid["p90_ratio_attacked_over_alone"] = report.valid["attacked"]["p90_ms"] / report.valid["alone"]["p90_ms"]
    report.malformed_rate = len(attacks) / max(cpu["attacked"][1], 1e-9)
    report.cpu_cores = {phase: round(used / wall, 3) for phase, (used, wall) in cpu.items()}  # cores busy
    # The server's CPU in the attacked phases beyond what their valid requests took at the alone phases' cost each.
    per_valid = cpu["alone"][0] / max(len(alone), 1)
    malformed_cpu = cpu["attacked"][0] - len(attacked) * per_valid
    report.server_ms_per_malformed = round(malformed_cpu / max(len(attacks), 1) * 1e3, 2)
    by_kind: dict[str, list[dict]] = collections.defaultdict(list)
    for a in attacks:
        by_kind[a["kind"]].append(a)
    report.malformed = {kind: dict(
        sent=len(rs), statuses=dict(collections.Counter(str(r["status"]) for r in rs)),
        bad_shape=sum(not r.get("shape", False) for r in rs), p50_ms=percentile([r["ms"] for r in rs], 0.5),
        p99_ms=percentile([r["ms"] for r in rs], 0.99), max_ms=max(r["ms"] for r in rs),
        largest_bytes=max(r["size"] for r in rs)) for kind, rs in sorted(by_kind.items())}
    report.memory_mb = dict(start=round(start_mb, 1), peak=round(peak[0], 1), end=round(end_mb, 1), trend=trend,
                            store_start=round(store_start / 2**20, 2), store_end=round(store_end / 2**20, 2))
    same = sum(before[k] == after.get(k) for k in before)
    report.check_set = dict(answers=len(before), same=same, before=before, after=after)

    def check(ok: bool, text: str) -> None:
        report.checks.append((ok, text))

    fives = [a for a in attacks if a["status"] is not None and a["status"] >= 500]
    fives += [r for r in records if r.status is not None and r.status >= 500]
    log = server.log_tail(10**7)
    check(not fives and "Traceback" not in log, f"no 5xx and no traceback in the server's log: {len(fives)} 5xx")
    not_4xx = [a for a in attacks if a["status"] is None or not 400 <= a["status"] < 500]
    check(not not_4xx, f"every malformed request answered 4xx: {len(attacks)} sent, "
                       f"{len(not_4xx)} not ({collections.Counter(str(a['status']) for a in not_4xx)})")
    shape = [a for a in attacks if not a.get("shape")]
    check(not shape, f"every malformed request answered in OpenAI's error shape: {len(shape)} not")
    slow = sorted((a for a in attacks if a["ms"] > args.malformed_ms), key=lambda a: -a["ms"])
    worst = ", ".join(f"{a['kind']} {a['size']} B {a['ms']:.0f} ms" for a in slow[:3])
    check(not slow, f"every malformed request answered within {args.malformed_ms:.0f} ms: {len(slow)} of "
                    f"{len(attacks)} slower{f' ({worst})' if slow else ''}; slowest "
                    f"{max(a['ms'] for a in attacks):.0f} ms")
    errors = [r for r in alone + attacked if r.error is not None or r.retried_429]
    check(not errors, f"the valid requests: no error and no 429: {len(errors)} of {len(alone + attacked)}")
    check(ratio <= args.ratio_target, f"a valid request's median latency attacked / alone {ratio:.3f} "
                                      f"(target <= {args.ratio_target})")
    stall = report.valid["attacked"]["max_ms"] / report.valid["alone"]["max_ms"]
    check(stall <= 1.5, f"no valid request stalled: slowest attacked / slowest alone {stall:.2f} (<= 1.5)")
    check(same == len(before), f"the check set's answers unchanged: {same} of {len(before)} the same")
    check(end_mb <= start_mb * (1 + args.memory_slack),
          f"memory back to its start level: {start_mb:.0f} MiB at the start, {peak[0]:.0f} peak, {end_mb:.0f} at "
          f"the end (<= +{args.memory_slack:.0%})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--phase-s", type=float, default=45.0)
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--examples", type=int, default=300, help="malformed requests drawn by hypothesis")
    p.add_argument("--check-prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--valid-fidelity", default="fast", help="the valid requests' guard level")
    p.add_argument("--attack-rate", type=float, default=0.0, help="malformed requests a second (0: back to back)")
    p.add_argument("--malformed-ms", type=float, default=100.0)
    p.add_argument("--ratio-target", type=float, default=1.10)
    p.add_argument("--memory-slack", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def _context_window(model: str | None) -> int:
    from transformers import AutoConfig

    from kvboost_rag.models import convert_bundled

    return AutoConfig.from_pretrained(model or convert_bundled()[0]).max_position_embeddings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    limits = limits_for(_context_window(args.model))
    report = Report(" ".join([Path(sys.executable).name, *sys.argv]), asdict(limits))
    with tempfile.TemporaryDirectory(prefix="kvboost-fuzz-") as tmp:
        tmp = Path(tmp)
        started = time.perf_counter()
        pool = draw_malformed(args.examples, args.seed, limits)
        print(f"drew {len(pool)} malformed requests in {time.perf_counter() - started:.1f} s: "
              f"{dict(collections.Counter(m.kind for m in pool))}", flush=True)
        pool_path = tmp / "pool.pickle"
        pool_path.write_bytes(pickle.dumps(pool))
        corpus = tmp / "corpus.jsonl"
        docs = [doc for item in load_items(bundled("tiny"))[:2] for doc in item.documents]
        corpus.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        server_args = argparse.Namespace(start_timeout=args.start_timeout, dtype=args.dtype, model=args.model,
                                         max_requests=4,
                                         server_args=f"--documents {corpus} --api-key {KEY}")
        server = Server(server_args, None, tmp / "server.log")
        server.command[server.command.index("--model-name") + 1] = MODEL_NAME
        server.start()
        try:
            asyncio.run(run(args, server, pool_path, limits, report))
        finally:
            server.stop()
    print(json.dumps({k: v for k, v in asdict(report).items() if k not in ("checks", "check_set")}, indent=1))
    for ok, text in report.checks:
        print(("PASS " if ok else "FAIL ") + text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(report), indent=1, default=str))
    return 0 if all(ok for ok, _ in report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
