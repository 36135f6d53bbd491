"""Research harness (issue #6, round 4): what applying drift maps costs a request.

Times `drift.correct` on the reused documents of item ITEM of DATA (median of 5), against the store's saved
maps (fit them first: `kvboost-rag bench ... --store STORE --fit-drift 24`). Results: docs/quality.md.

    python scripts/research/drift_cost.py kvboost_rag/bench/synthetic_k8.jsonl 0 out/store_none
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.assembly import APPROX, assemble
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.config import StoreConfig
from kvboost_rag.drift import correct


def main() -> None:
    data, index, store = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    engine = KVBoost.from_pretrained(config=EngineConfig(store=StoreConfig(disk_dir=Path(store))))
    if engine.drift is None:
        raise SystemExit(f"no drift maps in {store}: fit them first (--fit-drift)")
    item = load_items(data)[index]
    engine.ingest(list(item.documents), progress=False)
    p = engine.plan(render_prompt(item), "naive")
    reused = p.positions(APPROX)
    seconds = []
    with torch.inference_mode():
        for _ in range(5):
            cache = assemble(p, engine.adapter, p.num_tokens)
            started = time.perf_counter()
            correct(engine.adapter, cache, reused, engine.drift)
            seconds.append(time.perf_counter() - started)
    print(f"{reused.numel()} reused tokens, {engine.adapter.num_layers} layers: "
          f"drift.correct {statistics.median(seconds) * 1e3:.1f} ms (median of 5)")


if __name__ == "__main__":
    main()
