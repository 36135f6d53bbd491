"""Load test of `kvboost-rag serve`: concurrent clients for a fixed time over a mixed RAG workload, then faults.

Starts the server as a subprocess on 127.0.0.1 and a free port (the bundled model unless --model), ingests the
documents of the first --items bench items through POST /v1/documents (which calibrates the engine once it
knows 8 of them, as a served corpus would be), then runs --concurrency clients of the real openai client
(`openai.AsyncOpenAI`) for --duration seconds (or --requests each). Every client loops: one item's question over
its documents in one of --orders orders (the file's, then seeded shuffles), strategy `cacheblend`, or `full` (the
reference of the TTFT ratio) with chance --full-share, streamed with chance --stream-share, temperature 0. A 429
(the server's --max-requests bound: documented) is retried after its Retry-After and counted, not an error.

Reported per strategy: requests, requests/s, p50/p90/p99 TTFT (client-side, to the first content chunk, of the
streamed requests; and the server's own kvboost.ttft_ms, of every request), median latency, completion
tokens/s, the reuse ratio (usage.prompt_tokens_details.cached_tokens over prompt_tokens), errors by kind (HTTP
status or exception) and 429s; then GET /metrics's counts next to the client's.

With --faults, three faults follow the timed run. "Nothing wrong was served": before the run, the check set
(--check-prompts distinct (question, order) prompts, each asked with both strategies, one request at a time,
greedy) is answered once; after each fault it is asked again and every full answer must be the one from before,
every cacheblend answer the one from before or the full one.
  (a) Redis restarted under load (--store redis): redis-server is SIGKILLed for --outage seconds while the
      clients run, then started again on its folder. It runs with --appendonly yes, so what it stored survives:
      every key there before the kill must be there after, and every request meanwhile must succeed (the
      server's memory tier still holds the documents; what misses is recomputed).
  (b) clients killed mid-stream: --concurrency long streams are cut (task cancelled, connection closed) after
      their first content chunk; the server must stay healthy and its in-flight gauge get back to 0.
  (c) the server SIGKILLed and started again on the same store, without ingesting: every check prompt asked with
      cacheblend and the guard off (fidelity "fast", so that no fall-back to a full prefill hides what the store
      gave) must reuse at least as many tokens as before the faults: the documents' KV and index were kept (in
      Redis, the --store folder, or without --store a temporary folder the script makes). With Redis alone the
      calibration (drift maps, the guard's curve) is not kept, as it lives in a store folder only: the restarted
      server answers without it, which the answer check then covers too.
Each check prints PASS or FAIL; the exit code is 1 when one failed.

    # the issue's target: 16 clients for 2 minutes on a Redis-backed server, then the faults
    .venv/bin/python research/load_test.py --concurrency 16 --duration 120 --items 8 --max-tokens 32 \
        --store redis --faults --json out/load_test.json
    # the same with the server's bound under the clients, so that 429s happen (retried, counted)
    ... --max-requests 8
    # smokes on 2 CPU cores: the tiny bundled set (no calibration) in 2 minutes; the bench set in 4
    .venv/bin/python research/load_test.py --data kvboost_rag/bench/tiny.jsonl --concurrency 2 --duration 15 \
        --items 2 --max-tokens 8 --store redis --faults --check-prompts 2
    .venv/bin/python research/load_test.py --concurrency 2 --duration 10 --items 1 --orders 2 --max-tokens 8 \
        --store redis --faults --check-prompts 1 --outage 3 --warmup 0

Not a test: on 2 CPU cores a bench prompt (8 documents, ~1.6k tokens) takes seconds to prefill, ingesting and
calibrating --items 8 about two minutes, and every check set asks 2 requests per check prompt one at a time (3
before the faults and after the server restart, with the reuse probe). Needs the serve and redis extras, openai
(the test extra) and, for --store redis, redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvboost_rag.bench.data import BenchItem, bundled, document_orders, load_items
from kvboost_rag.prompts import rag_messages

STRATEGIES = ("full", "cacheblend")
MODEL_NAME = "kvboost-load-test"
CHAT_ROUTE = "/v1/chat/completions"
MAX_REJECTIONS = 120  # 429s one request waits out before it counts as an error
CUT_MAX_TOKENS = 256  # a killed client's stream: long enough to be cut in the middle
LEAD_S = RECOVER_S = 4.0  # load before Redis is killed and after it is back (fault a)
RETELL = "Retell every document above in detail, one paragraph each."  # a killed client's question


# ---- the workload --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    key: str  # item id @ document order
    messages: list[dict]


@dataclass(frozen=True)
class Job:
    prompt: Prompt
    strategy: str
    stream: bool
    max_tokens: int
    fidelity: str | None = None  # the guard's level for this request (None: the server's)


def build_prompts(items: list[BenchItem], orders: int, seed: int) -> list[Prompt]:
    """Each item's question over its documents in the file's order, then in orders-1 seeded shuffles."""
    rng = random.Random(seed)
    prompts = []
    for item in items:
        for order in document_orders(len(item.documents), orders, rng):
            key = f"{item.id}@{'.'.join(map(str, order))}"
            prompts.append(Prompt(key, rag_messages([item.documents[i] for i in order], item.question, item.system)))
    return prompts


def draw_job(rng: random.Random, prompts: list[Prompt], args: argparse.Namespace) -> Job:
    strategy = "full" if rng.random() < args.full_share else "cacheblend"
    return Job(rng.choice(prompts), strategy, rng.random() < args.stream_share, args.max_tokens)


# ---- the processes: redis-server and the server ----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """redis-server on 127.0.0.1, persisting to an append-only file in `folder` so that a restart keeps its keys."""

    def __init__(self, folder: Path):
        self.folder, self.port, self.proc = folder, _free_port(), None
        self.url = f"redis://127.0.0.1:{self.port}/0"
        folder.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        import redis

        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        command = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.folder),
                   "--appendonly", "yes", "--save", ""]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while self.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError), redis.Redis.from_url(self.url, socket_timeout=2) as client:
                if client.ping():  # answers only once the append-only file is loaded
                    return
            time.sleep(0.1)
        raise RuntimeError(f"redis-server did not start on port {self.port} (exit code {self.proc.poll()})")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def keys(self) -> set[bytes]:
        import redis

        with redis.Redis.from_url(self.url) as client:
            return set(client.scan_iter(count=1000))


class Server:
    """`kvboost-rag serve` on one port, started again on the same port and store after a kill."""

    def __init__(self, args: argparse.Namespace, store: str | None, log_path: Path):
        self.port, self.log_path, self.proc = _free_port(), log_path, None
        self.base = f"http://127.0.0.1:{self.port}"
        self.start_timeout = args.start_timeout
        script = Path(sys.executable).with_name("kvboost-rag")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "kvboost_rag.cli"]
        command += ["serve", "--host", "127.0.0.1", "--port", str(self.port), "--model-name", MODEL_NAME,
                    "--dtype", args.dtype]
        command += ["--model", args.model] if args.model else []
        command += ["--store", store] if store else []
        command += ["--max-requests", str(args.max_requests)] if args.max_requests else []
        self.command = command + shlex.split(args.server_args)

    def start(self) -> None:
        """Start it and wait for /health (the port may be taken before the server binds it: its log says so)."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not start (exit code {self.proc.returncode}); its log ends:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn shuts down and the engine closes its store
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL: nothing is shut down or flushed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


# ---- one request ---------------------------------------------------------------------------------


@dataclass
class Record:
    phase: str
    client: int
    prompt: str
    strategy: str
    stream: bool
    started: float  # time.perf_counter() when first sent
    ended: float = 0.0
    ttft_ms: float | None = None  # to the first content chunk, streamed requests only
    latency_ms: float = 0.0  # of the attempt that was served
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    server_ttft_ms: float | None = None  # kvboost.ttft_ms: the engine's prefill to the first token's logits
    fell_back: bool | None = None
    text: str = ""
    rejected: int = 0  # 429s waited out before it was served
    error: str | None = None  # the kind: "HTTP 500", an exception's name
    error_detail: str | None = None


async def ask(client: openai.AsyncOpenAI, job: Job, phase: str, client_index: int = -1) -> Record:
    """One request, its 429s retried after their Retry-After."""
    record = Record(phase, client_index, job.prompt.key, job.strategy, job.stream, time.perf_counter())
    while True:
        try:
            await _attempt(client, job, record)
            break
        except openai.RateLimitError as e:
            record.rejected += 1
            if record.rejected > MAX_REJECTIONS:
                record.error, record.error_detail = "HTTP 429 (gave up)", str(e)
                break
            await asyncio.sleep(float(e.response.headers.get("retry-after", 1)))
        except openai.APIStatusError as e:
            record.error, record.error_detail = f"HTTP {e.status_code}", str(e)
            break
        except openai.APIError as e:  # connection errors, timeouts, an error event inside a stream
            record.error, record.error_detail = type(e).__name__, str(e)
            break
    record.ended = time.perf_counter()
    return record


async def _attempt(client: openai.AsyncOpenAI, job: Job, record: Record) -> None:
    started = time.perf_counter()
    extra = {"strategy": job.strategy} | ({"fidelity": job.fidelity} if job.fidelity else {})
    request = dict(model=MODEL_NAME, messages=job.prompt.messages, temperature=0, max_tokens=job.max_tokens,
                   extra_body=extra)
    if job.stream:
        stream = await client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
        parts, usage, figures = [], None, None
        try:
            async for chunk in stream:
                text = chunk.choices[0].delta.content if chunk.choices else None
                if text:
                    if not parts:
                        record.ttft_ms = (time.perf_counter() - started) * 1e3
                    parts.append(text)
                usage = chunk.usage or usage
                figures = (chunk.model_extra or {}).get("kvboost") or figures
        finally:
            await stream.close()
        record.text = "".join(parts)
    else:
        response = await client.chat.completions.create(**request)
        record.text = response.choices[0].message.content or ""
        usage, figures = response.usage, (response.model_extra or {}).get("kvboost")
    record.latency_ms = (time.perf_counter() - started) * 1e3
    if usage is not None:
        record.prompt_tokens, record.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        details = usage.prompt_tokens_details
        record.cached_tokens = (details.cached_tokens or 0) if details else 0
    if figures:
        record.server_ttft_ms, record.fell_back = figures.get("ttft_ms"), figures.get("fell_back")


async def load(client: openai.AsyncOpenAI, prompts: list[Prompt], args: argparse.Namespace, phase: str,
               seconds: float | None = None, requests: int | None = None) -> tuple[list[Record], float]:
    """--concurrency clients, each sending requests one after another until `seconds` have passed (a request
    under way then finishes) or it has sent `requests`: (every record, the wall seconds)."""
    started = time.perf_counter()

    async def run_client(c: int) -> list[Record]:
        rng, records = random.Random(f"{args.seed}-{phase}-{c}"), []
        while (len(records) < requests) if requests else (time.perf_counter() - started < seconds):
            records.append(await ask(client, draw_job(rng, prompts, args), phase, c))
        return records

    results = await asyncio.gather(*(run_client(c) for c in range(args.concurrency)))
    return [r for rs in results for r in rs], time.perf_counter() - started


# ---- the report ----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(records: list[Record], wall_s: float) -> dict:
    rows = {s: _row([r for r in records if r.strategy == s], wall_s) for s in STRATEGIES}
    rows["all"] = _row(records, wall_s)
    full, blend = rows["full"], rows["cacheblend"]
    errors = collections.Counter(r.error for r in records if r.error)
    def ratio(name: str) -> dict[str, float]:
        return {q: full[f"{name}_{q}_ms"] / blend[f"{name}_{q}_ms"] for q in ("p50", "p99")}

    return dict(rows=rows, wall_s=wall_s, errors=dict(errors), rejected=rows["all"]["rejected"],
                ttft_ratio=ratio("ttft"), server_ttft_ratio=ratio("server_ttft"))


def _row(records: list[Record], wall_s: float) -> dict:
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    server = [r.server_ttft_ms for r in ok if r.server_ttft_ms is not None]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    row = dict(requests=len(ok), streamed=sum(r.stream for r in ok), requests_per_s=len(ok) / wall_s,
               latency_p50_ms=percentile([r.latency_ms for r in ok], 0.5),
               tokens_per_s=sum(r.completion_tokens for r in ok) / wall_s,
               reuse_ratio=sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else math.nan,
               fell_back=sum(bool(r.fell_back) for r in ok), errors=len(records) - len(ok),
               rejected=sum(r.rejected for r in records))
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        row[f"ttft_{name}_ms"] = percentile(ttfts, q)
        row[f"server_ttft_{name}_ms"] = percentile(server, q)
    return row


def table(summary: dict, args: argparse.Namespace) -> str:
    mode = f"{args.requests} requests each" if args.requests else f"{args.duration:g} s"
    lines = [f"{args.concurrency} clients, {mode}, {args.items} items x {args.orders} orders, full share "
             f"{args.full_share:g}, stream share {args.stream_share:g}, max_tokens {args.max_tokens}, {args.dtype}, "
             f"store {args.store or 'memory'}: {summary['rows']['all']['requests']} requests in "
             f"{summary['wall_s']:.1f} s", "",
             "| strategy | requests (streamed) | req/s | TTFT p50 / p90 / p99 ms | server TTFT p50 / p90 / p99 ms | "
             "latency p50 ms | completion tok/s | reuse ratio | fell back | errors | 429s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for strategy, row in summary["rows"].items():
        lines.append(
            f"| {strategy} | {row['requests']} ({row['streamed']}) | {row['requests_per_s']:.2f} | "
            f"{row['ttft_p50_ms']:.0f} / {row['ttft_p90_ms']:.0f} / {row['ttft_p99_ms']:.0f} | "
            f"{row['server_ttft_p50_ms']:.0f} / {row['server_ttft_p90_ms']:.0f} / {row['server_ttft_p99_ms']:.0f} | "
            f"{row['latency_p50_ms']:.0f} | {row['tokens_per_s']:.1f} | {row['reuse_ratio']:.2f} | "
            f"{row['fell_back']} | {row['errors']} | {row['rejected']} |")
    ratio, server = summary["ttft_ratio"], summary["server_ttft_ratio"]
    errors = ", ".join(f"{kind} x{n}" for kind, n in summary["errors"].items()) or "none"
    lines += ["", f"TTFT ratio full / cacheblend: client p50 **{ratio['p50']:.2f}x**, p99 {ratio['p99']:.2f}x; "
                  f"server p50 {server['p50']:.2f}x, p99 {server['p99']:.2f}x. Errors: {errors}; 429s (retried "
                  f"after Retry-After): {summary['rejected']}."]
    return "\n".join(lines)


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    """The server's counts from GET /metrics (since it started)."""
    response = await http.get("/metrics")
    response.raise_for_status()
    samples = [s for family in text_string_to_metric_families(response.text) for s in family.samples]

    def total(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    return dict(served=total("kvboost_requests_total", route=CHAT_ROUTE, status="200"),
                answered=total("kvboost_requests_total", route=CHAT_ROUTE),
                rejected=total("kvboost_requests_rejected_total"), in_flight=total("kvboost_requests_in_flight"),
                prompt_tokens=total("kvboost_prompt_tokens_total"), reused_tokens=total("kvboost_reused_tokens_total"),
                completion_tokens=total("kvboost_completion_tokens_total"))


def metrics_table(records: list[Record], server: dict[str, float]) -> str:
    """The client's tally of every request it sent this server next to the server's own."""
    ok = [r for r in records if r.error is None]
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    rejected = sum(r.rejected for r in records)
    rows = [("chat requests served (200)", len(ok), server["served"]),
            ("chat requests answered, any status", len(records) + rejected, server["answered"]),
            ("rejected (429)", rejected, server["rejected"]), ("in flight now", 0, server["in_flight"]),
            ("completion tokens", sum(r.completion_tokens for r in ok), server["completion_tokens"]),
            ("reuse ratio", f"{cached / prompt:.3f}" if prompt else "-",
             f"{server['reused_tokens'] / server['prompt_tokens']:.3f}" if server["prompt_tokens"] else "-")]
    return "\n".join(["| since the server started | client | server (/metrics) |", "|---|---|---|"]
                     + [f"| {name} | {mine} | {theirs:g} |" if isinstance(theirs, float) else
                        f"| {name} | {mine} | {theirs} |" for name, mine, theirs in rows])


# ---- the checks ----------------------------------------------------------------------------------


@dataclass
class Harness:
    """What the run and the faults share."""

    args: argparse.Namespace
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient
    server: Server
    redis: RedisServer | None
    prompts: list[Prompt]
    checks: list[Prompt]
    sent: list[Record] = field(default_factory=list)  # every chat request to the server since it (re)started
    reference: dict[tuple[str, str], Record] = field(default_factory=dict)
    reuse_before: dict[str, Record] = field(default_factory=dict)  # reuse_probe() before the faults
    results: list[dict] = field(default_factory=list)

    def check(self, name: str, passed: bool, detail: str) -> None:
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}", flush=True)
        self.results.append(dict(check=name, passed=passed, detail=detail))

    async def answer_checks(self, phase: str) -> dict[tuple[str, str], Record]:
        """The check set, one request at a time (no batching to tell apart), half of them streamed."""
        answers = {}
        for i, prompt in enumerate(self.checks):
            for strategy in STRATEGIES:
                record = await ask(self.client, Job(prompt, strategy, i % 2 == 1, self.args.max_tokens), phase)
                answers[(prompt.key, strategy)] = record
        self.sent += answers.values()
        return answers

    async def reuse_probe(self, phase: str) -> dict[str, Record]:
        """Each check prompt once more with cacheblend and the guard off (fidelity "fast"): what it reuses is what
        the store holds, never hidden by a fall-back to a full prefill."""
        probes = {p.key: await ask(self.client, Job(p, "cacheblend", False, self.args.max_tokens, "fast"), phase)
                  for p in self.checks}
        self.sent += probes.values()
        return probes

    async def idle_metrics(self, timeout_s: float = 30) -> dict[str, float]:
        """/metrics once nothing is in flight (a finished response's slot is freed just after its last byte)."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = await scrape(self.http)
            if metrics["in_flight"] == 0 or time.monotonic() > deadline:
                return metrics
            await asyncio.sleep(0.25)


def verdict(reference: dict, key: str, strategy: str, text: str, full_now: str | None = None) -> str:
    """How an answer compares with the check set's before the faults: the same, a cacheblend answer equal to a
    full one, or different (served wrong)."""
    if text == reference[(key, strategy)].text:
        return "same"
    if strategy == "cacheblend" and text in (reference[(key, "full")].text, full_now):
        return "cacheblend = full"
    return "different"


def compare(reference: dict, now: dict) -> tuple[collections.Counter, list[str]]:
    """(counts of same / cacheblend = full / different / error, what differed) of the check set asked again."""
    counts, wrong = collections.Counter(), []
    for (key, strategy), record in now.items():
        if record.error:
            counts["error"] += 1
            wrong.append(f"{strategy} {key}: {record.error} {record.error_detail}")
            continue
        full_now = now[(key, "full")].text if (key, "full") in now else None
        kind = verdict(reference, key, strategy, record.text, full_now)
        counts[kind] += 1
        if kind == "different":
            wrong.append(f"{strategy} {key}: {reference[(key, strategy)].text!r} before, {record.text!r} now")
    return counts, wrong


def report_answers(h: Harness, after: str, now: dict) -> None:
    counts, wrong = compare(h.reference, now)
    h.check(f"{after}: nothing wrong was served", not (counts["different"] or counts["error"]),
            f"{_counts(counts)} of {sum(counts.values())} check answers")
    for line in wrong[:10]:
        print(f"    {line}")


def _counts(counts: collections.Counter) -> str:
    return ", ".join(f"{kind} {counts[kind]}" for kind in ("same", "cacheblend = full", "different", "error"))


def agreement_under_load(h: Harness, records: list[Record]) -> None:
    """The timed run's answers to check prompts against the sequential reference: informational, since a batched
    decode step may round differently from a lone one."""
    counts = collections.Counter(verdict(h.reference, r.prompt, r.strategy, r.text) for r in records
                                 if not r.error and (r.prompt, r.strategy) in h.reference)
    print(f"info: the timed run's answers to check prompts against the sequential reference (batched decoding): "
          f"{_counts(counts)}")


# ---- the faults ----------------------------------------------------------------------------------


async def fault_redis_restart(h: Harness) -> None:
    """(a) redis-server SIGKILLed under load for --outage seconds, then started again on its append-only file."""
    if h.redis is None:
        print("SKIP Redis restart: the server has no Redis of this script's (--store redis)")
        return
    before = await asyncio.to_thread(h.redis.keys)
    run = asyncio.create_task(load(h.client, h.prompts, h.args, "redis restart",
                                   seconds=LEAD_S + h.args.outage + RECOVER_S))
    await asyncio.sleep(LEAD_S)
    h.redis.kill()
    down = time.perf_counter()
    await asyncio.sleep(h.args.outage)
    await asyncio.to_thread(h.redis.start)
    up = time.perf_counter()
    records, _ = await run
    h.sent += records
    after = await asyncio.to_thread(h.redis.keys)
    during = [r for r in records if r.started < up and r.ended > down]
    failed = collections.Counter(r.error for r in records if r.error)
    h.check("Redis restart: requests during the outage were served", bool(during) and not failed,
            f"{len(during)} requests overlapped the {up - down:.1f} s outage; errors {dict(failed) or 'none'} "
            f"of {len(records)}")
    h.check("Redis restart: nothing stored was lost", before <= after,
            f"{len(before)} keys before the kill, {len(before - after)} missing after the restart "
            f"({len(after)} now; appendonly)")
    for name, part in (("during the outage", during), ("after it", [r for r in records if r.started >= up])):
        blend = [r for r in part if r.strategy == "cacheblend" and not r.error]
        prompt = sum(r.prompt_tokens for r in blend)
        ratio = f"{sum(r.cached_tokens for r in blend) / prompt:.2f}" if prompt else "-"
        print(f"info: cacheblend {name}: {len(blend)} requests, reuse ratio {ratio}, "
              f"{sum(bool(r.fell_back) for r in blend)} fell back to a full prefill")
    report_answers(h, "after the Redis restart", await h.answer_checks("after the Redis restart"))


def _retell(prompt: Prompt) -> Prompt:
    """The prompt's documents with a question whose answer runs long, and no system prompt asking for a short one."""
    user = next(m for m in prompt.messages if m["role"] == "user")
    documents = user["content"].rsplit("\n\nQuestion:", 1)[0]  # rag_messages' layout
    return Prompt(prompt.key, [{"role": "user", "content": f"{documents}\n\nQuestion: {RETELL}"}])


async def _stream_until_cancelled(client: openai.AsyncOpenAI, job: Job, reached: asyncio.Event) -> None:
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=job.prompt.messages, temperature=0, max_tokens=job.max_tokens, stream=True,
        extra_body={"strategy": job.strategy})
    try:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                reached.set()
    finally:
        await stream.close()  # the connection is dropped: its response was not read to the end


async def _cut_one(client: openai.AsyncOpenAI, job: Job, timeout_s: float) -> str:
    """Stream `job` and cancel it after its first content chunk: "cut", "finished" (before the cut) or an error."""
    reached = asyncio.Event()
    task = asyncio.create_task(_stream_until_cancelled(client, job, reached))
    waiter = asyncio.create_task(reached.wait())
    await asyncio.wait({task, waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        return type(task.exception()).__name__ if task.exception() else "finished"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return "cut"


async def fault_clients_killed(h: Harness) -> None:
    """(b) --concurrency long streams, each dropped by its client after its first content chunk."""
    long = [_retell(p) for p in h.prompts]
    jobs = [Job(long[i % len(long)], STRATEGIES[i % 2], True, CUT_MAX_TOKENS) for i in range(h.args.concurrency)]
    outcomes = collections.Counter(await asyncio.gather(*(_cut_one(h.client, j, h.args.request_timeout) for j in jobs)))
    metrics = await h.idle_metrics()
    health = (await h.http.get("/health")).status_code
    h.check("client killed mid-stream: slots freed, server healthy",
            outcomes["cut"] > 0 and metrics["in_flight"] == 0 and health == 200,
            f"{dict(outcomes)} of {len(jobs)} streams; in flight after: {metrics['in_flight']:g}; /health {health}")
    report_answers(h, "after the killed clients", await h.answer_checks("after the killed clients"))


async def fault_server_restart(h: Harness) -> None:
    """(c) the server SIGKILLed and started again on the same store, its documents not ingested again."""
    h.server.kill()
    await asyncio.to_thread(h.server.start)
    # The probe first: any request that misses writes the KV it recomputed back to the store, refilling it.
    probes = await h.reuse_probe("after the server restart")
    now = await h.answer_checks("after the server restart")
    kept = [k for k, r in probes.items() if not r.error and r.cached_tokens >= h.reuse_before[k].cached_tokens > 0]
    before, after = (sum(r.cached_tokens for r in rs.values()) for rs in (h.reuse_before, probes))
    h.check("server restart: nothing stored was lost", len(kept) == len(probes),
            f"{len(kept)} of {len(probes)} check prompts reused as much as before the faults without being ingested "
            f"again ({after} cached tokens, {before} before; cacheblend, fidelity fast)")
    blend = [r for (_, strategy), r in now.items() if strategy == "cacheblend" and not r.error]
    print(f"info: with the server's guard, {sum(r.cached_tokens > 0 for r in blend)} of {len(blend)} cacheblend check "
          f"requests reused, {sum(bool(r.fell_back) for r in blend)} fell back (before the faults: "
          f"{sum(bool(r.fell_back) for (_, s), r in h.reference.items() if s == 'cacheblend')})")
    report_answers(h, "after the server restart", now)


# ---- main ----------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, server: Server, redis: RedisServer | None, prompts: list[Prompt]) -> dict:
    async with (openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0,
                                   timeout=args.request_timeout) as client,
                httpx.AsyncClient(base_url=server.base, timeout=30) as http):
        checks = random.Random(args.seed).sample(prompts, min(args.check_prompts, len(prompts)))
        h = Harness(args, client, http, server, redis, prompts, checks)
        for prompt in prompts[:args.warmup]:  # untimed: first-call costs (allocations, kernel set-up) are not load
            h.sent += [await ask(client, Job(prompt, s, False, args.max_tokens), "warmup") for s in STRATEGIES]
        if args.faults:
            h.reference = await h.answer_checks("reference")
            h.reuse_before = await h.reuse_probe("reference")
            same = sum(h.reference[(p.key, "full")].text == h.reference[(p.key, "cacheblend")].text for p in checks)
            print(f"reference: {len(checks)} check prompts; cacheblend's answer is full's on {same}", file=sys.stderr)
        records, wall_s = await load(client, prompts, args, "run", seconds=args.duration, requests=args.requests)
        h.sent += records
        summary = summarize(records, wall_s)
        print(table(summary, args) + "\n")
        metrics = await h.idle_metrics()
        print(metrics_table(h.sent, metrics) + "\n")
        for record in [r for r in records if r.error][:10]:
            print(f"error ({record.strategy}, {record.prompt}): {record.error}: {record.error_detail}", file=sys.stderr)
        served_right = not summary["errors"] and summary["rows"]["all"]["requests"] > 0
        h.check("timed run: no errors but 429s", served_right,
                f"{summary['rows']['all']['requests']} served, errors {summary['errors'] or 'none'}, "
                f"{summary['rejected']} 429s retried")
        h.check("timed run: nothing in flight after it", metrics["in_flight"] == 0,
                f"kvboost_requests_in_flight {metrics['in_flight']:g}")
        if args.faults:
            agreement_under_load(h, records)
            await fault_redis_restart(h)
            await fault_clients_killed(h)
            await fault_server_restart(h)
        return dict(summary=summary, metrics=metrics, checks=h.results, requests=[asdict(r) for r in h.sent])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    p.add_argument("--duration", type=float, default=60, help="seconds every client keeps sending requests")
    p.add_argument("--requests", type=int, default=None, help="instead of --duration: requests per client")
    p.add_argument("--items", type=int, default=8, help="bench items whose documents are ingested and asked about")
    p.add_argument("--skip", type=int, default=0, help="items to skip at the start of --data")
    p.add_argument("--orders", type=int, default=3, help="document orders per item: the file's, then shuffles")
    p.add_argument("--full-share", type=float, default=0.25, help="chance a request is `full`, not cacheblend")
    p.add_argument("--stream-share", type=float, default=0.5, help="chance a request is streamed")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts, asked with each strategy, before the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=bundled("synthetic_k8"))
    p.add_argument("--model", default=None, help="the server's --model (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--store", default=None,
                   help="'redis' (a redis-server of the script's own, on a free port), a Redis URL, or a folder; "
                        "default: memory only (with --faults, a temporary folder)")
    p.add_argument("--max-requests", type=int, default=None, help="the server's bound on requests in flight (429s)")
    p.add_argument("--server-args", default="", help="more flags for `kvboost-rag serve`, e.g. '--fidelity fast'")
    p.add_argument("--faults", action="store_true", help="after the run: Redis restart, clients killed, server killed")
    p.add_argument("--outage", type=float, default=5, help="seconds Redis stays down (--faults)")
    p.add_argument("--check-prompts", type=int, default=8, help="prompts whose answers are compared across faults")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--json", type=Path, default=None, help="write the summary, checks and every request's record here")
    args = p.parse_args(argv)
    for name in ("concurrency", "items", "orders", "check_prompts") + (("requests",) if args.requests else ()):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.full_share <= 1 or not 0 <= args.stream_share <= 1:
        p.error("--full-share and --stream-share are chances in [0, 1]")
    return args


def read_items(data: Path, skip: int, count: int) -> tuple[list, list[str]]:
    """`count` items of `data` after the first `skip`, and their distinct documents in the order first met."""
    items = load_items(data, skip + count)[skip:]
    if len(items) < count:
        raise SystemExit(f"{data} has only {len(items)} items after --skip {skip}")
    return items, list(dict.fromkeys(doc for item in items for doc in item.documents))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` and kill: stop the servers on the way out
    items, documents = read_items(args.data, args.skip, args.items)
    with tempfile.TemporaryDirectory(prefix="kvboost-load-") as tmp, contextlib.ExitStack() as cleanup:
        redis_server, store = None, args.store
        if store == "redis":
            redis_server = RedisServer(Path(tmp) / "redis")
            redis_server.start()
            cleanup.callback(redis_server.kill)
            store = redis_server.url
        elif store is None and args.faults:
            store = str(Path(tmp) / "store")  # the server restart needs a store to find its documents in
        server = Server(args, store, Path(tmp) / "server.log")
        started = time.perf_counter()
        server.start()
        cleanup.callback(server.stop)
        print(f"server up at {server.base} in {time.perf_counter() - started:.1f}s, store {store or 'memory'}",
              file=sys.stderr)
        started = time.perf_counter()
        response = httpx.post(f"{server.base}/v1/documents", json={"documents": documents},
                              timeout=args.request_timeout)
        response.raise_for_status()
        print(f"ingested {len(documents)} documents in {time.perf_counter() - started:.1f}s (calibration included "
              "when due)", file=sys.stderr)
        report = asyncio.run(run(args, server, redis_server, build_prompts(items, args.orders, args.seed)))
        failed = [c for c in report["checks"] if not c["passed"]]
        if failed:
            print(f"\nthe server's log ends:\n{server.log_tail()}", file=sys.stderr)
    print(f"{len(report['checks']) - len(failed)} of {len(report['checks'])} checks passed")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps(dict(config=config, **report), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
