"""Rebuild the benchmark files bundled with the package (`kvboost_rag/bench/*.jsonl`) from their generators.

    .venv/bin/python research/datasets/shipped.py                     # rewrites kvboost_rag/bench/*.jsonl
    .venv/bin/python research/datasets/shipped.py --out-dir /tmp/sets  # writes them elsewhere, to compare

The output is byte for byte the bundled files (tests/unit/test_datasets.py checks the synthetic ones). The
pydoc set is cut from the running Python's documentation; the bundled one came from CPython 3.11.7, and
another Python may write a different file.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

from pydoc_set import pydoc_items
from synthetic_set import synthetic_items

from kvboost_rag.bench.data import BENCH_DIR, write_items

# name -> (generator, n, k, words per document, seed)
SHIPPED = {
    "synthetic_k8": ("synthetic", 432, 8, 150, 0),
    "synthetic_calib": ("synthetic", 50, 8, 150, 1000),
    "pydoc_k8": ("pydoc", 60, 8, 150, 0),
    "tiny": ("synthetic", 3, 3, 40, 0),
}
PYDOC_PYTHON = "3.11.7"  # the Python whose docs the bundled pydoc set was cut from


def generate(kind: str, n: int, k_docs: int, words_per_doc: int, seed: int) -> list[dict]:
    if kind == "synthetic":
        return synthetic_items(n, k_docs, words_per_doc, seed)
    if kind == "pydoc":
        return pydoc_items(n, k_docs, words_per_doc, seed)
    raise ValueError(f"unknown generator {kind!r}; expected 'synthetic' or 'pydoc'")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=BENCH_DIR, help="default: the package's bench folder")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"files to write (default: all of {', '.join(SHIPPED)})")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.names) - set(SHIPPED)):
        parser.error(f"unknown file(s) {unknown}; bundled: {', '.join(SHIPPED)}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.names or SHIPPED:
        kind, n, k, words, seed = SHIPPED[name]
        path = args.out_dir / f"{name}.jsonl"
        write_items(generate(kind, n, k, words, seed), path)
        print(f"wrote {path} ({n} items)", file=sys.stderr)
        if kind == "pydoc" and platform.python_version() != PYDOC_PYTHON:
            print(f"  cut from Python {platform.python_version()}'s docs; the bundled file is from "
                  f"{PYDOC_PYTHON}'s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
