"""Which items `balanced` holds to `strict` for their documents' likeness, and how alike calibration's groups are.

For each data file (optionally a slice, FILE:START-END), the percentiles of its items' likeness
(kvboost_rag/likeness.py: the mean over pairs of documents of the word 4-grams two share over those either has), how
many reach the engine's threshold (EngineConfig.strict_likeness), and the same percentiles over random groups of 8
of the file's documents, what calibration fits the guard on. With --out, the items that reach it, all files
together, as one bench file: the requests the cue moves, to judge on their own. Text only, no model.

    .venv/bin/python research/alike_items.py out/mo_1237.jsonl research/data/fidelity_holdout.jsonl:24-72 \
        --out out/alike.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from kvboost_rag.config import EngineConfig
from kvboost_rag.likeness import likeness


def percentiles(values: list[float]) -> str:
    cut = statistics.quantiles(values, n=10, method="inclusive")
    return f"{cut[0]:.3f} / {statistics.median(values):.3f} / {cut[-1]:.3f} / {max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="+", help="bench files, each optionally FILE:START-END (item indices)")
    parser.add_argument("--threshold", type=float, default=EngineConfig().strict_likeness)
    parser.add_argument("--groups", type=int, default=64, help="random groups of 8 documents per file")
    parser.add_argument("--out", default=None, help="write the items at or above the threshold here")
    args = parser.parse_args()
    print("| data (items) | items' likeness p10 / p50 / p90 / max | at or above the threshold | random groups of 8 |")
    print("|---|---|---|---|")
    alike = []
    for spec in args.data:
        path, _, span = spec.partition(":")
        items = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        start, end = (int(x) for x in span.split("-")) if span else (0, len(items))
        items = items[start:end]
        scores = [likeness(item["documents"]) for item in items]
        corpus = sorted({doc for item in items for doc in item["documents"]})
        rng = random.Random(0)
        groups = [likeness(rng.sample(corpus, min(8, len(corpus)))) for _ in range(args.groups)]
        moved = [item for item, score in zip(items, scores, strict=True) if score >= args.threshold]
        alike += moved
        print(f"| {spec} ({len(items)}) | {percentiles(scores)} | {len(moved)} | {percentiles(groups)} |")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(item) + "\n" for item in alike))
        print(f"{len(alike)} items written to {args.out}")


if __name__ == "__main__":
    main()
