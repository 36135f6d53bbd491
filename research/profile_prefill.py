"""Research harness (issue #6, round 6): where a strategy's prefill spends its time.

Times `full`, `cacheblend` and `naive` on item ITEM of DATA (medians of 5, interleaved, after two warm-up
rounds), then profiles three cacheblend prefills with torch.profiler and prints the ops by self CPU time.
STORE holds the item's documents and the drift maps (`kvboost-rag bench ... --store STORE --fit-drift 24`).
Results: research/notebook.md.

    python research/profile_prefill.py kvboost_rag/bench/synthetic_k8.jsonl 130 out/store_t300_0
"""

import statistics
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.config import StoreConfig

STRATEGIES = ("full", "cacheblend", "naive")


def main() -> None:
    data, index, store = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    config = EngineConfig(dtype="float32", store=StoreConfig(disk_dir=Path(store)),
                          repair=RepairConfig(fidelity="fast"))
    engine = KVBoost.from_pretrained(config=config)
    item = load_items(data)[index]
    engine.ingest(list(item.documents), progress=False, calibrate=False)
    prompt = render_prompt(item)
    ttft = {strategy: [] for strategy in STRATEGIES}
    for round_ in range(7):
        for strategy in STRATEGIES:
            ms = engine.prefill(prompt, strategy, write_back=False).ttft_ms
            if round_ >= 2:  # the first two rounds warm up
                ttft[strategy].append(ms)
    print("TTFT ms:", {strategy: round(statistics.median(ms), 1) for strategy, ms in ttft.items()})
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.prefill(prompt, "cacheblend", write_back=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
