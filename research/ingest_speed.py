"""Research check: ingestion throughput (document tokens/s) in fp32 and bf16 on 44 documents of the bundled set,
after a 4-document warm-up, no store. Run it on two commits to compare them.

    .venv/bin/python research/ingest_speed.py
"""

import time

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.bench.data import bundled, load_items


def main() -> None:
    docs = [d for item in load_items(bundled("synthetic_k8.jsonl"))[:6] for d in item.documents]
    for dtype in ("float32", "bfloat16"):
        engine = KVBoost.from_pretrained(config=EngineConfig(dtype=dtype))
        engine.ingest(docs[:4], progress=False, calibrate=False)  # warm-up
        tokens = sum(len(engine.document(d).token_ids) for d in docs[4:])
        started = time.perf_counter()
        engine.ingest(docs[4:], progress=False, calibrate=False)
        dt = time.perf_counter() - started
        print(f"{dtype}: {len(docs) - 4} documents, {tokens} tokens, {tokens / dt:.0f} document tokens/s")


if __name__ == "__main__":
    main()
