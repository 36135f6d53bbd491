"""`kvboost-rag ingest PATH... [--store DIR]`: precompute and store the KV of documents."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..drift import PLACES
from .common import add_engine_options, count, engine_config, make_engine, read_documents


def add_parser(sub) -> None:
    p = sub.add_parser("ingest", help="precompute and store document KV (one document per text file)")
    p.add_argument("paths", nargs="+", type=Path, help="text files or folders of them")
    p.add_argument("--pin", action="store_true", help="never evict these documents from memory")
    p.add_argument("--fit-drift", type=count(0), default=0, metavar="PROMPTS",
                   help="then fit drift maps on this many prompts of the stored documents (about one full "
                        "prefill each; saved in --store, used by cacheblend from then on); 0 = no")
    p.add_argument("--drift-places", type=count(1), default=PLACES, metavar="N",
                   help="drift maps for each of a prompt's first N documents (the last serves every later "
                        "one); about the number of documents your retriever returns")
    p.add_argument("--ray-workers", type=count(0), default=0, metavar="N",
                   help="compute the KV on N Ray actors writing to --store (needs the ray extra: "
                        "pip install 'kvboost-rag[ray]'), then check it here; 0 = in this process")
    add_engine_options(p, repair=False)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.fit_drift and not args.store:
        raise ValueError("--fit-drift needs --store: the maps are saved next to the stored documents")
    if args.ray_workers and not args.store:
        raise ValueError("--ray-workers needs --store: the workers' KV is shared with this process through it")
    config = engine_config(args)  # checked before the documents are read or the model is loaded
    docs = read_documents(args.paths)
    if args.ray_workers:
        _ingest_with_ray(args, config, [text for _, text in docs])
    engine = make_engine(args, config)
    try:
        return _run(args, engine, docs)
    finally:
        engine.close()


def _ingest_with_ray(args, config, texts) -> None:
    from ..distributed import ingest_with_ray

    started = time.perf_counter()
    try:
        ids = ingest_with_ray(texts, model=args.model, config=config, workers=args.ray_workers, progress=True)
    except ImportError as e:
        if e.name != "ray":
            raise
        raise ValueError(f"--ray-workers: {e}") from None
    print(f"ray: documents {len(ids)} ingested on {args.ray_workers} workers in "
          f"{time.perf_counter() - started:.1f}s; now checked here (and calibrated when due):")


def _run(args, engine, docs) -> int:
    started = time.perf_counter()
    ids = engine.ingest([text for _, text in docs], pin=args.pin, progress=True)
    seconds = time.perf_counter() - started
    tokens = sum(len(engine.document(text).token_ids) for _, text in docs)
    nbytes = getattr(engine.store, "nbytes", None)
    c = engine.counters
    print(f"documents {len(ids)} (computed {c['documents_computed']}, already stored {c['documents_stored']})  "
          f"tokens {tokens}  "
          + (f"bytes {nbytes:,}  " if nbytes is not None else "")
          + f"seconds {seconds:.1f}" + (f"  store {args.store}" if args.store else ""))
    if args.fit_drift:
        started = time.perf_counter()
        maps = engine.fit_drift(prompts=args.fit_drift, places=args.drift_places)
        print(f"drift maps ({maps.places} places) fitted on {maps.prompts} prompts in "
              f"{time.perf_counter() - started:.1f}s: "
              f"{engine.drift_path}")
    return 0
