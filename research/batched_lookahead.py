"""Prompt lookup in a batch of concurrent streams (kvboost_rag/batching.py): what a decode forward over B streams
of 1 + D tokens each costs, and how fast B concurrent answers finish with and without drafts.

1. Costs: B full prefills of fidelity_holdout prompts (~1.2k tokens each), then batched decode forwards over B
   streams x Q tokens (B in 1, 2, 4; Q in 1, 2, 3), 5 each, the sizes' order alternating; medians.
2. Concurrent answers: the items in groups of B, each group prefilled once per stream (the product as shipped:
   `ingest` calibrates, the default strategy), then the B answers decoded at once from B threads, with
   EngineConfig.lookahead = 0 and = the default in turns (the order swapped from group to group), after a warm-up
   group. Reported: the group's wall time summed and its median ratio, forwards (batches) a token, and whether each
   answer is the same token for token. Shadow checks off (they would run between the timed decodes).

    .venv/bin/python research/batched_lookahead.py research/data/fidelity_holdout.jsonl --limit 24 --tokens 64 \
        --json out/batched_lookahead.json
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time

import torch
from lookahead_speed import setup  # this folder: Python puts a script's folder on sys.path

from kvboost_rag import batching
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.config import EngineConfig
from kvboost_rag.generation import SamplingParams


def forward_costs(engine, items, repeats: int = 5) -> dict[str, float]:
    """Median ms of one batched decode forward over B streams x Q tokens, after real prompts."""
    pres = [engine.prefill(render_prompt(item, "bench"), "full", max_new_tokens=8, write_back=False)
            for item in items[:4]]
    sizes = [(b, q) for b in (1, 2, 4) for q in (1, 2, 3)]
    ms = {size: [] for size in sizes}
    with engine.lock, torch.inference_mode():
        for r in range(repeats + 1):  # the first round warms up
            for b, q in sizes[::1 if r % 2 else -1]:
                chosen = pres[:b]
                started = time.perf_counter()
                batching.decode(engine.adapter, [p.cache for p in chosen], [7] * b, [p.prompt_tokens for p in chosen],
                                [[7] * (q - 1)] * b)
                if r:
                    ms[(b, q)].append((time.perf_counter() - started) * 1e3)
    return {f"{b} x {q}": statistics.median(t) for (b, q), t in ms.items()}


def answer_together(engine, pres, tokens: int, drafts: int) -> tuple[list[tuple[int, ...]], float, int]:
    """The B answers decoded at once, one thread each: the answers, the wall seconds, the forwards run."""
    engine.config = dataclasses.replace(engine.config, lookahead=drafts)
    answers: list = [None] * len(pres)
    go = threading.Barrier(len(pres) + 1)

    def run(i: int) -> None:
        go.wait()
        *_, last = engine.stream_from(pres[i], SamplingParams(tokens))
        answers[i] = last.result.token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pres))]
    for t in threads:
        t.start()
    before = engine.batcher.counters["batches"]
    go.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return answers, time.perf_counter() - started, engine.batcher.counters["batches"] - before


def prefilled_groups(engine, items, streams: int, tokens: int):
    """The items in groups of `streams`, the first group twice (a warm-up, numbered 0), each prefilled once per stream
    as shipped (`ingest` calibrated, the default strategy): (the group's number, its prefills)."""
    groups = [items[i:i + streams] for i in range(0, len(items) - streams + 1, streams)]
    for g, group in enumerate([groups[0], *groups]):
        yield g, [engine.prefill(render_prompt(item, "bench"), max_new_tokens=tokens, write_back=False)
                  for item in group]


def main() -> None:
    args, items, engine = setup(__doc__, streams={"type": int, "default": 4})
    costs = forward_costs(engine, items)
    print("ms a forward, B streams x Q tokens:", {k: round(v, 1) for k, v in costs.items()}, flush=True)
    drafts, b = EngineConfig.lookahead, args.streams
    rows = []
    for g, pres in prefilled_groups(engine, items, b, args.tokens):
        runs = {k: answer_together(engine, pres, args.tokens, k) for k in ((0, drafts) if g % 2 else (drafts, 0))}
        row = {"tokens": sum(len(a) for a in runs[0][0]),
               "same": [a == d for a, d in zip(runs[0][0], runs[drafts][0], strict=True)],
               "wall_s": runs[0][1], "wall_s_drafts": runs[drafts][1],
               "forwards": runs[0][2], "forwards_drafts": runs[drafts][2]}
        if g:
            rows.append(row)
            print(g, row["tokens"], row["same"], round(row["wall_s"], 2), round(row["wall_s_drafts"], 2),
                  row["forwards"], row["forwards_drafts"], flush=True)
    tokens = sum(r["tokens"] for r in rows)
    summary = {
        "streams": b,
        "speed-up, summed": sum(r["wall_s"] for r in rows) / sum(r["wall_s_drafts"] for r in rows),
        "speed-up, median": statistics.median(r["wall_s"] / r["wall_s_drafts"] for r in rows),
        "tokens a second": tokens / sum(r["wall_s"] for r in rows),
        "tokens a second, drafts": tokens / sum(r["wall_s_drafts"] for r in rows),
        "forwards a token": sum(r["forwards"] for r in rows) / tokens,
        "forwards a token, drafts": sum(r["forwards_drafts"] for r in rows) / tokens,
        "same answers": sum(sum(r["same"]) for r in rows) / sum(len(r["same"]) for r in rows),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "drafts": drafts, "ms_a_forward": costs, "summary": summary,
                       "groups": rows}, f, indent=1)


if __name__ == "__main__":
    main()
