"""Research harness (issue #6, round 4): do drift maps fitted on one corpus help another?

Fits two sets of maps with `KVBoost.fit_drift` (24 prompts each): on the documents of items FIT of DATA (the
same corpus as the evaluated items, other documents) and on the documents of the synthetic tuning split's
first 24 items (another corpus). Then, for items EVAL of DATA, continuation KL (16 teacher-forced tokens of
full's greedy output) and first-token KL of naive reuse and cacheblend (r 0.15) with no maps, the corpus's
maps and the other corpus's maps. In-memory store: nothing is written. Results: research/notebook.md.

    python research/drift_transfer.py kvboost_rag/bench/pydoc_k8.jsonl 24:48 0:12
"""

import statistics
import sys

import torch

from kvboost_rag import KVBoost, RepairConfig
from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.bench.run import continued_logits, kl, render_prompt
from kvboost_rag.generation import SamplingParams


def documents(items) -> list[str]:
    return [d for item in items for d in item.documents]


def main() -> None:
    data, fit_range, eval_range = sys.argv[1], sys.argv[2], sys.argv[3]
    (a, b), (c, d) = (map(int, r.split(":")) for r in (fit_range, eval_range))
    items = load_items(data)
    engine = KVBoost.from_pretrained(repair=RepairConfig(fidelity="fast"))
    maps = {"corpus": engine.fit_drift(documents(items[a:b]), prompts=24),
            "other": engine.fit_drift(documents(load_items(bundled("synthetic_calib"))[:24]), prompts=24)}
    variants = {f"{ratio_name} {which}": (ratio, which) for ratio_name, ratio in (("naive", 0.0), ("r0.15", 0.15))
                for which in ("none", "corpus", "other")}
    rows = []
    for item in items[c:d]:
        engine.ingest(list(item.documents), progress=False, calibrate=False)
        prompt = render_prompt(item)
        with torch.inference_mode():
            full = engine.prefill(prompt, "full", max_new_tokens=16, write_back=False)
            greedy = list(list(engine.stream_from(full, SamplingParams(16)))[-1].result.token_ids)
            reference = continued_logits(engine, full, full.logits[None], greedy)
            row = {}
            for name, (ratio, which) in variants.items():
                engine.drift = maps.get(which)
                pre = engine.prefill(prompt, "cacheblend", max_new_tokens=16, write_back=False,
                                     repair=RepairConfig(recompute_ratio=ratio, fidelity="fast"))
                per_token = kl(reference, continued_logits(engine, pre, pre.logits[None], greedy)[: len(reference)])
                row[name] = (float(per_token.mean()), float(per_token[0]))
        rows.append(row)
        print(item.id, {name: round(v[0], 3) for name, v in row.items()}, flush=True)
    for name in variants:
        print(f"{name:14s} cont {statistics.fmean(r[name][0] for r in rows):.4f} "
              f"first {statistics.fmean(r[name][1] for r in rows):.4f}")


if __name__ == "__main__":
    main()
