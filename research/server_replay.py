"""Replay a server comparison's as-shipped requests in-process, one at a time, and compare the answers.

research/server_compare.py records every request's prompt and answer. This builds a fresh engine as the server does
(the same documents ingested, so calibrated the same way), asks the prompts of one of its phases in the order they
started, with the default strategy, and reports how many answers are identical to the server's, which guard step
served each, and the accuracy against the `full` server's answers on the prompts both answered. Identical answers
mean the server's concurrency (batched decode steps, the account, the routes, write-back) changed nothing: what the
answers are is the method's. (research/shuffled_orders.py checks 20 of the prompts, out of order, beside larger
budgets.)

    .venv/bin/python research/server_replay.py out/server_compare.json --json out/server_replay.json  # ~8 min
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from load_test import build_prompts, read_items  # research/load_test.py

from kvboost_rag import KVBoost
from kvboost_rag.bench.run import correct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="research/server_compare.py's --json")
    parser.add_argument("--phase", default="A1", help="which of the as-shipped server's phases to replay")
    parser.add_argument("--json", help="write each replayed answer here")
    args = parser.parse_args()

    report = json.loads(Path(args.report).read_text())
    config = report["config"]
    items, documents = read_items(Path(config["data"]), config["skip"], config["items"])
    chats = {p.key: p.messages for p in build_prompts(items, config["orders"], config["seed"])}  # the server's own
    items = {item.id: item for item in items}
    engine = KVBoost.from_pretrained(dtype=config["dtype"])
    engine.ingest(documents, progress=False)
    served = sorted((r for r in report["requests"]["A"] if r["phase"] == args.phase and r.get("text")),
                    key=lambda r: r["started"])
    full = {r["prompt"]: r["text"] for r in report["requests"]["B"] if r.get("text")}
    rows, steps, same, right = [], collections.Counter(), 0, collections.Counter()
    for record in served:
        item, messages = items[record["prompt"].split("@")[0]], chats[record["prompt"]]
        answer = engine.generate(messages, max_new_tokens=config["max_tokens"])
        steps[tuple(s.step for s in answer.served)] += 1
        same += answer.text == record["text"]
        if record["prompt"] in full:
            right["replayed"] += correct(answer.text, item.answers)
            right["full server"] += correct(full[record["prompt"]], item.answers)
            right["paired"] += 1
        rows.append({"prompt": record["prompt"], "server": record["text"], "replayed": answer.text,
                     "steps": [s.step for s in answer.served]})
    print(f"{len(served)} requests of phase {args.phase}: {same} answers identical to the server's")
    print("steps that served them:", dict(steps))
    print(f"{right['paired']} prompts the full server answered too: right {right['replayed']:.0f} (replayed) "
          f"against {right['full server']:.0f} (full)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
