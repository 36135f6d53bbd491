"""Research harness (issues #6, #41): where does the reused cache's error live, and how good could selection be?

Builds hybrid caches from two caches of the same prompt: the truth (a full prefill's K/V) and the stale
one (stored document K/V as assembled, the naive cache). For each variant some (layer, position) K/V
come from the truth and the rest stay stale; the uncached tokens then run through every layer over it,
and the result is scored like the bench (continuation KL over 16 teacher-forced tokens of full's
greedy output, and first-token KL). Variants:

- truth<m / truth>=m: all document tokens true at layers below m / from m on.
- truth-global / truth-sliding: all document tokens true in the layers of that kind only (a model whose layers
  mix sliding-window and global attention: Gemma 2 and 3; on others truth-global is every layer).
- truth-starts / truth-starts4: each reused span's first token (its first four) true in every layer.
- oracle, oracle30, oracle60: the progressive schedule of `cacheblend` at 0.07, 0.3, 0.6 (same per-layer counts)
  with the set chosen by the *true* deviation (truth vs stale K/V), nested like ours, and given the truth: an upper
  bound for deviation-driven selection with that budget (the truth stands in for what recomputing would give).
- cacheblend, cacheblend30, cacheblend60: the shipped strategy at those budgets, unguarded, without drift maps.

    python research/oracle_layers.py research/data/package_pages.jsonl 0 8 /tmp/oracle_store out/oracle.json \
        gemma-3-270m
(the last argument: a model as `kvboost-rag --model` takes it; left out, the bundled one). Figures in
docs/method.md, "Where Gemma's error lives".
"""

import json
import math
import statistics
import sys
from pathlib import Path

import torch

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.assembly import APPROX, assemble
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import continued_logits, kl, render_prompt
from kvboost_rag.config import StoreConfig
from kvboost_rag.engine import Prefill
from kvboost_rag.generation import SamplingParams
from kvboost_rag.repair.cacheblend import layer_fractions

TOKENS = 16


def deviation(truth, stale, layer, positions):
    dk = (truth.keys[layer][0, :, positions] - stale.keys[layer][0, :, positions]).pow(2).sum(dim=(0, 2))
    dv = (truth.values[layer][0, :, positions] - stale.values[layer][0, :, positions]).pow(2).sum(dim=(0, 2))
    return dk + dv


def true_at(truth, stale, choice: dict[int, torch.Tensor], capacity_from):
    """A copy of `stale` with (layer, positions) in `choice` taken from `truth`."""
    cache = capacity_from
    for layer in range(len(stale.keys)):
        cache.keys[layer].copy_(stale.keys[layer])
        cache.values[layer].copy_(stale.values[layer])
        pos = choice.get(layer)
        if pos is not None and pos.numel():
            cache.keys[layer][:, :, pos] = truth.keys[layer][:, :, pos]
            cache.values[layer][:, :, pos] = truth.values[layer][:, :, pos]
    return cache


def oracle_choice(truth, stale, reused, n, num_layers, nested: bool, recency: float, config: RepairConfig):
    fractions = layer_fractions(config.recompute_ratio, config.taper, num_layers - config.check_layer - 1)
    weight = ((reused.float() + 1) / n) ** recency
    choice = {layer: reused for layer in range(config.check_layer + 1)}  # layers 0..check: all fresh
    current = torch.arange(reused.numel())
    for j, fraction in enumerate(fractions[:-1]):  # the last layer runs the last token only
        layer = config.check_layer + 1 + j
        pool = current if nested else torch.arange(reused.numel())
        count = min(math.ceil(fraction * reused.numel()), pool.numel())
        score = deviation(truth, stale, layer, reused[pool]) * weight[pool]
        current = pool[torch.topk(score, count).indices]
        choice[layer] = reused[current]
    return choice


def truth(engine, prompt) -> tuple[Prefill, list[int], torch.Tensor]:
    """A full prefill of `prompt`, its greedy answer (TOKENS tokens) and the logits teacher-forced on it [T, V]: what
    every variant is scored against. One prefill: decoding writes past the prompt only."""
    full = engine.prefill(prompt, "full", max_new_tokens=TOKENS, write_back=False)
    greedy = list(list(engine.stream_from(full, SamplingParams(TOKENS)))[-1].result.token_ids) or [0]
    return full, greedy, continued_logits(engine, full, full.logits[None], greedy)


def main() -> None:
    data, start, end, store, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    model = sys.argv[6] if len(sys.argv) > 6 else None
    engine = KVBoost.from_pretrained(model, config=EngineConfig(store=StoreConfig(disk_dir=Path(store)),
                                                                repair=RepairConfig(fidelity="fast")))
    adapter = engine.adapter  # every variant measured before drift correction (drift=False)
    L = adapter.num_layers
    kinds = [layer.attention for layer in adapter.layer_plan]
    thirds = (L // 3, 2 * L // 3)
    variants = (["naive"] + [f"truth<{m}" for m in (1, 2, *thirds)] + [f"truth>={m}" for m in thirds]
                + ["truth-global", "truth-sliding", "truth-starts", "truth-starts4",
                   "oracle", "oracle30", "oracle60", "cacheblend", "cacheblend30", "cacheblend60"])
    rows = []
    for item in load_items(data)[start:end]:
        engine.ingest(list(item.documents), progress=False, calibrate=False)
        prompt = render_prompt(item)
        with torch.inference_mode():
            full, greedy, reference = truth(engine, prompt)
            p = engine.plan(prompt, "naive")
            n = p.num_tokens
            stale = assemble(p, adapter, n + TOKENS)
            reused = p.positions(APPROX)
            uncached = p.computed_positions()
            scratch = adapter.new_buffers(n + TOKENS)
            row = {"id": item.id}
            gap = torch.ones_like(reused, dtype=torch.bool)
            gap[1:] = reused[1:] - reused[:-1] != 1
            starts = reused[gap]
            starts4 = torch.unique(torch.cat([starts + k for k in range(4)]))
            starts4 = starts4[torch.isin(starts4, reused)]
            for name in variants:
                ratio = {"30": 0.3, "60": 0.6}.get(name[-2:], 0.07)
                if name.startswith("cacheblend"):
                    pre = engine.prefill(prompt, "cacheblend", max_new_tokens=TOKENS, write_back=False,
                                         repair=RepairConfig(drift=False, fidelity="fast", recompute_ratio=ratio))
                else:
                    if name == "naive":
                        choice = {}
                    elif name.startswith("truth<"):
                        choice = {layer: reused for layer in range(int(name[6:]))}
                    elif name.startswith("truth>="):
                        choice = {layer: reused for layer in range(int(name[7:]), L)}
                    elif name in ("truth-global", "truth-sliding"):
                        kind = "full_attention" if name == "truth-global" else "sliding_attention"
                        choice = {layer: reused for layer in range(L) if kinds[layer] == kind}
                    elif name.startswith("truth-starts"):
                        choice = {layer: starts4 if name.endswith("4") else starts for layer in range(L)}
                    else:
                        choice = oracle_choice(full.cache, stale, reused, n, L, nested="free" not in name,
                                               recency=1.0 if "rec" in name else 0.0,
                                               config=RepairConfig(drift=False, fidelity="fast", recompute_ratio=ratio))
                    cache = true_at(full.cache, stale, choice, scratch)
                    hidden = adapter.run_layers(adapter.embed(p.token_ids[uncached]), uncached, cache, range(L), n)
                    pre = Prefill(p, cache, adapter.logits(hidden[:, -1:])[-1], uncached.numel(), name, 0.0, 0.0)
                dist = continued_logits(engine, pre, pre.logits[None], greedy)
                per_token = kl(reference, dist[: len(reference)])
                row[name] = {"first": float(per_token[0]), "cont": float(per_token.mean())}
        rows.append(row)
        print(item.id, {k: round(v["cont"], 3) for k, v in row.items() if k != "id"}, flush=True)
    summary = {name: {k: statistics.fmean(r[name][k] for r in rows) for k in ("first", "cont")} for name in variants}
    for name, s in summary.items():
        print(f"{name:16s} cont {s['cont']:.4f} ({s['cont'] / summary['naive']['cont']:.2f} naive) "
              f"first {s['first']:.4f}")
    Path(out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
