"""Research harness (issue #6): the shipped cacheblend under other settings and deviation measures.

For bench items START..END, every variant prefills the same prompt; reported: continuation KL (first token
and 16 teacher-forced tokens of full's greedy output) and first-token KL to a full prefill, the recompute
fraction and the TTFT. Variants that swap the deviation measure patch `cacheblend.kv_deviation` for the
run (the shipped measure is the squared L2 of K plus V). Results: docs/quality.md.

    python scripts/research/repair_configs.py 24 40 out/configs.json kvboost_rag/bench/synthetic_calib.jsonl \
        out/store_calib naive,default,taper4,taper16,devV,devnorm,devrel,check2,rec0.75
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import kl, render_prompt
from kvboost_rag.config import StoreConfig
from kvboost_rag.generation import SamplingParams
from kvboost_rag.repair import cacheblend

SHIPPED = cacheblend.kv_deviation


def squared(fresh, cached, which):
    return (fresh[which].float() - cached[which].float()).pow(2).sum(dim=(0, 1, 3))


def values_only(fresh, cached):
    return squared(fresh, cached, 1)


def normalized(fresh, cached):  # K and V each over their mean over the set
    dk, dv = squared(fresh, cached, 0), squared(fresh, cached, 1)
    return dk / dk.mean() + dv / dv.mean()


def relative(fresh, cached):  # each token's change over its own cached norm
    norm = [cached[i].float().pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-6) for i in (0, 1)]
    return squared(fresh, cached, 0) / norm[0] + squared(fresh, cached, 1) / norm[1]


R = RepairConfig()
VARIANTS = {
    "naive": None,
    "default": (R, SHIPPED),
    "old": (dataclasses.replace(R, taper=1.0, recency=0.0), SHIPPED),
    "taper4": (dataclasses.replace(R, taper=4.0), SHIPPED),
    "taper16": (dataclasses.replace(R, taper=16.0), SHIPPED),
    "devV": (R, values_only),
    "devnorm": (R, normalized),
    "devrel": (R, relative),
    "check2": (dataclasses.replace(R, check_layer=2), SHIPPED),
    "rec0.75": (dataclasses.replace(R, recency=0.75), SHIPPED),
}


def main() -> None:
    start, end, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    data, store, names = sys.argv[4], sys.argv[5], sys.argv[6].split(",")
    engine = KVBoost.from_pretrained(config=EngineConfig(store=StoreConfig(disk_dir=Path(store))))
    tokens = 16
    rows = []
    for item in load_items(data)[start:end]:
        engine.ingest(list(item.documents), progress=False)
        prompt = render_prompt(item)
        with torch.inference_mode():
            full = engine.prefill(prompt, "full", max_new_tokens=tokens, write_back=False)
            greedy = list(list(engine.stream_from(full, SamplingParams(tokens)))[-1].result.token_ids)

            def distributions(pre, greedy=greedy):
                first = pre.logits[None]
                if len(greedy) < 2:
                    return first
                return torch.cat([first, engine.continuation_logits(pre, greedy[:-1])])

            reference = distributions(engine.prefill(prompt, "full", max_new_tokens=tokens, write_back=False))
            row = {"id": item.id}
            for name in names:
                if VARIANTS[name] is None:
                    pre = engine.prefill(prompt, "naive", max_new_tokens=tokens, write_back=False)
                else:
                    repair, deviation = VARIANTS[name]
                    cacheblend.kv_deviation = deviation
                    try:
                        pre = engine.prefill(prompt, "cacheblend", max_new_tokens=tokens, write_back=False,
                                             repair=repair)
                    finally:
                        cacheblend.kv_deviation = SHIPPED
                per_token = kl(reference, distributions(pre)[: len(reference)])
                row[name] = {"first": float(per_token[0]), "cont": float(per_token.mean()),
                             "rec": pre.recomputed_tokens / pre.prompt_tokens, "ms": pre.ttft_ms}
        rows.append(row)
        print(item.id, {name: round(row[name]["cont"], 3) for name in names}, flush=True)
    summary = {name: {k: statistics.fmean(r[name][k] for r in rows) for k in ("first", "cont", "rec", "ms")}
               for name in names}
    for name, s in summary.items():
        ratio = s["cont"] / summary["naive"]["cont"] if "naive" in summary else float("nan")
        print(f"{name:10s} cont {s['cont']:.4f} ({ratio:.2f} naive) first {s['first']:.4f} rec {s['rec']:.3f} "
              f"ms {s['ms']:.0f}")
    Path(out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
