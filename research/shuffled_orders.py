"""The server comparison's shuffled-order prompts answered by the engine directly, one request at a time: whether
the shipped server's answers are the engine's, and the repaired cache's accuracy at larger budgets (no guard)
beside a full prefill, interleaved per prompt (docs/load_test.md, "The shipped server against one answering with
`full`").

Reads the prompts both servers of a `research/server_compare.py --json` run answered (12) and 8 more of server A's,
ingests the same documents (calibrating as the server did), then per prompt: full, and cacheblend at each budget.

    .venv/bin/python research/shuffled_orders.py out/g41/server_compare.json    # ~10 min
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from load_test import build_prompts

from kvboost_rag import KVBoost, RepairConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import correct

BUDGETS = (0.07, 0.15, 0.3, 0.5)
TOKENS = 48


def main(path: str) -> None:
    report = json.loads(Path(path).read_text())
    config = report["config"]
    items = load_items(config["data"], config["skip"] + config["items"])[config["skip"]:]
    prompts = {p.key: p for p in build_prompts(items, config["orders"], config["seed"])}
    by_id = {item.id: item for item in items}
    served = {name: {r["prompt"]: r["text"] for r in report["requests"][name] if r["text"] is not None}
              for name in ("A", "B")}
    keys = [k for k in served["A"] if k in served["B"]][:12] + [k for k in served["A"] if k not in served["B"]][:8]
    engine = KVBoost.from_pretrained(dtype=config["dtype"])
    engine.ingest(list(dict.fromkeys(doc for item in items for doc in item.documents)), progress=False)
    runs = ("full", "as served", *BUDGETS)
    acc, ttft, agree = ({r: [] for r in runs} for _ in range(3))
    same_as_server = 0
    engine.generate(prompts[keys[0]].messages, max_new_tokens=4, strategy="full")  # warm-up
    for key in keys:
        item, messages = by_id[key.split("@")[0]], prompts[key].messages
        full = engine.generate(messages, max_new_tokens=TOKENS, strategy="full", write_back=False)
        shipped = engine.generate(messages, max_new_tokens=config["max_tokens"], write_back=True)
        same_as_server += shipped.text == served["A"][key]
        for run in runs:
            out = (full if run == "full" else shipped if run == "as served" else
                   engine.generate(messages, max_new_tokens=TOKENS, write_back=False,
                                   repair=RepairConfig(fidelity="fast", recompute_ratio=run)))
            acc[run].append(correct(out.text, item.answers))
            ttft[run].append(out.ttft_ms)
            agree[run].append(out.token_ids[:16] == full.token_ids[:16])
    print(f"{len(keys)} prompts; the engine's default answer is server A's on {same_as_server}")
    print("| run | accuracy | first 16 tokens = full's | TTFT median ms | speed-up (median per prompt) |")
    print("|---|---|---|---|---|")
    for run in runs:
        speedup = statistics.median(f / t for f, t in zip(ttft["full"], ttft[run], strict=True))
        print(f"| {run} | {sum(acc[run]) / len(keys):.3f} | {sum(agree[run]) / len(keys):.3f} | "
              f"{statistics.median(ttft[run]):.0f} | {speedup:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1])
