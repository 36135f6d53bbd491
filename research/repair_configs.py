"""Research harness (issue #6): the shipped cacheblend under other settings and deviation measures.

For bench items START..END, every variant prefills the same prompt; reported: continuation KL (first token
and 16 teacher-forced tokens of full's greedy output) and first-token KL to a full prefill, the recompute
fraction and the TTFT. Variants that swap the deviation measure patch `cacheblend.kv_deviation` for the
run (the shipped measure is the squared L2 of K plus V), the "shape" ones `cacheblend.layer_fractions`
(the per-layer schedule). Results: research/notebook.md.

    python research/repair_configs.py 24 40 out/configs.json kvboost_rag/bench/synthetic_calib.jsonl \
        out/store_calib naive,default,taper4,taper16,devV,devnorm,devrel,check2,rec0.75
"""

import dataclasses
import sys
from pathlib import Path

import torch
from scoring import full_reference, score, summarize

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.config import StoreConfig
from kvboost_rag.repair import cacheblend

SHIPPED = cacheblend.kv_deviation
SCHEDULE = cacheblend.layer_fractions


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


def shaped(power: float):
    """layer_fractions with a decay of taper ** (-(j / (layers - 1)) ** power): power > 1 keeps the set
    large for longer (more of the budget in the middle layers), < 1 drops it sooner."""
    def fractions(average: float, taper: float, layers: int) -> list[float]:
        if layers <= 1 or average >= 1.0 or average <= 0.0:
            return SCHEDULE(average, taper, layers)
        decay = [taper ** (-((j / (layers - 1)) ** power)) for j in range(layers)]
        low, high = 0.0, 1.0 / decay[-1]
        for _ in range(60):
            mid = (low + high) / 2
            mean = sum(min(1.0, mid * d) for d in decay) / layers
            low, high = (mid, high) if mean < average else (low, mid)
        return [min(1.0, high * d) for d in decay]
    return fractions


R = RepairConfig(drift=False, fidelity="fast")  # the measurements of rounds 2-3 predate drift correction
SCHEDULES = {"shape2": shaped(2.0), "shape3": shaped(3.0), "shape0.5": shaped(0.5), "shape2t16": shaped(2.0)}
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
    "sm0": (dataclasses.replace(R, size_multiple=0), SHIPPED),
    "sm16": (dataclasses.replace(R, size_multiple=16), SHIPPED),
    "sm32": (dataclasses.replace(R, size_multiple=32), SHIPPED),
    "sm64": (dataclasses.replace(R, size_multiple=64), SHIPPED),
    "shape2": (R, SHIPPED),
    "shape3": (R, SHIPPED),
    "shape0.5": (R, SHIPPED),
    "shape2t16": (dataclasses.replace(R, taper=16.0), SHIPPED),
}


def main() -> None:
    start, end, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    data, store, names = sys.argv[4], sys.argv[5], sys.argv[6].split(",")
    engine = KVBoost.from_pretrained(config=EngineConfig(store=StoreConfig(disk_dir=Path(store)),
                                                         repair=RepairConfig(fidelity="fast")))
    tokens = 16
    rows = []
    for item in load_items(data)[start:end]:
        engine.ingest(list(item.documents), progress=False, calibrate=False)
        prompt = render_prompt(item)
        with torch.inference_mode():
            reference, distributions = full_reference(engine, prompt, tokens, room=tokens)
            row = {"id": item.id}
            for name in names:
                if VARIANTS[name] is None:
                    pre = engine.prefill(prompt, "naive", max_new_tokens=tokens, write_back=False)
                else:
                    repair, deviation = VARIANTS[name]
                    cacheblend.kv_deviation = deviation
                    cacheblend.layer_fractions = SCHEDULES.get(name, SCHEDULE)
                    try:
                        pre = engine.prefill(prompt, "cacheblend", max_new_tokens=tokens, write_back=False,
                                             repair=repair)
                    finally:
                        cacheblend.kv_deviation, cacheblend.layer_fractions = SHIPPED, SCHEDULE
                row[name] = score(reference, distributions, pre)
        rows.append(row)
        print(item.id, {name: round(row[name]["cont"], 3) for name in names}, flush=True)
    summarize(rows, names, ("first", "cont", "rec", "ms"), out)


if __name__ == "__main__":
    main()
