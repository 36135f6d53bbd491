"""A batched decode step's rows over their own caches (kvcache.RowsCache in place, attention.PerRow) against the
padded copy of every row's K/V per layer it replaced: what a forward costs, and how fast B concurrent answers finish.

1. Costs: B full prefills of the set's prompts (~1.2k tokens each on fidelity_holdout), then batched decode forwards
   over B streams x Q tokens (B in 2, 4; Q in 1, 3), 7 each, the two ways alternating, after a warm-up round;
   medians, and the largest difference between the two ways' logits.
2. Concurrent answers: the items in groups of B, each group prefilled once per stream (the product as shipped:
   `ingest` calibrates, the default strategy, the default drafts), the B answers decoded at once from B threads in
   place and padded in turns (the order swapped from group to group), after a warm-up group. Reported: the wall
   time summed and its median ratio, and whether each answer is the same token for token. Shadow checks off.

    .venv/bin/python research/rows_in_place.py research/data/fidelity_holdout.jsonl --limit 24 --tokens 64 \
        --json out/rows_in_place.json
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from batched_lookahead import answer_together, prefilled_groups  # this folder (a script's folder is on sys.path)
from lookahead_speed import setup

from kvboost_rag import batching
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.config import EngineConfig

WAYS = (True, False)  # in place, padded


def forward_costs(engine, items, repeats: int = 7) -> tuple[dict[str, float], float]:
    """Median ms of one batched decode forward, each way, over B streams x Q tokens; the largest logit gap."""
    pres = [engine.prefill(render_prompt(item, "bench"), "full", max_new_tokens=8, write_back=False)
            for item in items[:4]]
    sizes = [(b, q) for b in (2, 4) for q in (1, 3)]
    ms = {(size, way): [] for size in sizes for way in WAYS}
    gap = 0.0
    adapter = engine.adapter
    with engine.lock, torch.inference_mode():
        for r in range(repeats + 1):  # the first round warms up
            for b, q in sizes:
                chosen = pres[:b]
                logits = {}
                for way in WAYS if r % 2 else WAYS[::-1]:
                    adapter.rows_in_place = way
                    started = time.perf_counter()
                    logits[way] = batching.decode(adapter, [p.cache for p in chosen], [7] * b,
                                                  [p.prompt_tokens for p in chosen], [[7] * (q - 1)] * b)
                    if r:
                        ms[((b, q), way)].append((time.perf_counter() - started) * 1e3)
                gap = max(gap, max((x - y).abs().max().item() for x, y in zip(*logits.values(), strict=True)))
    adapter.rows_in_place = True
    return {f"{b} x {q} {'in place' if way else 'padded'}": statistics.median(t)
            for ((b, q), way), t in ms.items()}, gap


def main() -> None:
    args, items, engine = setup(__doc__, streams={"type": int, "default": 4})
    costs, gap = forward_costs(engine, items)
    print("ms a forward, B streams x Q tokens:", {k: round(v, 1) for k, v in costs.items()}, "largest logit gap",
          gap, flush=True)
    b, drafts = args.streams, EngineConfig.lookahead
    rows = []
    for g, pres in prefilled_groups(engine, items, b, args.tokens):
        runs = {}
        for way in WAYS if g % 2 else WAYS[::-1]:
            engine.adapter.rows_in_place = way
            runs[way] = answer_together(engine, pres, args.tokens, drafts)
        engine.adapter.rows_in_place = True
        row = {"tokens": sum(len(a) for a in runs[True][0]),
               "same": [x == y for x, y in zip(runs[True][0], runs[False][0], strict=True)],
               "wall_s_in_place": runs[True][1], "wall_s_padded": runs[False][1]}
        if g:
            rows.append(row)
            print(g, row["tokens"], row["same"], round(row["wall_s_padded"], 2), round(row["wall_s_in_place"], 2),
                  flush=True)
    tokens = sum(r["tokens"] for r in rows)
    summary = {
        "streams": b,
        "speed-up, summed": sum(r["wall_s_padded"] for r in rows) / sum(r["wall_s_in_place"] for r in rows),
        "speed-up, median": statistics.median(r["wall_s_padded"] / r["wall_s_in_place"] for r in rows),
        "tokens a second, padded": tokens / sum(r["wall_s_padded"] for r in rows),
        "tokens a second, in place": tokens / sum(r["wall_s_in_place"] for r in rows),
        "same answers": sum(sum(r["same"]) for r in rows) / sum(len(r["same"]) for r in rows),
        "largest logit gap, forwards": gap,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ms_a_forward": costs, "summary": summary, "groups": rows}, f, indent=1)


if __name__ == "__main__":
    main()
