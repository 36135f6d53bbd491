"""`kvboost-rag bench-store --data FILE.jsonl`: store bytes, disk load vs recompute, quantization quality."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import models
from ..bench.data import load_items
from ..bench.storage import run_storage_bench, table
from .common import add_engine_options, engine_config


def add_parser(sub) -> None:
    p = sub.add_parser("bench-store", help="measure the KV store: bytes per token, disk load against "
                                           "recompute, int8/int4 against the unquantized store")
    p.add_argument("--data", type=Path, required=True, help="bench JSONL; its documents are the corpus")
    p.add_argument("--limit", type=int, default=None, help="first N items")
    p.add_argument("--bits", default="16,8,4", help="comma list of kv_bits to measure")
    p.add_argument("--strategy", default="naive", help="strategy whose answers are compared across stores")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    add_engine_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    items = load_items(args.data, limit=args.limit)
    loaded = models.load(args.model, args.dtype)
    bits = [int(b) for b in args.bits.split(",")]
    report = run_storage_bench(loaded, engine_config(args), items, strategy=args.strategy, bits=bits,
                               max_new_tokens=args.max_new_tokens)
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0
