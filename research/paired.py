"""Research harness (issue #6, round 7): one strategy in two runs over the same items, item by item.

For two bench JSONs (or pooled ones) that share items, the strategy's accuracy flips (right only in A, only
in B), and its first-token and continuation KL against each run's full prefill: means, and the share of
items where B's is lower. A full prefill is deterministic, so both runs' KL are against the same truth.

    python research/paired.py cacheblend out/t300.json out/t300p.json
"""

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    label, a_path, b_path = sys.argv[1], sys.argv[2], sys.argv[3]
    a, b = ({item["id"]: item[label] for item in json.loads(Path(p).read_text())["per_item"]} for p in (a_path, b_path))
    ids = sorted(a.keys() & b.keys())
    if not ids:
        raise SystemExit("the two runs share no item")
    only_a = sum(a[i]["accuracy"] > b[i]["accuracy"] for i in ids)
    only_b = sum(b[i]["accuracy"] > a[i]["accuracy"] for i in ids)
    print(f"{len(ids)} items; {label} right only in A: {only_a}, only in B: {only_b}")
    for key in ("accuracy", "first_token_kl", "continuation_kl", "agreement"):
        mean_a, mean_b = (statistics.fmean(run[i][key] for i in ids) for run in (a, b))
        lower = sum(b[i][key] < a[i][key] for i in ids) / len(ids)
        print(f"{key:16s} A {mean_a:.4f}  B {mean_b:.4f}  B/A {mean_b / mean_a:.3f}"
              + (f"  B lower on {lower:.0%} of items" if key.endswith("_kl") else ""))


if __name__ == "__main__":
    main()
