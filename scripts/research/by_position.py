"""Research harness (issue #6, round 6): accuracy by where the answer-bearing document sits.

For a bench JSON over DATA, each strategy's accuracy grouped by the answer document's place among the
prompt's documents (0 = first), so that where reuse loses answers shows. Results: docs/quality.md.

    python scripts/research/by_position.py kvboost_rag/bench/synthetic_k8.jsonl out/t400.json
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from kvboost_rag.bench.data import load_items


def main() -> None:
    data, path = sys.argv[1], sys.argv[2]
    place = {item.id: item.answer_doc for item in load_items(data)}
    report = json.loads(Path(path).read_text())
    labels = list(report["strategies"])
    groups = defaultdict(list)
    for item in report["per_item"]:
        groups[place[item["id"]]].append(item)
    print("| answer document | items | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 2) + "|")
    for position in sorted(groups):
        rows = groups[position]
        cells = [f"{statistics.fmean(r[label]['accuracy'] for r in rows):.2f}" for label in labels]
        print(f"| {position} | {len(rows)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
