"""Paired figures of a `kvboost-rag bench --json` report, per strategy against full: whole answers' time summed over
items (full's over the strategy's), accuracy lost / won on the same items and the sign test's p on them, agreement,
the first token's KL from full's and its max |dlogit| (mean and max over items; runs before the bench recorded it
show "-"), and the guard's estimate against the answers that differed. (The bench's table shows medians and means;
the issue-41 targets are sums and pairs.)

    .venv/bin/python research/paired_summary.py out/g41/fh_64_routes.json
    .venv/bin/python research/paired_summary.py --pooled a.json b.json   # runs on other items as one (same length)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvboost_rag.bench.run import paired_accuracy


def summary(report: dict) -> list[dict]:
    items = report["per_item"]
    full_total = sum(item["full"]["total_ms"] for item in items)
    rows = []
    for name in report["strategies"]:
        if name == "full":
            continue
        got = [item[name] for item in items]
        paired = paired_accuracy(items, name)  # as the bench pairs them; also for older reports and pooled runs
        totals = [g["total_ms"] for g in got if g.get("total_ms") is not None]
        rows.append({"strategy": name, "items": len(items), "agreement": sum(g["agreement"] for g in got) / len(got),
                     "accuracy": sum(g["accuracy"] for g in got) / len(got), **paired,
                     "whole_speedup": full_total / sum(totals) if len(totals) == len(items) else None,
                     "kl": sum(g["first_token_kl"] for g in got) / len(got),
                     "gap": [g["first_logit_gap"] for g in got] if all("first_logit_gap" in g for g in got) else None,
                     "estimate": sum(g.get("fidelity_estimate", 0.0) for g in got) / len(got),
                     "differs": sum(g.get("differs", 0.0) for g in got) / len(got)})
    return rows


def pooled(reports: list[dict]) -> dict:
    """Reports of runs on other items as one: their items together, the strategies every run has."""
    names = [n for n in reports[0]["strategies"] if all(n in r["strategies"] for r in reports)]
    if len({r["max_new_tokens"] for r in reports}) != 1:
        raise SystemExit("--pooled: the runs' answer lengths differ")
    items = [{k: v for k, v in item.items() if k in names or k == "id"} for r in reports for item in r["per_item"]]
    return reports[0] | {"strategies": {n: None for n in names}, "per_item": items, "items": len(items)}


def main(paths: list[str]) -> None:
    if paths and paths[0] == "--pooled":
        reports = [pooled([json.loads(Path(p).read_text()) for p in paths[1:]])]
        paths = ["+".join(paths[1:])]
    else:
        reports = [json.loads(Path(p).read_text()) for p in paths]
    for path, report in zip(paths, reports, strict=True):
        print(f"{path}: {report['model']}, {report['dtype']}, {report['items']} items, "
              f"{report['max_new_tokens']} tokens")
        print("| strategy | agree@16 | KL 1st | max abs dlogit 1st, mean / max | accuracy (lost / won, sign test p) | "
              "whole answers, summed | P(differs) / differs |")
        print("|---|---|---|---|---|---|---|")
        for r in summary(report):
            whole = "-" if r["whole_speedup"] is None else f"{r['whole_speedup']:.2f}x"
            gap = "-" if r["gap"] is None else f"{sum(r['gap']) / len(r['gap']):.2f} / {max(r['gap']):.2f}"
            print(f"| {r['strategy']} | {r['agreement']:.3f} | {r['kl']:.4f} | {gap} | "
                  f"{r['accuracy']:.3f} ({r['lost']} / {r['won']}, {r['sign_test_p']:.2f}) | "
                  f"{whole} | {r['estimate']:.3f} / {r['differs']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
