"""Do the reused cache's lost answers sit where an item's documents look alike? (issue 41, item 2)

For each item of a bench run, how alike its documents are: the word 4-grams two documents share over those either
has (Jaccard), averaged over the item's pairs (and the largest pair). The items are split at the median of the mean
(or at --threshold) and each half's lost / won against `full` counted for one strategy. Text only, no model: a
second or two a run.

    .venv/bin/python research/doc_similarity.py research/data/multidoc_other.jsonl=out/g65/mo_passage.json \
        research/data/man_pages.jsonl=out/g65/mp_passage.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

from kvboost_rag.likeness import word_grams


def likeness(documents: list[str]) -> tuple[float, float]:
    """(mean, largest) Jaccard of word 4-grams over the pairs of documents (the mean is likeness.likeness, the
    guard's cue, computed from the same pairs)."""
    grams = [word_grams(d) for d in documents]
    pairs = [len(a & b) / max(len(a | b), 1) for a, b in itertools.combinations(grams, 2)]
    return (statistics.fmean(pairs), max(pairs)) if pairs else (0.0, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="DATA.jsonl=BENCH.json: a data file and a bench run over it")
    parser.add_argument("--strategy", default="cacheblend")
    parser.add_argument("--threshold", type=float, default=None,
                        help="split the items at this mean likeness (strict_likeness) instead of the median")
    args = parser.parse_args()
    print("| data | half | mean Jaccard | largest pair | lost / won vs full |")
    print("|---|---|---|---|---|")
    for pair in args.runs:
        data, run = pair.split("=", 1)
        documents = {}
        for line in Path(data).read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                documents[item["id"]] = item["documents"]
        rows = []
        for item in json.loads(Path(run).read_text())["per_item"]:
            full, other = item["full"]["accuracy"], item[args.strategy]["accuracy"]
            rows.append((*likeness(documents[item["id"]]), full > other, full < other))
        rows.sort()
        half = len(rows) // 2 if args.threshold is None else sum(r[0] < args.threshold for r in rows)
        for name, part in (("less alike", rows[:half]), ("more alike", rows[half:])):
            if not part:
                continue
            lost, won = sum(r[2] for r in part), sum(r[3] for r in part)
            print(f"| {Path(data).stem} ({len(rows)}) | {name} | {statistics.fmean(r[0] for r in part):.3f} | "
                  f"{statistics.fmean(r[1] for r in part):.3f} | {lost} / {won} |")


if __name__ == "__main__":
    main()
