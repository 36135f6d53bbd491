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


def forward_costs(engine, items, switch, labels: dict, sizes, repeats: int = 7) -> tuple[dict[str, float], float]:
    """Median ms of one batched decode forward over B streams x Q tokens (`sizes`), each way (`switch(way)` sets
    one; `labels`: way -> its name), alternating; the largest gap between the two ways' logits."""
    pres = [engine.prefill(render_prompt(item, "bench"), "full", max_new_tokens=8, write_back=False)
            for item in items[:max(b for b, _ in sizes)]]
    ways = list(labels)
    ms = {(size, way): [] for size in sizes for way in ways}
    gap = 0.0
    with engine.lock, torch.inference_mode():
        for r in range(repeats + 1):  # the first round warms up
            for b, q in sizes:
                chosen = pres[:b]
                logits = {}
                for way in ways if r % 2 else ways[::-1]:
                    switch(way)
                    started = time.perf_counter()
                    logits[way] = batching.decode(engine.adapter, [p.cache for p in chosen], [7] * b,
                                                  [p.prompt_tokens for p in chosen], [[7] * (q - 1)] * b)
                    if r:
                        ms[((b, q), way)].append((time.perf_counter() - started) * 1e3)
                gap = max(gap, max((x - y).abs().max().item() for x, y in zip(*logits.values(), strict=True)))
    switch(ways[0])
    return {f"{b} x {q} {labels[way]}": statistics.median(t) for ((b, q), way), t in ms.items()}, gap


def compare(args, items, engine, switch, labels: dict, sizes) -> dict:
    """Both parts of the comparison (the module's docstring), the first of `labels`' ways the new one: printed, and
    written to args.json; the summary."""
    costs, gap = forward_costs(engine, items, switch, labels, sizes)
    print("ms a forward, B streams x Q tokens:", {k: round(v, 1) for k, v in costs.items()}, "largest logit gap",
          gap, flush=True)
    new, old = labels
    b, drafts = args.streams, EngineConfig.lookahead
    rows = []
    for g, pres in prefilled_groups(engine, items, b, args.tokens):
        runs = {}
        for way in (new, old) if g % 2 else (old, new):
            switch(way)
            runs[way] = answer_together(engine, pres, args.tokens, drafts)
        switch(new)
        row = {"tokens": sum(len(a) for a in runs[new][0]),
               "same": [x == y for x, y in zip(runs[new][0], runs[old][0], strict=True)],
               f"wall_s_{labels[new]}": runs[new][1], f"wall_s_{labels[old]}": runs[old][1]}
        if g:
            rows.append(row)
            print(g, row["tokens"], row["same"], round(runs[old][1], 2), round(runs[new][1], 2), flush=True)
    tokens = sum(r["tokens"] for r in rows)
    walls = {way: [r[f"wall_s_{labels[way]}"] for r in rows] for way in labels}
    summary = {
        "streams": b,
        "speed-up, summed": sum(walls[old]) / sum(walls[new]),
        "speed-up, median": statistics.median(o / n for o, n in zip(walls[old], walls[new], strict=True)),
        **{f"tokens a second, {labels[way]}": tokens / sum(walls[way]) for way in (old, new)},
        "same answers": sum(sum(r["same"]) for r in rows) / sum(len(r["same"]) for r in rows),
        "largest logit gap, forwards": gap,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ms_a_forward": costs, "summary": summary, "groups": rows}, f, indent=1)
    return summary


def main() -> None:
    args, items, engine = setup(__doc__, streams={"type": int, "default": 4})

    def switch(way: bool) -> None:
        engine.adapter.rows_in_place = way

    compare(args, items, engine, switch, {True: "in place", False: "padded"}, [(b, q) for b in (2, 4) for q in (1, 3)])


if __name__ == "__main__":
    main()
