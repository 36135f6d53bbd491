"""Research harness (issue #6, round 6): one bench report from several runs over disjoint items.

The 300-item test runs as three self-contained chunks of 100 items (each with its own store and drift
fit, as the 100-item test was run), because one store of 2400 fp32 documents does not fit the
in-memory tier here. This pools their items and summarizes them the way `kvboost-rag bench` does
(medians of the per-item TTFT and speed-up, means of the rest), then prints the bench's table.
Results: research/notebook.md.

    python research/pool.py out/t300.json out/t300_0.json out/t300_1.json out/t300_2.json \
        --plot docs/bench_synthetic_300.png
    python research/pool.py out/t400.json out/syn100_r5.json out/t300_0.json out/t300_1.json \
        out/t300_2.json --only full,naive,cacheblend,cacheblend:drift=false
"""

import argparse
import json
from pathlib import Path

from kvboost_rag.bench.report import plot, table
from kvboost_rag.bench.run import summarize


def pool(reports: list[dict], only: list[str] | None = None) -> dict:
    labels = only or list(reports[0]["strategies"])
    for report in reports:
        if missing := [label for label in labels if label not in report["strategies"]]:
            raise SystemExit(f"a run did not measure {', '.join(missing)}; pass --only with the shared strategies")
    per_item = [{label: item[label] for label in labels} | {"id": item["id"]}
                for report in reports for item in report["per_item"]]
    ids = [item["id"] for item in per_item]
    if len(set(ids)) != len(ids):
        raise SystemExit("the runs share items; pool disjoint runs only")
    first = reports[0]
    return {
        "model": first["model"],
        "dtype": first["dtype"],
        "kv_bits": first["kv_bits"],
        "items": len(per_item),
        "max_new_tokens": first["max_new_tokens"],
        "agree_tokens": first["agree_tokens"],
        "drift_prompts": first["drift_prompts"],
        "seconds": sum(report["seconds"] for report in reports),
        "pooled_from": len(reports),
        "strategies": summarize([{k: v for k, v in item.items() if k != "id"} for item in per_item], labels),
        "per_item": per_item,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--only", help="comma list: pool these strategies (runs that measured more)")
    args = parser.parse_args()
    report = pool([json.loads(path.read_text()) for path in args.runs], args.only.split(",") if args.only else None)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(report))
    if args.plot:
        plot(report, str(args.plot))


if __name__ == "__main__":
    main()
