"""Which reused tokens' K/V decide the look-alike answers (issue 41): true K/V pasted into the stale cache.

The server comparison's look-alike families (research/server_compare.py's report; eight documents per prompt, every
one a town, observatory or ship named alike) are answered right by a full prefill 18 times of 58 at 16 tokens and
4 times by the repair. research/oracle_layers.py's method on those prompts: for each, a full prefill's K/V (the
truth) and the documents' stored K/V as assembled (stale, no drift maps); in each variant some (layer, position)
K/V come from the truth, the uncached tokens (template, question) run every layer over it, and 16 tokens are decoded
greedily from there. Per variant: answers right, lost / won against full's, equal to full's 16 tokens, first-token
and mean KL over full's 16 tokens teacher-forced. Variants:

- naive; truth<m / truth>=m (all reused tokens true below / from layer m);
- distinct: the reused tokens whose id occurs in no other reused chunk of the prompt (the names' own pieces, the
  numbers, the words one document alone has), true in every layer; shared: the rest;
- starts4: each reused chunk's first four tokens, every layer;
- oracle, oracle30: cacheblend's schedule at 0.07 / 0.3 with the set chosen by the true deviation, given the truth;
- cacheblend, cacheblend30: the strategy itself at 0.07 / 0.3, unguarded, no drift maps.

    .venv/bin/python research/lookalike_oracle.py out/server_compare.json --json out/lookalike_oracle.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from lookalike_variants import paired_prompts  # research/lookalike_variants.py
from oracle_layers import oracle_choice, true_at  # research/oracle_layers.py

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.assembly import APPROX, assemble
from kvboost_rag.bench.run import continued_logits, correct, kl
from kvboost_rag.engine import Prefill
from kvboost_rag.generation import SamplingParams

TOKENS = 16


def decoded(engine: KVBoost, pre: Prefill) -> tuple[str, list[int]]:
    result = list(engine.stream_from(pre, SamplingParams(TOKENS)))[-1].result
    return result.text, list(result.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="research/server_compare.py's --json")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = json.loads(Path(args.report).read_text())
    config = report["config"]
    keys, prompts, paired, documents = paired_prompts(report, args.limit)

    engine = KVBoost.from_pretrained(config=EngineConfig(dtype=config["dtype"], repair=RepairConfig(fidelity="fast")))
    engine.ingest(documents, progress=False, calibrate=False)
    adapter = engine.adapter
    L = adapter.num_layers
    variants = ["naive", "truth<10", "truth<20", "truth>=10", "truth>=20", "distinct", "shared", "starts4",
                "oracle", "oracle30", "cacheblend", "cacheblend30"]
    rows = []
    for key, messages, item in zip(keys, prompts, paired, strict=True):
        row = {"prompt": key}
        with torch.inference_mode():
            # Decoding writes past the prompt only: the same cache then takes full's answer teacher-forced.
            full = engine.prefill(messages, "full", max_new_tokens=TOKENS, write_back=False)
            full_text, greedy = decoded(engine, full)
            reference = continued_logits(engine, full, full.logits[None], greedy)
            row["full"] = {"text": full_text, "right": correct(full_text, item.answers)}
            p = engine.plan(messages, "naive")
            n = p.num_tokens
            stale = assemble(p, adapter, n + TOKENS)
            reused, uncached = p.positions(APPROX), p.computed_positions()
            spans = [c for c in p.chunks if c.source == APPROX]
            ids_in = [set(c.token_ids) for c in spans]
            distinct = torch.tensor(sorted(
                c.start + k for i, c in enumerate(spans) for k, t in enumerate(c.token_ids)
                if not any(t in other for j, other in enumerate(ids_in) if j != i)), dtype=torch.long)
            shared = reused[~torch.isin(reused, distinct)]
            starts4 = torch.tensor([c.start + k for c in spans for k in range(min(4, len(c.token_ids)))])
            row["distinct_share"] = distinct.numel() / reused.numel()
            scratch = adapter.new_buffers(n + TOKENS)
            for name in variants:
                ratio = 0.3 if name.endswith("30") else 0.07
                if name.startswith("cacheblend"):
                    pre = engine.prefill(messages, "cacheblend", max_new_tokens=TOKENS, write_back=False,
                                         repair=RepairConfig(drift=False, fidelity="fast", recompute_ratio=ratio))
                else:
                    if name.startswith("oracle"):
                        choice = oracle_choice(full.cache, stale, reused, n, L, nested=True, recency=0.0,
                                               config=RepairConfig(drift=False, fidelity="fast",
                                                                   recompute_ratio=ratio))
                    else:
                        choice = {"naive": {}, "distinct": {layer: distinct for layer in range(L)},
                                  "shared": {layer: shared for layer in range(L)},
                                  "starts4": {layer: starts4 for layer in range(L)}}.get(name)
                        if choice is None:
                            m = int(name.split("=")[-1].split("<")[-1])
                            choice = {layer: reused for layer in (range(m) if "<" in name else range(m, L))}
                    cache = true_at(full.cache, stale, choice, scratch)
                    hidden = adapter.run_layers(adapter.embed(p.token_ids[uncached]), uncached, cache, range(L), n)
                    pre = Prefill(p, cache, adapter.logits(hidden[:, -1:])[-1], uncached.numel(), name, 0.0, 0.0)
                first = pre.logits[None].clone()
                text, _ = decoded(engine, pre)
                per_token = kl(reference, continued_logits(engine, pre, first, greedy)[: len(reference)])
                row[name] = {"text": text, "right": correct(text, item.answers), "same": text == full_text,
                             "first": float(per_token[0]), "cont": float(per_token.mean())}
        rows.append(row)
        print(key, int(row["full"]["right"]), f"distinct {row['distinct_share']:.2f}",
              {v: int(row[v]["right"]) for v in variants}, flush=True)
    print(f"{len(rows)} prompts, {TOKENS} tokens; full right {sum(r['full']['right'] for r in rows):.0f}; distinct "
          f"tokens {statistics.fmean(r['distinct_share'] for r in rows):.2f} of the reused")
    for v in variants:
        right = sum(r[v]["right"] for r in rows)
        lost = sum(r["full"]["right"] > r[v]["right"] for r in rows)
        won = sum(r["full"]["right"] < r[v]["right"] for r in rows)
        same = sum(r[v]["same"] for r in rows)
        print(f"{v:14s} right {right:3.0f}  lost / won {lost:2d} / {won:2d}  = full's {same:2d}"
              f"  KL first {statistics.fmean(r[v]['first'] for r in rows):.4f}"
              f" mean {statistics.fmean(r[v]['cont'] for r in rows):.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
