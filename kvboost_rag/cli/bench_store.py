"""`kvboost-rag bench-store --data FILE.jsonl`: store bytes, disk load vs recompute, quantization quality."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import models
from ..bench.data import load_items
from ..bench.storage import run_storage_bench, table
from ..config import KV_BITS
from ..repair import names
from .common import add_engine_options, count, engine_config, flags_named, sampling_params


def bits_list(text: str) -> list[int]:
    """--bits: "16,8,4" -> [16, 8, 4], each a supported kv_bits."""
    bits = [b.strip() for b in text.split(",") if b.strip()]
    if not bits or any(b not in {str(k) for k in KV_BITS} for b in bits):
        raise argparse.ArgumentTypeError(f"must be a comma list of {', '.join(map(str, KV_BITS))}, got {text!r}")
    return [int(b) for b in bits]


def add_parser(sub) -> None:
    p = sub.add_parser("bench-store", help="measure the KV store: bytes per token, disk load against "
                                           "recompute, int8/int4 against the unquantized store")
    p.add_argument("--data", type=Path, required=True, help="bench JSONL; its documents are the corpus")
    p.add_argument("--limit", type=count(1), default=None, help="first N items")
    p.add_argument("--bits", type=bits_list, default=list(KV_BITS), help="comma list of kv_bits to measure")
    p.add_argument("--strategy", default="naive", choices=names(),
                   help="strategy whose answers are compared across stores")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    add_engine_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    # Every setting checked before the items are read or the model is loaded.
    sampling_params(max_new_tokens=args.max_new_tokens)
    config = engine_config(args)
    items = load_items(args.data, limit=args.limit)
    with flags_named():
        loaded = models.load(args.model, args.dtype, config.device)
    report = run_storage_bench(loaded, config, items, strategy=args.strategy, bits=args.bits,
                               max_new_tokens=args.max_new_tokens)
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0
