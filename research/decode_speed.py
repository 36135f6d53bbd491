"""A lone stream's decode step and a naive / cacheblend prefill, in ms, of the checkout on PYTHONPATH.

Run it alternately against two checkouts to compare them on a noisy machine (each run prints one line per dtype
and size):

    git worktree add /tmp/before HEAD~1
    for i in 1 2; do
      PYTHONPATH=/tmp/before .venv/bin/python research/decode_speed.py; .venv/bin/python research/decode_speed.py
    done

Per dtype and prompt size (the bundled synthetic set's items 130 on, built as bench-scaling builds them): one
engine, the prompt's documents ingested and its shared prefix stored; then ROUNDS rounds of a full, a naive and a
cacheblend prefill (unguarded) and STEPS decode steps after the full one; medians of the rounds after the first.
"""

import statistics
import sys
import time

import kvboost_rag
from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt, store_shared_prefix
from kvboost_rag.bench.scaling import build_prompts, token_counter

ROUNDS, STEPS = 6, 8


def main() -> None:
    sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "1000,4000").split(",")]
    items = load_items("kvboost_rag/bench/synthetic_k8.jsonl")[130:]
    print(f"checkout: {kvboost_rag.__file__}")
    for dtype in ("bfloat16", "float32"):
        engine = KVBoost.from_pretrained(config=EngineConfig(dtype=dtype, calibrate=False,
                                                             repair=RepairConfig(fidelity="fast")))
        for sized in build_prompts(items, sizes, 1, token_counter(engine)):
            engine.ingest(list(sized.item.documents), progress=False, calibrate=False)
            store_shared_prefix(engine, sized.item)
            prompt = render_prompt(sized.item)
            times: dict[str, list[float]] = {"full": [], "naive": [], "cacheblend": [], "decode step": []}
            for round_ in range(ROUNDS + 1):
                for strategy in ("naive", "cacheblend"):
                    ms = engine.prefill(prompt, strategy, write_back=False).ttft_ms
                    if round_:
                        times[strategy].append(ms)
                pre = engine.prefill(prompt, "full", write_back=False, max_new_tokens=STEPS)
                started = time.perf_counter()
                for step in range(STEPS):
                    engine.decode_step(pre.cache, 42, pre.prompt_tokens + step)
                if round_:
                    times["full"].append(pre.ttft_ms)
                    times["decode step"].append((time.perf_counter() - started) / STEPS * 1e3)
            print(f"{dtype} {sized.tokens} tokens: " + ", ".join(f"{key} {statistics.median(ms):.1f}"
                                                                  for key, ms in times.items()))


if __name__ == "__main__":
    main()
