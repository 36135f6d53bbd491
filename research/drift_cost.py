"""Research harness (issue #6, round 4): what applying drift maps costs a request.

Times assembling item ITEM of DATA's prompt with and without the store's saved drift maps (median of 7,
interleaved; fit them first: `kvboost-rag bench ... --store STORE --fit-drift 24`): the difference is what
mapping the reused documents costs a request. Results: research/notebook.md.

    python research/drift_cost.py kvboost_rag/bench/synthetic_k8.jsonl 0 out/store_none
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


def main() -> None:
    data, index, store = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    engine = KVBoost.from_pretrained(config=EngineConfig(store=StoreConfig(disk_dir=Path(store))))
    if engine.drift is None:
        raise SystemExit(f"no drift maps in {store}: fit them first (--fit-drift)")
    item = load_items(data)[index]
    engine.ingest(list(item.documents), progress=False, calibrate=False)
    p = engine.plan(render_prompt(item), "naive")
    seconds = {"stored": [], "mapped": []}
    with torch.inference_mode():
        for _ in range(7):
            for name, maps in (("stored", None), ("mapped", engine.drift)):
                started = time.perf_counter()
                assemble(p, engine.adapter, p.num_tokens, drift=maps)
                seconds[name].append(time.perf_counter() - started)
    stored, mapped = (statistics.median(seconds[name]) * 1e3 for name in ("stored", "mapped"))
    print(f"{p.count(APPROX)} reused tokens, {engine.adapter.num_layers} layers: assembly {stored:.1f} ms, "
          f"with drift maps {mapped:.1f} ms (+{mapped - stored:.1f} ms; medians of 7)")


if __name__ == "__main__":
    main()
