"""`kvboost-rag` command line: one module per subcommand, each with add_parser() and main()."""

from __future__ import annotations

import argparse
import sys

from . import ask, bench, bench_scaling, bench_store, ingest, serve, store


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvboost-rag", description="Answer sooner in RAG on a local HuggingFace model: document KV computed "
        "once at ingestion, reused in any order, repaired where it matters, guarded to stay a full prefill's answer.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (ingest, ask, bench, bench_scaling, bench_store, store, serve):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"kvboost-rag: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
