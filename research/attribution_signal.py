"""Can an engine tell, with no answers to score against, which ingestion context keeps a corpus's answers on the right
document? A label-free signal, measured the way calibration could measure it (issue 41, a pilot).

The look-alike loss (docs/method.md, "The server comparison's accuracy gap") is a reused cache naming a look-alike
document's fact where a full prefill names the asked one's, and documents stored after the chat template's opening
alone (`doc_context="template"`) kept those answers where the shipped passage lost them, while the passage did better
on real text. Here, per corpus and per context: calibration's own prompts (calibrate.calibration_set: documents drawn
at random, a question about a name one of them holds), answered by `full` and by the repaired cache without the
guard (`fast`); each answer attributed to the one document whose distinctive words it names most
(distractor_choice.attribute). Printed per context: how often the repaired answer names full's document, names
another, and equals full's answer. The signal is worth building into calibration only if it prefers `template` where
the bench found it better (the server's look-alike families, multidoc_other's first 60) and not where it found the
passage better (the real-text sets).

    .venv/bin/python research/attribution_signal.py research/data/package_pages.jsonl --items 64 --json out/attr_pp.json
    .venv/bin/python research/attribution_signal.py out/server_compare.json --json out/attr_lookalike.json  # its corpus
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distractor_choice import attribute  # research/distractor_choice.py

from kvboost_rag import KVBoost, RepairConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.calibrate import PER_PROMPT, calibration_set
from kvboost_rag.config import ChunkingConfig, EngineConfig
from kvboost_rag.prompts import layout as named_layout


def corpus(path: str, items: int) -> list[str]:
    """The documents of the first `items` items of a bench file, or of a server comparison's report's items."""
    if path.endswith(".json"):
        from lookalike_variants import paired_prompts  # research/lookalike_variants.py
        return paired_prompts(json.loads(Path(path).read_text()))[3]
    return list(dict.fromkeys(d for item in load_items(path, items) for d in item.documents))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="a bench JSONL file, or research/server_compare.py's report")
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--contexts", default="passage,template")
    parser.add_argument("--json")
    args = parser.parse_args()
    documents = corpus(args.data, args.items)
    bench = named_layout("bench")
    runs = {}
    for context in args.contexts.split(","):
        engine = KVBoost.from_pretrained(dtype="float32", config=EngineConfig(
            dtype="float32", chunking=ChunkingConfig(doc_context=context)))
        engine.ingest(documents, progress=False)  # calibrates by itself, as shipped
        # The layout keeps each prompt's documents beside its messages, for the attribution.
        drawn = calibration_set(engine, documents, args.prompts, PER_PROMPT, seed=11,
                                layout=lambda group, question: (bench(group, question), tuple(group), question))
        rows = []
        for c in drawn:
            messages, group, question = c.prompt
            row = {"question": question}
            for run, repair in (("full", None), ("fast", RepairConfig(fidelity="fast"))):
                out = engine.generate(messages, max_new_tokens=args.tokens, write_back=False,
                                      **({"strategy": "full"} if repair is None else {"repair": repair}))
                row[run] = {"doc": attribute(out.text, group, question), "ids": list(out.token_ids), "text": out.text}
            rows.append(row)
        named = [r for r in rows if r["full"]["doc"] is not None]
        same = sum(r["fast"]["doc"] == r["full"]["doc"] for r in named)
        other = sum(r["fast"]["doc"] not in (None, r["full"]["doc"]) for r in named)
        equal = sum(r["fast"]["ids"] == r["full"]["ids"] for r in rows)
        agree = sum(r["fast"]["ids"][:16] == r["full"]["ids"][:16] for r in rows)
        print(f"{args.data} {context}: {len(rows)} prompts, full names a document in {len(named)}; the repair names "
              f"full's {same}, another {other}; = full's answer {equal}, first 16 tokens {agree}", flush=True)
        runs[context] = {"rows": rows, "named": len(named), "same": same, "other": other, "equal": equal,
                         "agree16": agree}
        engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"data": args.data, "items": args.items, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
