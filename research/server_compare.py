"""`kvboost-rag serve` as shipped against a server answering every request with `full`, same run (issue 41's target).

Starts two servers on 127.0.0.1 and free ports (the bundled model unless --model, --dtype float32), one after the
other, and gives each the documents of the first --items items of --data after --skip (the bench's held-out slice by
default) through POST /v1/documents, which calibrates an engine once it knows 8 documents, as a served corpus is:
  A  as shipped: each request leaves `strategy` out, so the engine's default (cacheblend) at the default fidelity
     ("balanced") answers it, and shadow checks run at their default share (EngineConfig.shadow_share);
  B  every request sends `strategy: "full"` (serve has no flag for a default strategy, so it goes in the body).
Then, never both at once (the CPU's cores are shared): a warm-up of --warmup requests per server (not counted), and
--rounds rounds of a --phase-s phase per server, A then B. In a phase --clients clients (the real openai client,
chat completions, streamed, temperature 0, --max-tokens) loop over one seeded sequence of prompts (each item's
question over its documents in --orders orders, shuffled), each server from where its last phase stopped, so that B
answers a prefix of what A answers. A request still running at the phase's end is cut (its stream closed) and not
counted. After each phase the harness waits until the server's process is idle (CPU), so that A's backlog of shadow
checks, which run once its engine is idle, never runs inside B's phase; that wait is reported ("settle"), and
requests per minute are given with it counted too.

Reported: per server, completed requests, requests per minute, client TTFT (to the first content chunk) p50 / p90,
latency p50, completion tokens/s; A/B requests per minute against 1.5x and B/A p50 TTFT against 2x (PASS/FAIL);
for the (question, order) prompts both answered, the share whose first 16 tokens (the bundled tokenizer's, of the
answer text) are equal and the share identical, and each server's accuracy on them (bench.run.correct); A's
kvboost_shadow_* from /metrics: checks run during the phases and after them, predicted against observed.

    .venv/bin/python research/server_compare.py --json out/server_compare.json    # ~20 min on 2 CPU cores
    # smoke: the tiny set's first 2 items (6 documents, too few to calibrate on), a few seconds per phase
    .venv/bin/python research/server_compare.py --data kvboost_rag/bench/tiny.jsonl --skip 0 --items 2 --orders 2 \
        --phase-s 10 --rounds 1 --max-tokens 8 --warmup 2

Not a test; the exit code is 0 unless a server fails (start, ingest, or exit during the run). Needs the serve
extra, openai and psutil (the test extra).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
from load_test import Job, Prompt, Record, Server, ask, build_prompts, percentile, read_items  # research/load_test.py
from prometheus_client.parser import text_string_to_metric_families

from kvboost_rag.bench.data import bundled
from kvboost_rag.bench.run import correct
from kvboost_rag.calibrate import MIN_DOCUMENTS

AGREE_TOKENS = 16
RPM_TARGET, TTFT_TARGET = 1.5, 2.0  # A/B requests per minute, B/A p50 TTFT
IDLE_CPU_S = 0.05  # CPU seconds in a 1 s window under which a server counts as idle (no request, no shadow check)
SHADOW_KEYS = ("checks", "predicted_flips", "observed_flips", "predicted_differ", "observed_differ")


@dataclass
class Side:
    name: str
    strategy: str | None  # the request body's `strategy`; None leaves the server's default
    server: Server
    client: openai.AsyncOpenAI | None = None
    http: httpx.AsyncClient | None = None
    cursor: int = 0  # next prompt of the shared sequence: each phase continues where this server's last one stopped
    records: list[Record] = field(default_factory=list)  # the timed phases' requests
    phases: list[dict] = field(default_factory=list)


class ServerFailed(RuntimeError):
    pass


# ---- the servers -----------------------------------------------------------------------------------


def start(side: Side, documents: list[str], args: argparse.Namespace) -> None:
    """Start the server and ingest the documents (calibration included, when there are enough of them)."""
    started = time.perf_counter()
    try:
        side.server.start()
        response = httpx.post(f"{side.server.base}/v1/documents", json={"documents": documents},
                              timeout=args.request_timeout)
        response.raise_for_status()
    except (RuntimeError, httpx.HTTPError) as e:
        raise ServerFailed(f"server {side.name}: {e}\n{side.server.log_tail()}") from None
    calibrated = "calibrated" if len(documents) >= MIN_DOCUMENTS else f"too few to calibrate on ({MIN_DOCUMENTS})"
    print(f"server {side.name} up at {side.server.base}, {len(documents)} documents ingested ({calibrated}), in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr)


async def settle(side: Side, timeout_s: float) -> float:
    """Wait until the server's process has used under IDLE_CPU_S of CPU in a second (its requests' last steps and
    queued shadow checks done): the seconds waited."""
    started = time.perf_counter()
    process = psutil.Process(side.server.proc.pid)
    while True:
        if side.server.proc.poll() is not None:
            raise ServerFailed(f"server {side.name} exited ({side.server.proc.returncode}):\n{side.server.log_tail()}")
        before = sum(process.cpu_times()[:2])
        await asyncio.sleep(1)
        if sum(process.cpu_times()[:2]) - before < IDLE_CPU_S or time.perf_counter() - started > timeout_s:
            return time.perf_counter() - started


async def shadow(http: httpx.AsyncClient) -> dict[str, float]:
    """The kvboost_shadow_* gauges of /metrics (empty when the engine has no shadow checks)."""
    response = await http.get("/metrics")
    response.raise_for_status()
    found = {s.name.removeprefix("kvboost_shadow_"): s.value for f in text_string_to_metric_families(response.text)
             for s in f.samples if s.name.startswith("kvboost_shadow_")}
    return {k: found[k] for k in SHADOW_KEYS if k in found}


# ---- the phases ------------------------------------------------------------------------------------


async def warm(side: Side, prompts: list[Prompt], args: argparse.Namespace) -> None:
    """Untimed requests, --clients at a time: first-call costs (allocations, kernel set-up) are not load."""
    for i in range(0, len(prompts), args.clients):
        batch = [ask(side.client, Job(p, side.strategy, True, args.max_tokens), "warmup", c)
                 for c, p in enumerate(prompts[i:i + args.clients])]
        failed = [r for r in await asyncio.gather(*batch) if r.error]
        if failed:
            print(f"warm-up of {side.name}: {failed[0].error}: {failed[0].error_detail}", file=sys.stderr)


async def phase(side: Side, prompts: list[Prompt], args: argparse.Namespace, label: str) -> dict:
    """--clients clients for --phase-s seconds; a request still running at the end is cut and not counted."""
    deadline = time.perf_counter() + args.phase_s
    cut = 0

    async def run_client(c: int) -> list[Record]:
        nonlocal cut
        done = []
        while (left := deadline - time.perf_counter()) > 0:
            prompt = prompts[side.cursor % len(prompts)]
            side.cursor += 1
            try:
                done.append(await asyncio.wait_for(
                    ask(side.client, Job(prompt, side.strategy, True, args.max_tokens), label, c), left))
            except asyncio.TimeoutError:  # wait_for cancelled it: the stream is closed, the server stops after a step
                cut += 1
            if side.server.proc.poll() is not None:  # else its clients would spin on refused connections
                raise ServerFailed(f"server {side.name} exited during {label}:\n{side.server.log_tail()}")
        return done

    records = [r for rs in await asyncio.gather(*(run_client(c) for c in range(args.clients))) for r in rs]
    side.records += records
    return dict(server=side.name, phase=label, seconds=args.phase_s, completed=sum(r.error is None for r in records),
                errors=sum(r.error is not None for r in records), cut=cut)


async def measure(args: argparse.Namespace, sides: list[Side], prompts: list[Prompt], warmups: list[Prompt]) -> dict:
    a = sides[0]
    async with contextlib.AsyncExitStack() as stack:
        for side in sides:
            side.client = await stack.enter_async_context(openai.AsyncOpenAI(
                base_url=f"{side.server.base}/v1", api_key="unused", max_retries=0, timeout=args.request_timeout))
            side.http = await stack.enter_async_context(httpx.AsyncClient(base_url=side.server.base, timeout=30))
            await settle(side, args.settle_timeout)  # the ingest's last work, before anything is timed
        shadow_start = None
        for round_ in range(args.rounds):
            for side in sides:
                if round_ == 0:
                    await warm(side, warmups, args)
                    await settle(side, args.settle_timeout)
                before = await shadow(side.http) if side is a else {}
                shadow_start = before if side is a and shadow_start is None else shadow_start
                info = await phase(side, prompts, args, f"{side.name}{round_ + 1}")
                info["shadow_end"] = await shadow(side.http) if side is a else {}
                info["settle_s"] = await settle(side, args.settle_timeout)
                info["shadow_settled"] = await shadow(side.http) if side is a else {}
                info["shadow_before"] = before
                side.phases.append(info)
                print(f"phase {info['phase']}: {info['completed']} completed, {info['cut']} cut, {info['errors']} "
                      f"errors; settled in {info['settle_s']:.1f} s", file=sys.stderr)
    return shadow_start


# ---- the report ------------------------------------------------------------------------------------


def row(side: Side) -> dict:
    ok = [r for r in side.records if r.error is None]
    phase_s = sum(p["seconds"] for p in side.phases)
    settle_s = sum(p["settle_s"] for p in side.phases)
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return dict(completed=len(ok), cut=sum(p["cut"] for p in side.phases), errors=len(side.records) - len(ok),
                phase_s=phase_s, settle_s=settle_s, rpm=60 * len(ok) / phase_s,
                rpm_with_settle=60 * len(ok) / (phase_s + settle_s), ttft_p50_ms=percentile(ttfts, 0.5),
                ttft_p90_ms=percentile(ttfts, 0.9), latency_p50_ms=percentile([r.latency_ms for r in ok], 0.5),
                server_ttft_p50_ms=percentile([r.server_ttft_ms for r in ok if r.server_ttft_ms is not None], 0.5),
                tokens_per_s=sum(r.completion_tokens for r in ok) / phase_s,
                reuse_ratio=sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else float("nan"),
                fell_back=sum(bool(r.fell_back) for r in ok))


def agreement(a: Side, b: Side, answers: dict[str, tuple[str, ...]], tokenize) -> dict:
    """The prompts both servers answered (each server's first answer to it): equal first tokens, identical, correct."""
    def first(side: Side) -> dict[str, str]:
        return {r.prompt: r.text for r in reversed(side.records) if r.error is None}  # the earliest wins

    fa, fb = first(a), first(b)
    both = sorted(fa.keys() & fb.keys())
    out = dict(prompts=len(both), agree16=None, identical=None, accuracy=None, accuracy_all=None)
    if both:
        out["agree16"] = sum(tokenize(fa[k])[:AGREE_TOKENS] == tokenize(fb[k])[:AGREE_TOKENS] for k in both) / len(both)
        out["identical"] = sum(fa[k] == fb[k] for k in both) / len(both)
    if both and all(answers.values()):
        def right(texts: dict[str, str], keys) -> float:
            return sum(correct(texts[k], answers[k.rsplit("@", 1)[0]]) for k in keys) / len(keys)

        out["accuracy"] = {s.name: right(f, both) for s, f in ((a, fa), (b, fb))}
        out["accuracy_all"] = {s.name: right(f, list(f)) for s, f in ((a, fa), (b, fb))}
    return out


def shadow_figures(a: Side, start: dict) -> dict:
    """A's shadow checks: run during its phases, run after them (while it settled), predicted against observed."""
    if not start:
        return {}
    delta = {k: a.phases[-1]["shadow_settled"][k] - start[k] for k in SHADOW_KEYS}
    during = sum(p["shadow_end"]["checks"] - p["shadow_before"]["checks"] for p in a.phases)
    return dict(delta, during_phases=during, after_phases=delta["checks"] - during,
                total=a.phases[-1]["shadow_settled"])


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio >= target else "FAIL"  # a NaN (a server with no completed request) fails too


def report(args: argparse.Namespace, rows: dict, ratios: dict, agree: dict, shade: dict, n_prompts: int) -> str:
    lines = [f"{args.clients} clients, {args.rounds} round(s) of {args.phase_s:g} s per server (A then B), "
             f"{args.items} items of {args.data.name} from item {args.skip}, x {args.orders} orders "
             f"({n_prompts} prompts), max_tokens {args.max_tokens}, streamed, temperature 0, {args.dtype}", "",
             "| server | completed (cut, errors) | req/min | req/min counting settle | TTFT p50 / p90 ms "
             "| latency p50 ms | completion tok/s | reuse ratio | fell back |", "|---|---|---|---|---|---|---|---|---|"]
    for name, label in (("A", "A: as shipped"), ("B", "B: full")):
        r = rows[name]
        lines.append(f"| {label} | {r['completed']} ({r['cut']}, {r['errors']}) | {r['rpm']:.1f} | "
                     f"{r['rpm_with_settle']:.1f} ({r['settle_s']:.0f} s) | {r['ttft_p50_ms']:.0f} / "
                     f"{r['ttft_p90_ms']:.0f} | {r['latency_p50_ms']:.0f} | {r['tokens_per_s']:.1f} | "
                     f"{r['reuse_ratio']:.2f} | {r['fell_back']} |")
    lines += ["", f"Requests per minute A / B: **{ratios['rpm']:.2f}x** (target >= {RPM_TARGET}x: "
                  f"{verdict(ratios['rpm'], RPM_TARGET)}); counting the settle {ratios['rpm_with_settle']:.2f}x.",
              f"p50 TTFT B / A: **{ratios['ttft']:.2f}x** (target >= {TTFT_TARGET}x: "
              f"{verdict(ratios['ttft'], TTFT_TARGET)})."]
    if agree["prompts"]:
        accuracy = (f"; accuracy on them A {agree['accuracy']['A']:.3f}, B {agree['accuracy']['B']:.3f} (on every "
                    f"answer: A {agree['accuracy_all']['A']:.3f}, B {agree['accuracy_all']['B']:.3f})"
                    if agree["accuracy"] else "")
        lines.append(f"Answers to the {agree['prompts']} prompts both served: first {AGREE_TOKENS} tokens equal "
                     f"{agree['agree16']:.3f}, identical {agree['identical']:.3f}{accuracy}.")
    if shade:
        lines.append(f"Shadow checks on A: {shade['checks']:g} ({shade['during_phases']:g} during its phases, "
                     f"{shade['after_phases']:g} while it settled); served tokens flipped: predicted "
                     f"{shade['predicted_flips']:.2f}, observed {shade['observed_flips']:g}; answers differing: "
                     f"predicted {shade['predicted_differ']:.2f}, observed {shade['observed_differ']:g}.")
    else:
        lines.append("Shadow checks on A: none in /metrics (the engine has no shadow checks).")
    return "\n".join(lines)


# ---- main ------------------------------------------------------------------------------------------


def tokenizer(model: str | None):
    """The served model's tokenizer: answers are compared token by token as the bench compares them."""
    from transformers import AutoTokenizer

    from kvboost_rag.models import convert_bundled, local_source

    tok = AutoTokenizer.from_pretrained(convert_bundled()[0] if model is None else local_source(model)[0])
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=bundled("synthetic_k8"))
    p.add_argument("--skip", type=int, default=130, help="items skipped at the start of --data (the held-out slice)")
    p.add_argument("--items", type=int, default=8, help="items whose documents are ingested and asked about")
    p.add_argument("--orders", type=int, default=24, help="document orders per item: the file's, then shuffles")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="rounds of one phase per server, A then B")
    p.add_argument("--phase-s", type=float, default=90)
    p.add_argument("--warmup", type=int, default=4, help="untimed requests per server before its first phase")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="the servers' --model (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--request-timeout", type=float, default=900, help="seconds; the ingest calibrates in one request")
    p.add_argument("--settle-timeout", type=float, default=300, help="seconds a server may take to become idle")
    p.add_argument("--json", type=Path, default=None, help="write the config, results, phases and every request")
    args = p.parse_args(argv)
    for name in ("items", "orders", "clients", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` and kill: stop the servers on the way out
    items, documents = read_items(args.data, args.skip, args.items)
    prompts = build_prompts(items, args.orders, args.seed)
    random.Random(args.seed).shuffle(prompts)
    warmups, prompts = prompts[:args.warmup], prompts[args.warmup:] or prompts  # warm-up prompts are not timed
    tokenize = tokenizer(args.model)
    server_args = argparse.Namespace(start_timeout=args.start_timeout, dtype=args.dtype, model=args.model,
                                     max_requests=None, server_args="")
    with tempfile.TemporaryDirectory(prefix="kvboost-compare-") as tmp, contextlib.ExitStack() as cleanup:
        sides = [Side("A", None, Server(server_args, None, Path(tmp) / "a.log")),
                 Side("B", "full", Server(server_args, None, Path(tmp) / "b.log"))]
        try:
            for side in sides:
                cleanup.callback(side.server.stop)
                start(side, documents, args)
            shadow_start = asyncio.run(measure(args, sides, prompts, warmups))
        except ServerFailed as e:
            print(f"a server failed: {e}", file=sys.stderr)
            return 1
    rows = {s.name: row(s) for s in sides}
    ratios = dict(rpm=rows["A"]["rpm"] / max(rows["B"]["rpm"], 1e-9),
                  rpm_with_settle=rows["A"]["rpm_with_settle"] / max(rows["B"]["rpm_with_settle"], 1e-9),
                  ttft=rows["B"]["ttft_p50_ms"] / rows["A"]["ttft_p50_ms"])
    agree = agreement(*sides, {item.id: item.answers for item in items}, tokenize)
    shade = shadow_figures(sides[0], shadow_start)
    print(report(args, rows, ratios, agree, shade, len(prompts)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps(dict(
            config=config, rows=rows, ratios=ratios, passed=dict(rpm=ratios["rpm"] >= RPM_TARGET,
                                                                 ttft=ratios["ttft"] >= TTFT_TARGET),
            agreement=agree, shadow=shade, phases=[p for s in sides for p in s.phases],
            requests={s.name: [asdict(r) for r in s.records] for s in sides}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
