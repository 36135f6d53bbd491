"""Research check: ingestion throughput (document tokens/s) of the kvboost_rag first on sys.path, on 72 documents
of the bundled set after an 8-document warm-up, no store. Compare two commits by alternating runs, a checkout each:

    git worktree add /tmp/before 92c0359
    for src in /tmp/before . /tmp/before .; do PYTHONPATH=$src .venv/bin/python research/ingest_speed.py bfloat16; done

INGEST_BATCH_TOKENS=1 measures one document per forward (EngineConfig.ingest_batch_tokens, where it exists).
"""

import inspect
import json
import os
import sys
import time

import kvboost_rag
from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.bench.data import bundled, load_items


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    docs = [d for item in load_items(bundled("synthetic_k8.jsonl"))[:10] for d in item.documents]
    quiet = {"calibrate": False} if "calibrate" in inspect.signature(KVBoost.ingest).parameters else {}
    batch = os.environ.get("INGEST_BATCH_TOKENS")
    config = EngineConfig(dtype=dtype, **({"ingest_batch_tokens": int(batch)} if batch else {}))
    engine = KVBoost.from_pretrained(config=config)
    engine.ingest(docs[:8], progress=False, **quiet)  # warm-up
    tokens = sum(len(engine.document(d).token_ids) for d in docs[8:])
    started = time.perf_counter()
    engine.ingest(docs[8:], progress=False, **quiet)
    seconds = time.perf_counter() - started
    print(json.dumps({"package": kvboost_rag.__file__, "dtype": dtype, "documents": len(docs) - 8, "tokens": tokens,
                      "document_tokens_per_s": round(tokens / seconds)}))


if __name__ == "__main__":
    main()
