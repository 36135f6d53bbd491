"""Research harness (issue #6, round 6): accuracy by where the answer-bearing document sits.

For a bench JSON over DATA, each strategy's accuracy grouped by the answer document's place among the
prompt's documents (0 = first), so that where reuse loses answers shows. With "A|B" (round 9), a column for
the items either strategy answers: what a per-item choice between the two could reach at best.
Results: research/notebook.md.

    python research/by_position.py kvboost_rag/bench/synthetic_k8.jsonl out/t400.json
    python research/by_position.py kvboost_rag/bench/synthetic_k8.jsonl out/t300t.json \
        'cacheblend|cacheblend:taper=1.0'
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from kvboost_rag.bench.data import load_items


def main() -> None:
    data, path, pairs = sys.argv[1], sys.argv[2], sys.argv[3:]
    place = {item.id: item.answer_doc for item in load_items(data)}
    report = json.loads(Path(path).read_text())
    items = report["per_item"]
    for pair in pairs:  # each item's "A|B" accuracy: right under either
        first, second = pair.split("|")
        for item in items:
            item[pair] = {"accuracy": max(item[first]["accuracy"], item[second]["accuracy"])}
    labels = list(report["strategies"]) + pairs
    groups = defaultdict(list)
    for item in items:
        groups[place[item["id"]]].append(item)
    print("| answer document | items | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 2) + "|")
    for position, rows in sorted(groups.items()) + [("all", items)]:
        cells = [f"{statistics.fmean(r[label]['accuracy'] for r in rows):.2f}" for label in labels]
        print(f"| {position} | {len(rows)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
