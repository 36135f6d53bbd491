"""Prompt lookup (kvboost_rag/lookahead.py) on the bundled model: whole answers with and without draft tokens.

For each item the product as shipped (`ingest` calibrates) prefills the prompt once per strategy, then decodes
the answer from that prefill with EngineConfig.lookahead = 0 (one token per forward; `--against N`: N drafts) and
= the default (`--drafts K`: K), in turns (the order swapped from item to item), after a warm-up item. Reported:
the decode's median and summed speed-up, the whole answer's (prefill + decode) against full's without drafts
(with `--against`, with N), how many forwards a token took, and whether the answers are the same token for token.
Shadow checks are off here (they would run between the timed decodes).

    .venv/bin/python research/lookahead_speed.py research/data/fidelity_holdout.jsonl --limit 24 --tokens 64 \
        --json out/lookahead.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from kvboost_rag import KVBoost
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.config import EngineConfig
from kvboost_rag.generation import SamplingParams

STRATEGIES = ("full", "cacheblend")


def decoded(engine, pre, tokens: int, drafts: int) -> tuple[tuple[int, ...], float, int]:
    """The answer from `pre`, its decode's seconds and forwards, with `drafts` draft tokens a step."""
    engine.config = dataclasses.replace(engine.config, lookahead=drafts)
    before, started = engine.batcher.counters["batches"], time.perf_counter()
    *_, last = engine.stream_from(pre, SamplingParams(tokens))
    return last.result.token_ids, time.perf_counter() - started, engine.batcher.counters["batches"] - before


def setup(description: str, **more: dict) -> tuple[argparse.Namespace, list, KVBoost]:
    """The prompt-lookup harnesses' common start: their arguments (`more`: name -> add_argument's keywords), the
    items, and the model with those items' documents ingested as shipped, shadow checks off."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("--model", default=None, help="a model name models.py knows, or a folder (default: the bundled one)")
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--limit", type=int, default=24)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    for name, keywords in more.items():
        p.add_argument(f"--{name}", **keywords)
    args = p.parse_args()
    items = load_items(args.data)[args.skip:args.skip + args.limit]
    engine = KVBoost.from_pretrained(args.model, config=EngineConfig(shadow_share=0.0, shadow_share_young=0.0))
    engine.ingest(list(dict.fromkeys(d for item in items for d in item.documents)))
    return args, items, engine


def main() -> None:
    args, items, engine = setup(__doc__, drafts={"type": int, "default": EngineConfig.lookahead},
                                against={"type": int, "default": 0, "help": "the draft count compared with"})
    drafts, base = args.drafts, args.against
    rows = []
    for i, item in enumerate([items[0], *items]):  # the first, twice: a warm-up
        row = {}
        for strategy in STRATEGIES:
            pre = engine.prefill(render_prompt(item, "bench"), strategy, max_new_tokens=args.tokens, write_back=False)
            runs = {}
            for k in (base, drafts) if i % 2 else (drafts, base):
                runs[k] = decoded(engine, pre, args.tokens, k)
            row[strategy] = {"ttft_s": pre.ttft_ms / 1e3, "tokens": len(runs[base][0]),
                             "same": runs[base][0] == runs[drafts][0],
                             "decode_s": runs[base][1], "decode_s_drafts": runs[drafts][1],
                             "forwards": runs[base][2], "forwards_drafts": runs[drafts][2]}
        if i:
            rows.append(row)
            print(i, {s: (r["tokens"], r["same"], round(r["decode_s"], 2), round(r["decode_s_drafts"], 2))
                      for s, r in row.items()}, flush=True)
    summary = {}
    full_whole = sum(r["full"]["ttft_s"] + r["full"]["decode_s"] for r in rows)
    for s in STRATEGIES:
        rs = [r[s] for r in rows]
        summary[s] = {
            "decode speed-up, median": statistics.median(r["decode_s"] / r["decode_s_drafts"] for r in rs),
            "decode speed-up, summed": sum(r["decode_s"] for r in rs) / sum(r["decode_s_drafts"] for r in rs),
            "forwards a token": sum(r["forwards_drafts"] for r in rs) / sum(r["tokens"] for r in rs),
            "same answers": sum(r["same"] for r in rs) / len(rs),
            "whole vs full without drafts": full_whole / sum(r["ttft_s"] + r["decode_s"] for r in rs),
            "whole vs full without drafts, with drafts":
                full_whole / sum(r["ttft_s"] + r["decode_s_drafts"] for r in rs),
        }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "drafts": drafts, "against": base, "summary": summary, "items": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
