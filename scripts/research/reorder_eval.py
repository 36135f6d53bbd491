"""Research harness (issue #6): `queryaware` with qa_order="relevance_last" against a full prefill of the
same reordered prompt (the fair reference for a strategy that changes the prompt).

    python scripts/research/reorder_eval.py kvboost_rag/bench/synthetic_k8.jsonl 16 none out/store out/reorder.json
"""

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import kl, render_prompt
from kvboost_rag.config import ChunkingConfig, RepairConfig, StoreConfig
from kvboost_rag.engine import Prefill
from kvboost_rag.generation import SamplingParams

TOKENS = 16


def full_of(engine: KVBoost, plan) -> Prefill:
    """A full prefill of exactly the tokens of `plan` (the reordered prompt)."""
    ids, n = plan.token_ids, plan.num_tokens
    started = time.perf_counter()
    cache = engine.adapter.new_buffers(n + TOKENS)
    hidden = engine.adapter.run_layers(engine.adapter.embed(ids), torch.arange(n), cache,
                                       range(engine.adapter.num_layers), n)
    return Prefill(plan, cache, engine.adapter.logits(hidden[:, -1:])[-1], n, "full-reordered", started, 0.0)


def main() -> None:
    data, count, doc_context, store, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    overrides = dict(kv.split("=") for kv in sys.argv[6].split("+")) if len(sys.argv) > 6 else {}
    config = EngineConfig(chunking=ChunkingConfig(doc_context=doc_context), store=StoreConfig(disk_dir=Path(store)))
    engine = KVBoost.from_pretrained(config=config)
    repair = RepairConfig(qa_order="relevance_last")
    repair = dataclasses.replace(repair, **{k: type(getattr(repair, k))(v) for k, v in overrides.items()})
    rows = []
    for item in load_items(data, limit=count):
        engine.ingest(list(item.documents), progress=False)
        with torch.inference_mode():
            reordered = engine.prefill(render_prompt(item), "queryaware", max_new_tokens=TOKENS, write_back=False,
                                       repair=repair)
            runs = {"ref": full_of(engine, reordered.plan), "qa": reordered}
            outputs = {name: list(engine.stream_from(pre, SamplingParams(TOKENS)))[-1].result
                       for name, pre in runs.items()}
            greedy = list(outputs["ref"].token_ids)
            dists = {}
            for name, pre in runs.items():
                dist = pre.logits[None]
                if len(greedy) > 1:
                    dist = torch.cat([dist, engine.continuation_logits(pre, greedy[:-1])])
                dists[name] = dist
        per_token = kl(dists["ref"], dists["qa"][: len(dists["ref"])])

        def correct(result, item=item):
            return float(any(a.lower() in result.text.lower() for a in item.answers)) if item.answers else None

        rows.append({"id": item.id, "acc_ref": correct(outputs["ref"]), "acc_qa": correct(outputs["qa"]),
                     "first_kl": float(per_token[0]), "cont_kl": float(per_token.mean()),
                     "recompute": reordered.recomputed_tokens / reordered.prompt_tokens,
                     "agree": float(outputs["ref"].token_ids == outputs["qa"].token_ids)})
        print(rows[-1], flush=True)
    keys = [k for k in rows[0] if k != "id" and rows[0][k] is not None]
    summary = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    print(summary)
    Path(out).write_text(json.dumps({"summary": summary, "per_item": rows, "overrides": overrides, "data": data,
                                     "doc_context": doc_context}, indent=1))


if __name__ == "__main__":
    main()
