"""Research harness (issue #6, round 7): drift maps per place against one map for every place.

On items of DATA whose documents STORE holds, fits maps with `KVBoost.fit_drift(places=P)` for each P named
in VARIANTS (24 prompts of 8 stored documents, the same prompts for each P), then per item runs full and,
for each variant "P" or "P:setting=value+...", cacheblend with those maps and repair settings (the bench's
override syntax), and prints accuracy, first-token KL and continuation KL (32 teacher-forced tokens of full's
greedy output) per variant. Nothing is written to the store; with OUT.json, the per-item figures (and each
item's answer place) are written there. A fifth argument sets what documents are encoded after at ingestion
(`ChunkingConfig.doc_context`, "none" by default; STORE then holds that encoding's entries).

    python scripts/research/drift_places.py out/t300_first.jsonl out/store_t300_first 1,8
    python scripts/research/drift_places.py out/t300_last.jsonl out/store_t300_last '1,8,8:recency=2.0'
    python scripts/research/drift_places.py out/tune100.jsonl out/store_tune '8,8:recency=0.5' out/tune_r8.json
    python scripts/research/drift_places.py out/tune100.jsonl out/store_tune_p 8 out/tune_r10a.json passage
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from kvboost_rag import ChunkingConfig, EngineConfig, KVBoost, RepairConfig, StoreConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import continued_logits, correct, kl, parse_strategies, render_prompt
from kvboost_rag.drift import blend
from kvboost_rag.generation import SamplingParams


def part(maps, kind: str):
    """The maps as fitted ("P"), on keys only ("Pk"), values only ("Pv"), or halfway to identity ("Ph")."""
    if kind == "h":
        return blend(maps, 0.5)
    identity = blend(maps, 0.0)
    if kind == "k":
        return dataclasses.replace(maps, values=identity.values)
    return dataclasses.replace(maps, keys=identity.keys) if kind == "v" else maps


def main() -> None:
    data, store, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    variants = {name: (name.partition(":")[0],
                       parse_strategies("cacheblend:" + name.partition(":")[2], RepairConfig())[1].repair)
                for name in names}
    items = load_items(data)
    chunking = ChunkingConfig(doc_context=sys.argv[5] if len(sys.argv) > 5 else "none")
    engine = KVBoost.from_pretrained(config=EngineConfig(chunking=chunking, store=StoreConfig(disk_dir=store)))
    engine.drift_path = None  # keep the store's own maps as they are
    pool = [d for item in items for d in item.documents]
    kinds = {v: (int(v.rstrip("kvh")), v[-1]) for v, _ in variants.values()}  # "8h" -> (8, "h")
    fitted = {p: engine.fit_drift(pool, prompts=24, places=p) for p in sorted({p for p, _ in kinds.values()})}
    maps = {v: part(fitted[p], kind) for v, (p, kind) in kinds.items()}
    params = SamplingParams(max_new_tokens=32)
    rows = []
    for item in items:
        prompt = render_prompt(item)
        with torch.inference_mode():
            full = engine.prefill(prompt, "full", max_new_tokens=32, write_back=False)
            result = list(engine.stream_from(full, params))[-1].result
            reference = continued_logits(engine, full, full.logits[None], result.token_ids)
            row = {"full": (correct(result.text, item.answers), 0.0, 0.0)}
            for name, (places, repair) in variants.items():
                engine.drift = maps[places]
                pre = engine.prefill(prompt, "cacheblend", max_new_tokens=32, write_back=False, repair=repair)
                text = list(engine.stream_from(pre, params))[-1].result.text
                per_token = kl(reference, continued_logits(engine, pre, pre.logits[None], result.token_ids))
                row[name] = (correct(text, item.answers), float(per_token[0]), float(per_token.mean()))
        rows.append(row | {"answer_doc": item.answer_doc})
        print(item.id, item.answer_doc, {k: v[0] for k, v in row.items()}, flush=True)
    if len(sys.argv) > 4 and sys.argv[4] != "-":
        Path(sys.argv[4]).write_text(json.dumps(rows))
    for k in [k for k in rows[0] if k != "answer_doc"]:
        acc, first, cont = (statistics.fmean(r[k][j] for r in rows) for j in range(3))
        print(f"{k:24s} acc {acc:.3f}  KL first {first:.4f}  cont {cont:.4f}  (n={len(rows)})")


if __name__ == "__main__":
    main()
