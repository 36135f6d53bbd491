"""`kvboost-rag bench-scaling`: how TTFT grows with the prompt, each strategy against a full prefill, side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import models
from ..bench.data import load_items
from ..bench.report import scaling_table, write_scaling
from ..bench.scaling import DEFAULT_SIZES, DEFAULT_STRATEGIES, run_scaling
from .bench import checked_settings
from .common import add_engine_options, count, make_engine

BUNDLED_SET = Path(__file__).resolve().parents[1] / "bench" / "synthetic_k8.jsonl"
MIN_SIZE = 16


def sizes_list(text: str) -> list[int]:
    """--sizes: "1000,2000" -> [1000, 2000], each a prompt size of at least MIN_SIZE tokens."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or any(not p.isdigit() or int(p) < MIN_SIZE for p in parts):
        raise argparse.ArgumentTypeError(f"must be a comma list of prompt sizes in tokens, each >= {MIN_SIZE}, "
                                         f"got {text!r}")
    return sorted(set(map(int, parts)))


def add_parser(sub) -> None:
    p = sub.add_parser("bench-scaling", help="how TTFT grows with the prompt: each strategy against a full "
                                             "prefill at several prompt sizes (JSON, Markdown table, plot)")
    p.add_argument("--data", type=Path, default=BUNDLED_SET,
                   help="bench JSONL the prompts are built from (default: the bundled synthetic_k8.jsonl)")
    p.add_argument("--sizes", type=sizes_list, default=list(DEFAULT_SIZES),
                   help=f"comma list of prompt sizes in tokens (default {','.join(map(str, DEFAULT_SIZES))}); "
                        "those past the model's context window are reported as refused")
    p.add_argument("--limit", type=count(1), default=3, help="prompts per size (default 3)")
    p.add_argument("--skip", type=count(0), default=0, help="skip the set's first N items")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma list, as bench's --strategies (default {DEFAULT_STRATEGIES})")
    p.add_argument("--max-new-tokens", type=count(1), default=8,
                   help="tokens generated per run, for the agreement with full's answer (default 8)")
    p.add_argument("--out", type=Path, default=Path("out/scaling"),
                   help="folder for scaling.json, scaling.md and scaling.png (default out/scaling)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (matplotlib: the bench extra)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (a log file keeps the table only)")
    add_engine_options(p)
    # Unset: the dtype a deployment would time (models.fastest_dtype: bfloat16 where the device has it in
    # hardware, float32 on a CPU without bf16 instructions).
    p.set_defaults(dtype=None, func=main)


def main(args: argparse.Namespace) -> int:
    if args.dtype is None:
        args.dtype = models.fastest_dtype(models.resolve_device(args.device))
        print(f"timing in {args.dtype} (models.fastest_dtype on this machine; --dtype to choose)", flush=True)
    config, specs = checked_settings(args)
    items = load_items(args.data)[args.skip:]
    if not items:
        raise ValueError(f"--skip {args.skip} leaves no item of {args.data}")
    engine = make_engine(args, config)
    report = run_scaling(engine, items, specs, sizes=args.sizes, per_size=args.limit,
                         max_new_tokens=args.max_new_tokens, progress=not args.quiet,
                         log=lambda line: print(line, flush=True))
    report["command_args"] = {k: str(v) for k, v in vars(args).items() if k != "func"}
    print(scaling_table(report))
    for path in write_scaling(report, args.out, plot=not args.no_plot):
        print(f"wrote {path}")
    return 0
