"""Ingestion throughput: one process against Ray actors writing to one shared store, on the same corpus.

Takes --documents distinct documents of the bundled sets, ingests them into a fresh store folder in this
process (`KVBoost.ingest`, calibration off: it is the caller's, once, either way), then into another fresh
folder with `ingest_with_ray` on --workers actors (local Ray, 127.0.0.1), and prints document tokens/s for
both, with the check that the caller then finds every Ray-written document stored (computing nothing).

    .venv/bin/python research/ray_ingest.py --documents 500 --workers 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from kvboost_rag import EngineConfig, KVBoost, StoreConfig
from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.distributed import ingest_with_ray


def corpus(n: int) -> list[str]:
    seen: dict[str, None] = {}
    for name in ("synthetic_k8", "synthetic_calib"):
        for item in load_items(bundled(name)):
            for text in item.documents:
                seen.setdefault(text, None)
    texts = list(seen)
    if len(texts) < n:
        raise SystemExit(f"the bundled sets hold {len(texts)} distinct documents, fewer than --documents {n}")
    return texts[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    texts = corpus(args.documents)
    # A single-machine Ray on 127.0.0.1 only (as tests/unit/test_distributed.py starts it).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    ray.init(num_cpus=args.workers, include_dashboard=False, address="local", _node_ip_address="127.0.0.1")
    with tempfile.TemporaryDirectory() as single_dir, tempfile.TemporaryDirectory() as ray_dir:
        single = KVBoost.from_pretrained(config=EngineConfig(dtype=args.dtype, calibrate=False,
                                                             store=StoreConfig(disk_dir=single_dir)))
        tokens = sum(len(single.document(t).token_ids) for t in texts)
        started = time.perf_counter()
        single.ingest(texts, progress=True)
        single_s = time.perf_counter() - started

        config = EngineConfig(dtype=args.dtype, calibrate=False, store=StoreConfig(disk_dir=ray_dir))
        started = time.perf_counter()
        ingest_with_ray(texts, dtype=args.dtype, config=config, workers=args.workers)
        ray_s = time.perf_counter() - started  # actors' start-up (Ray, model loads) included
        caller = KVBoost.from_pretrained(config=config)
        caller.ingest(texts, progress=False)
        found = caller.counters["documents_stored"]
    ray.shutdown()
    print(f"{len(texts)} documents, {tokens} tokens, {args.dtype}, CPU")
    print("| path | seconds | document tokens/s |\n|---|---|---|")
    print(f"| one process | {single_s:.1f} | {tokens / single_s:.0f} |")
    print(f"| Ray, {args.workers} actors (start-up included) | {ray_s:.1f} | {tokens / ray_s:.0f} |")
    print(f"caller found {found} of {len(texts)} documents stored by the actors, computed "
          f"{caller.counters['documents_computed']}")


if __name__ == "__main__":
    main()
