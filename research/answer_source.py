"""Research harness (issue #6, round 8): which document each strategy's answer comes from.

The synthetic items' documents state the same facts with different values, so an answer that names a value
names the document it was read from. On items of DATA whose documents STORE holds (maps per place fitted on
them, 24 prompts), runs `full` and each strategy of STRATEGIES (the bench's syntax) greedily and prints, per
answer place, how often each strategy's answer comes from the answer document, the first, the last, another
one, or none; and how often it names the same document as full's.

    python research/answer_source.py out/tune100.jsonl out/store_tune naive,cacheblend out/tune_source.json 1,7

The optional last argument keeps only the items whose answer document sits at those places (the maps are
fitted on every item's documents all the same).
"""

import collections
import json
import re
import sys
from pathlib import Path

import torch

from kvboost_rag import EngineConfig, KVBoost, RepairConfig, StoreConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import parse_strategies, render_prompt


def source(text: str, question: str, documents: tuple[str, ...]) -> int | None:
    """The document whose value the answer names: the first of the answer's value-like words (numbers,
    capitalised words not in the question) found in exactly one document."""
    for word in re.findall(r"\d[\d,.]*\d|\d|[A-Z][a-z]+", text.split("\n")[0]):
        if word in question:
            continue
        holders = [j for j, doc in enumerate(documents) if re.search(rf"(?<![\w,]){re.escape(word)}(?![\w])", doc)]
        if len(holders) == 1:
            return holders[0]
    return None


def label(src: int | None, answer_doc: int, k: int) -> str:
    if src is None:
        return "none"
    return "answer" if src == answer_doc else "first" if src == 0 else "last" if src == k - 1 else "other"


def main() -> None:
    data, store, names, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
    items = load_items(data)
    engine = KVBoost.from_pretrained(config=EngineConfig(store=StoreConfig(disk_dir=store),
                                                         repair=RepairConfig(fidelity="fast")))
    engine.drift_path = None
    engine.fit_drift([d for item in items for d in item.documents], prompts=24)
    if len(sys.argv) > 5:
        items = [item for item in items if item.answer_doc in {int(p) for p in sys.argv[5].split(",")}]
    strategies = {s.label: s for s in parse_strategies(",".join(names), RepairConfig(fidelity="fast"))}
    rows = []
    for item in items:
        prompt = render_prompt(item)
        row = {"id": item.id, "answer_doc": item.answer_doc, "k": len(item.documents)}
        with torch.inference_mode():
            for name in ["full", *names]:
                spec = strategies[name]
                text = engine.generate(prompt, strategy=spec.strategy, max_new_tokens=24, write_back=False,
                                       repair=spec.repair).text
                row[name] = {"text": text, "source": source(text, item.question, item.documents)}
        rows.append(row)
        print(item.id, item.answer_doc, {n: row[n]["source"] for n in ["full", *names]}, flush=True)
    Path(out).write_text(json.dumps(rows, indent=1))
    for name in ["full", *names]:
        print(f"\n{name}: answer source by answer place (answer / first / last / other / none)")
        for place in sorted({r["answer_doc"] for r in rows}):
            at = [r for r in rows if r["answer_doc"] == place]
            counts = collections.Counter(label(r[name]["source"], place, r["k"]) for r in at)
            print(place, " ".join(f"{c}={counts[c]}" for c in ("answer", "first", "last", "other", "none")))
        if name != "full":
            same = sum(r[name]["source"] == r["full"]["source"] for r in rows)
            print(f"same document as full's: {same}/{len(rows)}")


if __name__ == "__main__":
    main()
