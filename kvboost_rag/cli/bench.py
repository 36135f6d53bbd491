"""`kvboost-rag bench --data FILE.jsonl`: TTFT and quality of every strategy against a full prefill."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ..bench.data import in_orders, load_items
from ..bench.report import plot, table
from ..bench.run import StrategySpec, parse_strategies, run_bench
from ..config import DTYPE_NAMES, ConfigError, EngineConfig, StoreConfig
from ..prompts import LAYOUTS
from .common import add_engine_options, count, engine_config, make_engine, sampling_params


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark strategies against a full prefill (TTFT, accuracy, KL)")
    p.add_argument("--data", type=Path, required=True, help="JSONL: {id, system?, documents, question, answers?}")
    p.add_argument("--strategies", default="full,prefix,naive,selective,cacheblend",
                   help="comma list; a strategy may carry repair overrides joined by '+', "
                        "e.g. 'cacheblend:recompute_ratio=0.3+taper=1'")
    p.add_argument("--limit", type=count(1), default=None, help="N items (after --skip)")
    p.add_argument("--skip", type=count(0), default=0, help="skip the first N items (a tuning slice, say)")
    p.add_argument("--orders", type=count(1), default=1,
                   help="ask each item over its documents in N orders: the file's, then seeded shuffles, each "
                        "scored as an item of its own (a retriever returns documents in any order)")
    # 32: the bundled model often restates the question before the answer; 16 cuts answers off.
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--layout", default="bench", choices=tuple(LAYOUTS),
                   help="how the prompt lays out the documents: the bench's, LangChain's, LlamaIndex's, in tags")
    p.add_argument("--fit-drift", type=count(0), default=0, metavar="PROMPTS",
                   help="fit drift maps on this many prompts of the ingested documents before measuring "
                        "(untimed; with --store they are saved there and found by later runs); 0 = no")
    p.add_argument("--noise-floor", default="auto", choices=("auto", "none", *DTYPE_NAMES),
                   help="one more row: a full prefill of the same model in this dtype, scored as the strategies "
                        "are (auto: bfloat16 for a float32 bench, else float32; none: no such row)")
    p.add_argument("--order-floor", default="on", choices=("on", "off"),
                   help="one more row: a full prefill of the same documents in reverse order, scored as the "
                        "strategies are (the order floor: how often another retrieval order changes the answer)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--plot", type=Path, default=None, help="PNG: speed-up vs continuation KL and accuracy")
    add_engine_options(p)
    p.set_defaults(func=main)


def checked_settings(args: argparse.Namespace) -> tuple[EngineConfig, list[StrategySpec]]:
    """The engine config and the strategy specs the options give, every setting checked before the items are read
    or the model is loaded (bench and bench-scaling alike)."""
    sampling_params(max_new_tokens=args.max_new_tokens)
    config = engine_config(args)
    try:
        return config, parse_strategies(args.strategies, config.repair)
    except ConfigError as e:
        raise ConfigError(e.field, f"argument --strategies: {e}") from None


def main(args: argparse.Namespace) -> int:
    config, specs = checked_settings(args)
    items = load_items(args.data, limit=None if args.limit is None else args.skip + args.limit)[args.skip:]
    items = in_orders(items, args.orders)
    engine = make_engine(args, config)
    floor_dtype = {"auto": "bfloat16" if config.dtype == "float32" else "float32"}.get(args.noise_floor,
                                                                                      args.noise_floor)
    floor = None
    if floor_dtype not in ("none", config.dtype):
        # The same model in another dtype, bare: it only runs full prefills (no store, no calibration), and decodes a
        # token a forward: draft tokens (lookahead.py) round unlike one in bf16 (4 of fidelity_holdout's 24 answers
        # moved), and the floor is what the dtype changes, measured as it always was.
        floor = make_engine(args, dataclasses.replace(config, dtype=floor_dtype, calibrate=False,
                                                      store=StoreConfig(), lookahead=0))
    report = run_bench(engine, items, specs, max_new_tokens=args.max_new_tokens, drift_prompts=args.fit_drift,
                       floor=floor, layout=args.layout, order_floor=args.order_floor == "on")
    report["command_args"] = {k: str(v) for k, v in vars(args).items() if k != "func"}
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, str(args.plot))
    return 0
