"""Research harness (issue #6): `queryaware` with qa_order="relevance_last" against a full prefill of the
same reordered prompt (the fair reference for a strategy that changes the prompt).

    python scripts/research/reorder_eval.py kvboost_rag/bench/synthetic_k8.jsonl 16 none out/store out/reorder.json
    python scripts/research/reorder_eval.py kvboost_rag/bench/synthetic_calib.jsonl 24:40 none out/store_calib_none \
        out/reorder_tune.json recompute_ratio=0.0

ITEMS is a count from the start or START:END; the optional last argument overrides repair settings.
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import correct, kl, render_prompt
from kvboost_rag.config import ChunkingConfig, RepairConfig, StoreConfig
from kvboost_rag.generation import SamplingParams

TOKENS = 16


def main() -> None:
    data, items, doc_context, store, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    start, _, end = items.rpartition(":")
    overrides = dict(kv.split("=") for kv in sys.argv[6].split("+")) if len(sys.argv) > 6 else {}
    config = EngineConfig(chunking=ChunkingConfig(doc_context=doc_context), store=StoreConfig(disk_dir=Path(store)))
    engine = KVBoost.from_pretrained(config=config)
    repair = RepairConfig(qa_order="relevance_last")
    repair = dataclasses.replace(repair, **{k: type(getattr(repair, k))(v) for k, v in overrides.items()})
    rows = []
    for item in load_items(data)[int(start or 0):int(end)]:
        engine.ingest(list(item.documents), progress=False)
        with torch.inference_mode():
            reordered = engine.prefill(render_prompt(item), "queryaware", max_new_tokens=TOKENS, write_back=False,
                                       repair=repair)
            runs = {"ref": engine.reference_prefill(reordered.plan, max_new_tokens=TOKENS), "qa": reordered}
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

        def accuracy(result, item=item):
            return correct(result.text, item.answers) if item.answers else None

        rows.append({"id": item.id, "acc_ref": accuracy(outputs["ref"]), "acc_qa": accuracy(outputs["qa"]),
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
