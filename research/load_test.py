"""Load test of `kvboost-rag serve`: concurrent streaming clients, `full` against `cacheblend`, interleaved.

Starts the server as a subprocess on 127.0.0.1 and a free port (the bundled model unless --model), ingests
the documents of the first --items bench items through POST /v1/documents (which calibrates the engine once
it knows 8 of them, as a served corpus would be), then runs --concurrency clients of the real openai client
(`openai.AsyncOpenAI`), each sending --requests requests of each strategy, alternating which goes first,
all streamed. Per request: TTFT (the first content chunk), total latency, completion tokens (the stream's
usage), and the server's own figures (ttft_ms, fell_back). Prints a Markdown table: median and p90 TTFT,
median latency, the run's throughput (requests/s, tokens/s; both strategies share the server, so there is
one figure for the run) and the TTFT ratio full / cacheblend.

    .venv/bin/python research/load_test.py --concurrency 4 --requests 8 --items 8 --max-tokens 32 \
        --json out/load_test.json
    .venv/bin/python research/load_test.py --requests 1 --concurrency 1 --items 2 --max-tokens 4   # smoke

Not a test: on 2 CPU cores the default run takes minutes. Needs the serve extra and openai (the test extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai

from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.prompts import rag_messages

STRATEGIES = ("full", "cacheblend")
MODEL_NAME = "kvboost-load-test"


@dataclass
class Record:
    client: int
    strategy: str
    item: str
    ttft_ms: float | None  # to the first content chunk; None when none came
    latency_ms: float
    completion_tokens: int
    prompt_tokens: int
    server_ttft_ms: float | None = None  # the server's kvboost.ttft_ms (prefill to the first token's logits)
    fell_back: bool | None = None
    error: str | None = None


# ---- the server ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_command(args: argparse.Namespace, port: int) -> list[str]:
    script = Path(sys.executable).with_name("kvboost-rag")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "kvboost_rag.cli"]
    command += ["serve", "--host", "127.0.0.1", "--port", str(port), "--model-name", MODEL_NAME,
                "--dtype", args.dtype]
    if args.model:
        command += ["--model", args.model]
    if args.store:
        command += ["--store", str(args.store)]
    return command + shlex.split(args.server_args)


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    """The server, once /health answers, and its base URL."""
    port = _free_port()  # may be taken before the server binds it: then it exits, and its log says so
    log = log_path.open("wb")
    proc = subprocess.Popen(_serve_command(args, port), stdout=log, stderr=subprocess.STDOUT)
    log.close()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(proc)
    tail = log_path.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"the server did not start (exit code {proc.returncode}); its log ends:\n{tail}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down and the engine closes its store
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


# ---- the clients ---------------------------------------------------------------------------------


async def one_request(client: openai.AsyncOpenAI, messages: list[dict], strategy: str, max_tokens: int,
                      client_index: int, item_id: str) -> Record:
    started = time.perf_counter()
    ttft = None
    usage = figures = None
    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"strategy": strategy})
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = (time.perf_counter() - started) * 1e3
            usage = chunk.usage or usage
            figures = (chunk.model_extra or {}).get("kvboost") or figures
    except openai.APIError as e:
        return Record(client_index, strategy, item_id, ttft, (time.perf_counter() - started) * 1e3, 0, 0,
                      error=f"{type(e).__name__}: {e}")
    latency = (time.perf_counter() - started) * 1e3
    return Record(client_index, strategy, item_id, ttft, latency,
                  usage.completion_tokens if usage else 0, usage.prompt_tokens if usage else 0,
                  figures.get("ttft_ms") if figures else None, figures.get("fell_back") if figures else None)


def plan(args: argparse.Namespace, items: list) -> list[list[tuple[str, object]]]:
    """Each client's requests in order: --requests items, each asked with both strategies, the order of the
    two alternating from item to item and from client to client."""
    plans = []
    for c in range(args.concurrency):
        requests = []
        for r in range(args.requests):
            item = items[(c * args.requests + r) % len(items)]
            order = STRATEGIES if (c + r) % 2 == 0 else STRATEGIES[::-1]
            requests += [(strategy, item) for strategy in order]
        plans.append(requests)
    return plans


async def drive(base: str, args: argparse.Namespace, items: list) -> tuple[list[Record], float]:
    """(every timed request's record, the timed part's wall seconds)."""
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                  timeout=args.request_timeout) as client:
        for _ in range(args.warmup):  # untimed: first-call costs (kernel set-up, allocations) are not load
            for strategy in STRATEGIES:
                await one_request(client, _messages(items[0]), strategy, args.max_tokens, -1, items[0].id)

        async def run_client(c: int, requests) -> list[Record]:
            return [await one_request(client, _messages(item), strategy, args.max_tokens, c, item.id)
                    for strategy, item in requests]

        started = time.perf_counter()
        results = await asyncio.gather(*(run_client(c, p) for c, p in enumerate(plan(args, items))))
        return [r for rs in results for r in rs], time.perf_counter() - started


def _messages(item) -> list[dict]:
    return rag_messages(item.documents, item.question, item.system)


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
    ok = [r for r in records if r.error is None and r.ttft_ms is not None]
    rows = {}
    for strategy in STRATEGIES:
        mine = [r for r in ok if r.strategy == strategy]
        ttfts = [r.ttft_ms for r in mine]
        rows[strategy] = dict(
            requests=len(mine), median_ttft_ms=percentile(ttfts, 0.5), p90_ttft_ms=percentile(ttfts, 0.9),
            median_latency_ms=percentile([r.latency_ms for r in mine], 0.5),
            tokens_per_request=statistics.fmean([r.completion_tokens for r in mine]) if mine else math.nan,
            median_server_ttft_ms=percentile([r.server_ttft_ms for r in mine if r.server_ttft_ms is not None], 0.5),
            fell_back=sum(bool(r.fell_back) for r in mine))
    tokens = sum(r.completion_tokens for r in ok)
    full, blend = rows["full"], rows["cacheblend"]
    return dict(rows=rows, wall_s=wall_s, requests=len(ok), errors=len(records) - len(ok),
                requests_per_s=len(ok) / wall_s if wall_s else math.nan,
                tokens_per_s=tokens / wall_s if wall_s else math.nan,
                ttft_ratio_median=full["median_ttft_ms"] / blend["median_ttft_ms"],
                ttft_ratio_p90=full["p90_ttft_ms"] / blend["p90_ttft_ms"])


def table(summary: dict, args: argparse.Namespace) -> str:
    lines = [f"{args.concurrency} clients x {args.requests} requests per strategy, {args.items} items, "
             f"max_tokens {args.max_tokens}, {args.dtype}; {summary['requests']} requests in "
             f"{summary['wall_s']:.1f} s, {summary['errors']} errors", "",
             "| strategy | requests | median TTFT ms | p90 TTFT ms | median latency ms | tokens/request | "
             "server TTFT ms (median) | fell back |",
             "|---|---|---|---|---|---|---|---|"]
    for strategy, row in summary["rows"].items():
        lines.append(f"| {strategy} | {row['requests']} | {row['median_ttft_ms']:.0f} | {row['p90_ttft_ms']:.0f} | "
                     f"{row['median_latency_ms']:.0f} | {row['tokens_per_request']:.1f} | "
                     f"{row['median_server_ttft_ms']:.0f} | {row['fell_back']} |")
    lines += ["", "| throughput (the run's, both strategies) | requests/s | tokens/s | TTFT ratio full / cacheblend "
                  "(median) | (p90) |",
              "|---|---|---|---|---|",
              f"| all | {summary['requests_per_s']:.2f} | {summary['tokens_per_s']:.1f} | "
              f"**{summary['ttft_ratio_median']:.2f}x** | {summary['ttft_ratio_p90']:.2f}x |"]
    return "\n".join(lines)


# ---- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    p.add_argument("--requests", type=int, default=8, help="requests per client and strategy")
    p.add_argument("--items", type=int, default=8, help="bench items whose documents are ingested and asked about")
    p.add_argument("--skip", type=int, default=0, help="items to skip at the start of --data")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1, help="untimed requests per strategy before the run")
    p.add_argument("--data", type=Path, default=bundled("synthetic_k8"))
    p.add_argument("--model", default=None, help="the server's --model (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--store", type=Path, default=None,
                   help="the server's --store; reused across runs, it keeps the calibration (and the requests' "
                        "written-back chunks); default: memory only")
    p.add_argument("--server-args", default="", help="more flags for `kvboost-rag serve`, e.g. '--fidelity fast'")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--request-timeout", type=float, default=1800)
    p.add_argument("--json", type=Path, default=None, help="write every request's record and the summary here")
    args = p.parse_args(argv)
    for name in ("concurrency", "requests", "items"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    items = load_items(args.data, args.skip + args.items)[args.skip:]
    if len(items) < args.items:
        raise SystemExit(f"{args.data} has only {len(items)} items after --skip {args.skip}")
    documents = list(dict.fromkeys(doc for item in items for doc in item.documents))
    with tempfile.TemporaryDirectory(prefix="kvboost-load-") as tmp:
        log_path = Path(tmp) / "server.log"
        started = time.perf_counter()
        proc, base = start_server(args, log_path)
        try:
            print(f"server up at {base} in {time.perf_counter() - started:.1f}s (log {log_path})", file=sys.stderr)
            started = time.perf_counter()
            r = httpx.post(f"{base}/v1/documents", json={"documents": documents}, timeout=args.request_timeout)
            r.raise_for_status()
            print(f"ingested {len(r.json()['ids'])} documents in {time.perf_counter() - started:.1f}s "
                  "(calibration included when due)", file=sys.stderr)
            records, wall_s = asyncio.run(drive(base, args, items))
        finally:
            stop_server(proc)
    summary = summarize(records, wall_s)
    print(table(summary, args))
    for record in records:
        if record.error:
            print(f"error ({record.strategy}, {record.item}): {record.error}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps(dict(config=config, summary=summary,
                                             requests=[asdict(r) for r in records]), indent=1))
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
