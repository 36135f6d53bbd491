"""One strategy across bench runs of the same items with the engine built otherwise (`--doc-context`, say), paired
by item: each run's figures against its own `full`, then each run against the first on the items both scored.
`full` does not depend on how documents were stored, so its answers must agree across the runs (checked).

    .venv/bin/python research/paired_runs.py passage=out/g64/fh.json template=out/g65/fh_template.json
    .venv/bin/python research/paired_runs.py --strategy cacheblend a=x.json b=y.json c=z.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvboost_rag.bench.run import paired_accuracy, sign_test


def by_id(report: dict) -> dict[str, dict]:
    return {item["id"]: item for item in report["per_item"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="label=report.json, the first the one the others are paired with")
    p.add_argument("--strategy", default="cacheblend")
    args = p.parse_args()
    runs = {label: by_id(json.loads(Path(path).read_text()))
            for label, path in (run.split("=", 1) for run in args.runs)}
    ids = sorted(set.intersection(*(set(items) for items in runs.values())))
    first_label, first = next(iter(runs.items()))
    mismatched = {i for i in ids for items in runs.values()
                  if items[i]["full"]["accuracy"] != first[i]["full"]["accuracy"]}
    print(f"{len(ids)} items in every run; full's accuracy differs across runs on {len(mismatched)}")
    print("| run | accuracy (full) | lost / won vs full (p) | agree@16 | KL 1st | TTFT speedup, median | "
          f"vs {first_label}: lost / won (p) |")
    print("|---|---|---|---|---|---|---|")
    for label, items in runs.items():
        got = [items[i][args.strategy] for i in ids]
        full = [items[i]["full"] for i in ids]
        vs_full = paired_accuracy([items[i] for i in ids], args.strategy)  # as the bench pairs them
        base = [first[i][args.strategy]["accuracy"] for i in ids]
        b_lost = sum(b > g["accuracy"] for b, g in zip(base, got, strict=True))
        b_won = sum(b < g["accuracy"] for b, g in zip(base, got, strict=True))
        print(f"| {label} | {statistics.mean(g['accuracy'] for g in got):.3f} "
              f"({statistics.mean(f['accuracy'] for f in full):.3f}) | "
              f"{vs_full['lost']} / {vs_full['won']} ({vs_full['sign_test_p']:.2f}) | "
              f"{statistics.mean(g['agreement'] for g in got):.3f} | "
              f"{statistics.mean(g['first_token_kl'] for g in got):.4f} | "
              f"{statistics.median(g['speedup'] for g in got):.2f}x | "
              f"{b_lost} / {b_won} ({sign_test(b_lost, b_won):.2f}) |")


if __name__ == "__main__":
    main()
