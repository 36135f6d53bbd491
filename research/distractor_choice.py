"""Which document's fact an answer names, and where that document sat in the prompt: full prefill against reused
caches, on the bundled synthetic_k8 held-out items (eight look-alike documents, one answering) asked in shuffled
orders (docs/method.md, "Shuffled orders: accuracy within noise, the model at chance").

An answer is attributed to the one document sharing the most of its distinctive words (capitalized words and
numbers found in that document only, the question's left out); none when no document or several tie. Prints per
prompt the answer document's place, then per run: accuracy, items lost / won against full, answers equal to full's,
answers naming full's document, and how often each place was named.

    .venv/bin/python research/distractor_choice.py --items 16 --orders 4 --json out/choice.json       # ~28 min
    .venv/bin/python research/distractor_choice.py --items 8 --orders 4 --no-drift --json out/choice2.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re

from kvboost_rag import KVBoost, RepairConfig
from kvboost_rag.bench.data import bundled, in_orders, load_items
from kvboost_rag.bench.run import correct, render_prompt

WORD = re.compile(r"[A-Z][a-z]+|\d[\d,]*\d")
SKIP = 130  # synthetic_k8's items after the tuning slice


def attribute(text: str, documents: tuple[str, ...], question: str) -> int | None:
    """The place in the prompt of the one document whose distinctive words the answer names most; None if none or
    tied."""
    words = [set(WORD.findall(d)) for d in documents]
    named = set(WORD.findall(text)) - set(WORD.findall(question))
    scores = [len(named & (own - set().union(*(w for j, w in enumerate(words) if j != i))))
              for i, own in enumerate(words)]
    best = max(scores)
    return scores.index(best) if best and scores.count(best) == 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--orders", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--no-drift", action="store_true", help="compare naive and fast with and without drift maps")
    parser.add_argument("--json", help="write every answer here")
    args = parser.parse_args()
    items = load_items(bundled("synthetic_k8"), SKIP + args.items)[SKIP:]
    engine = KVBoost.from_pretrained(dtype="float32")
    engine.ingest(list(dict.fromkeys(doc for item in items for doc in item.documents)), progress=False)
    runs = {"full": None, "naive": RepairConfig(fidelity="fast", recompute_ratio=0.0)}
    if args.no_drift:
        runs |= {"naive, no drift": RepairConfig(fidelity="fast", recompute_ratio=0.0, drift=False),
                 "fast, no drift": RepairConfig(fidelity="fast", drift=False)}
    else:
        runs |= {"fast": RepairConfig(fidelity="fast"), "fast 0.3": RepairConfig(fidelity="fast", recompute_ratio=0.3)}
    rows = []
    for item in in_orders(items, args.orders):  # the documents in the order they are asked in
        messages = render_prompt(item)
        row = {"prompt": item.id}
        for run, repair in runs.items():
            out = engine.generate(messages, max_new_tokens=args.tokens, write_back=False,
                                  **({"strategy": "full"} if repair is None else {"repair": repair}))
            row[run] = {"correct": correct(out.text, item.answers),
                        "place": attribute(out.text, item.documents, item.question), "text": out.text,
                        "ids": out.token_ids}
        rows.append(row)
        print(item.id, {run: (row[run]["correct"], row[run]["place"]) for run in runs}, flush=True)
    for run in runs:
        lost = sum(r["full"]["correct"] > r[run]["correct"] for r in rows)
        won = sum(r["full"]["correct"] < r[run]["correct"] for r in rows)
        places = collections.Counter(r[run]["place"] for r in rows)
        print(f"{run}: accuracy {sum(r[run]['correct'] for r in rows):.0f}/{len(rows)}, lost {lost} won {won}, "
              f"same as full {sum(r[run]['ids'] == r['full']['ids'] for r in rows)}, "
              f"full's document {sum(r[run]['place'] == r['full']['place'] for r in rows)}, "
              f"places named {dict(sorted(places.items(), key=str))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
