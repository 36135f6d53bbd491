"""Research harness (issue #6, round 5): how sure a bench run is of a strategy's accuracy-gap ratio.

For each bench JSON, the ratio (acc - acc_naive) / (acc_full - acc_naive) of STRATEGY and its 90% interval
over 5000 paired bootstrap resamples of the items (a resample keeps each item's strategies together), the
share of resamples at or above the issue's 0.80, and the item-by-item table against full.
Results: research/notebook.md.

    python research/gap_ci.py cacheblend out/syn100_r5.json out/syn100_drift_fast.json
"""

import json
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

TARGET = 0.8


def gap_ratio(items: list[dict], strategy: str) -> float | None:
    def accuracy(name: str) -> float:
        return statistics.fmean(item[name]["accuracy"] for item in items)

    gap = accuracy("full") - accuracy("naive")
    return (accuracy(strategy) - accuracy("naive")) / gap if gap > 0 else None


def main() -> None:
    strategy, paths = sys.argv[1], sys.argv[2:]
    for path in paths:
        items = json.loads(Path(path).read_text())["per_item"]
        rng = random.Random(0)
        ratios = sorted(r for r in (gap_ratio(rng.choices(items, k=len(items)), strategy) for _ in range(5000))
                        if r is not None)
        low, high = ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios))]
        above = sum(r >= TARGET for r in ratios) / len(ratios)
        pairs = Counter((item["full"]["accuracy"] > 0, item[strategy]["accuracy"] > 0) for item in items)
        print(f"{path}: {strategy} recovers {gap_ratio(items, strategy):.2f} of the accuracy gap "
              f"(90% interval {low:.2f}-{high:.2f}, {above:.0%} of resamples >= {TARGET}, {len(items)} items); "
              f"against full: both right {pairs[True, True]}, only full {pairs[True, False]}, "
              f"only {strategy} {pairs[False, True]}, neither {pairs[False, False]}")


if __name__ == "__main__":
    main()
