"""What prompt lookup (kvboost_rag/lookahead.py) could save, before building it: a decode forward's time over 1-8
tokens at a real prompt's length, and how many forwards full's greedy answers would take with up to K drafts.

For each item: a full prefill, full's greedy answer, then forwards of 1..8 tokens after the prompt (3 each, the
order of sizes alternating by item), and the lookup replayed on the answer: at each step the tokens that followed
the latest occurrence of the longest n-gram (3, 2, 1) ending the text, kept while they equal the answer's. The
decode speed-up per K is the forwards' summed time at their sizes against one forward a token.

    .venv/bin/python research/lookahead_costs.py --json out/lookahead_costs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvboost_rag import KVBoost
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.config import EngineConfig
from kvboost_rag.generation import SamplingParams
from kvboost_rag.lookahead import Drafter
from kvboost_rag.repair.guard import appended

SETS = (("research/data/fidelity_holdout.jsonl", 16), ("research/data/man_pages.jsonl", 8))


def forwards(prompt: list[int], answer: list[int], k: int) -> list[int]:
    """The sizes of the forwards decoding `answer` after `prompt` takes with up to `k` drafts a step."""
    sizes, drafter, i = [], Drafter(prompt), 0
    while i < len(answer):
        draft = drafter.draft(k) if k else []
        kept = 0
        while kept < len(draft) and i + kept < len(answer) and draft[kept] == answer[i + kept]:
            kept += 1
        sizes.append(1 + len(draft))
        for token in answer[i:i + kept + 1]:
            drafter.add(token)
        i += kept + 1
    return sizes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    engine = KVBoost.from_pretrained(config=EngineConfig(calibrate=False, lookahead=0))
    items = [item for path, n in SETS for item in load_items(path)[:n]]
    ms, answers = {q: [] for q in range(1, 9)}, []
    for i, item in enumerate(items):
        pre = engine.prefill(render_prompt(item, "bench"), "full", max_new_tokens=args.tokens + 8, write_back=False)
        *_, last = engine.stream_from(pre, SamplingParams(args.tokens))
        answer, n = list(last.result.token_ids), pre.prompt_tokens
        answers.append((pre.plan.token_ids.tolist(), answer))
        with engine.lock, torch.inference_mode():
            for q in list(ms)[::1 if i % 2 else -1]:
                started = time.perf_counter()
                for _ in range(3):
                    engine.adapter.logits(appended(engine.adapter, pre.cache, n, ([7] * 8)[:q]))
                ms[q].append((time.perf_counter() - started) / 3 * 1e3)
        print(i, len(answer), flush=True)
    cost = {q: statistics.median(t) for q, t in ms.items()}
    tokens = sum(len(a) for _, a in answers)
    saving = {}
    for k in (1, 2, 3, 5, 7):
        sizes = [s for prompt, answer in answers for s in forwards(prompt, answer, k)]
        saving[k] = {"forwards a token": len(sizes) / tokens,
                     "decode speed-up": tokens * cost[1] / sum(cost[s] for s in sizes)}
    print(json.dumps({"ms per forward, by tokens": cost, "by drafts": saving}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms": cost, "by_drafts": saving, "answers": answers}, f)


if __name__ == "__main__":
    main()
