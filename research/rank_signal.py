"""Research harness (issue 41): is cacheblend's ranking signal what leaves Gemma 3 270M's repair stale?

cacheblend ranks the tokens still in its set, layer by layer, by how far their fresh K/V (projected from the hidden
states it computed in context) lie from the stale ones. Here the same repair, over the same plan and budget, ranks
instead by how far the *true* K/V (a full prefill's) lie from the stale ones (`truthrank`): what the ranking would be
with perfect knowledge, everything else (the nested schedule, the recompute itself) as shipped. Beside it, the
schedule's knobs at their other values (check_layer 0, taper 1 and 3, recency 0) and larger budgets. Scored as
research/oracle_layers.py scores (first-token and continuation KL against full over 16 teacher-forced tokens of
full's greedy answer), guard off, no drift maps.

    python research/rank_signal.py gemma-3-270m /tmp/rank_store research/data/package_pages.jsonl 0 8
Figures in docs/method.md, "Where Gemma's error lives".
"""

import statistics
import sys
from pathlib import Path

import torch
from scoring import full_reference

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.assembly import assemble
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import kl, render_prompt
from kvboost_rag.config import StoreConfig
from kvboost_rag.engine import Prefill
from kvboost_rag.repair import cacheblend

TOKENS = 16
VARIANTS = {  # name: (RepairConfig overrides, ranked by "fresh" K/V as shipped or by the "truth")
    "cb07": ({"recompute_ratio": 0.07}, "fresh"),
    "cb07-truthrank": ({"recompute_ratio": 0.07}, "truth"),
    "cb07-check0": ({"recompute_ratio": 0.07, "check_layer": 0}, "fresh"),
    "cb07-taper1": ({"recompute_ratio": 0.07, "taper": 1.0}, "fresh"),
    "cb07-taper3": ({"recompute_ratio": 0.07, "taper": 3.0}, "fresh"),
    "cb07-rec0": ({"recompute_ratio": 0.07, "recency": 0.0}, "fresh"),
    "cb15": ({"recompute_ratio": 0.15}, "fresh"),
    "cb30": ({"recompute_ratio": 0.3}, "fresh"),
    "cb30-truthrank": ({"recompute_ratio": 0.3}, "truth"),
    "cb30-taper1": ({"recompute_ratio": 0.3, "taper": 1.0}, "fresh"),
}


def repaired(adapter, plan, config: RepairConfig, truth, rank_by: str) -> cacheblend.BlendResult:
    """cacheblend_prefill with its deviation hook ranking by `rank_by`: the layer in hand is the one project_kv was
    last called for, with the positions it was given (the set's)."""
    at = {}
    project, deviation = adapter.project_kv, cacheblend.kv_deviation

    def projecting(layer, hidden, here):
        at["layer"], at["here"] = layer, here
        return project(layer, hidden, here)

    def ranked(fresh, stale):
        if rank_by == "truth":
            layer, here = at["layer"], at["here"]
            fresh = (truth.keys[layer][:, :, here], truth.values[layer][:, :, here])
        return deviation(fresh, stale)

    adapter.project_kv, cacheblend.kv_deviation = projecting, ranked
    try:
        cache = assemble(plan, adapter, plan.num_tokens + TOKENS)
        return cache, cacheblend.cacheblend_prefill(adapter, cache, plan, config)
    finally:
        adapter.project_kv, cacheblend.kv_deviation = project, deviation


def main() -> None:
    model, store, data, start, end = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    engine = KVBoost.from_pretrained(model, config=EngineConfig(store=StoreConfig(disk_dir=Path(store)),
                                                                repair=RepairConfig(fidelity="fast")))
    adapter, rows = engine.adapter, []
    for item in load_items(data)[start:end]:
        engine.ingest(list(item.documents), progress=False, calibrate=False)
        prompt = render_prompt(item)
        with torch.inference_mode():
            reference, distributions = full_reference(engine, prompt, TOKENS, TOKENS)
            full = engine.prefill(prompt, "full", max_new_tokens=TOKENS, write_back=False)  # its K/V: the truth
            plan, row = engine.plan(prompt, "cacheblend"), {"id": item.id}
            for name, (overrides, rank_by) in VARIANTS.items():
                config = RepairConfig(drift=False, fidelity="fast", **overrides)
                cache, result = repaired(adapter, plan, config, full.cache, rank_by)
                logits = adapter.logits(result.hidden)[-1]
                pre = Prefill(plan, cache, logits, result.recomputed_tokens, name, 0.0, 0.0)
                per_token = kl(reference, distributions(pre)[: len(reference)])
                row[name] = {"first": float(per_token[0]), "cont": float(per_token.mean()),
                             "same_first": int(logits.argmax() == full.logits.argmax())}
        rows.append(row)
        print(item.id, {k: round(v["first"], 3) for k, v in row.items() if k != "id"}, flush=True)
    for name in VARIANTS:
        first = [r[name]["first"] for r in rows]
        print(f"{name:16s} first {statistics.fmean(first):.4f} (median {statistics.median(first):.4f}) "
              f"cont {statistics.fmean(r[name]['cont'] for r in rows):.4f} "
              f"same first token {statistics.fmean(r[name]['same_first'] for r in rows):.3f}")


if __name__ == "__main__":
    main()
