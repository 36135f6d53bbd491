"""Which change gets `full`'s right answers back on a server comparison's paired prompts (look-alike documents).

Takes research/server_compare.py's report, and for the prompts both servers answered (in the order the `full`
server started them) answers each in-process, --tokens tokens, greedy: first over one engine as the server builds it
(the same documents ingested and calibrated) with `full`, the default with and without drift maps, `fast` (no
guard) with and without them, at a budget of 0.3 with and without them, naive reuse and `full` over the documents
reversed (the order floor); then over engines built otherwise (--engines): the documents of four times as many items
ingested, and the documents stored alone or after the chat template's opening only (`doc_context`), each with the
default. Prints, per run, the prompts right, lost / won against `full`, and how many equal full's answer; with
--json, every answer. --passage FILE (repeatable): one more engine each, its documents stored after that text instead
of the shipped neutral passage (`doc_context="passage"`); --no-strategies: of the strategies only `full` and the
default.

    .venv/bin/python research/lookalike_variants.py out/server_compare.json --json out/lookalike.json  # ~30 min
    .venv/bin/python research/lookalike_variants.py out/server_compare.json --no-strategies --no-engines \
        --passage out/trimmed.txt                                                                     # ~12 min
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

from load_test import build_prompts, read_items  # research/load_test.py

from kvboost_rag import KVBoost, assembly
from kvboost_rag.bench.run import correct
from kvboost_rag.config import ChunkingConfig, EngineConfig
from kvboost_rag.prompts import rag_messages

STRATEGIES = {  # name: (strategy, RepairConfig overrides)
    "default": ("cacheblend", None),
    "fast": ("cacheblend", {"fidelity": "fast"}),
    "fast, no drift maps": ("cacheblend", {"fidelity": "fast", "drift": False}),
    "fast at 0.3": ("cacheblend", {"fidelity": "fast", "recompute_ratio": 0.3}),
    "fast at 0.3, no drift maps": ("cacheblend", {"fidelity": "fast", "recompute_ratio": 0.3, "drift": False}),
    "default, no drift maps": ("cacheblend", {"drift": False}),
    "naive": ("naive", {"fidelity": "fast"}),
}


def ordered_documents(item, key: str) -> list[str]:
    return [item.documents[int(i)] for i in key.split("@")[1].split(".")]


def paired_prompts(report: dict, limit: int | None = None) -> tuple[list[str], list[list[dict]], list, list[str]]:
    """The prompts both servers of `report` answered, in the order the `full` server started them (the first
    `limit`): their keys, their chat messages (the servers' own), their items, and every document of the report's
    items."""
    config = report["config"]
    items, documents = read_items(Path(config["data"]), config["skip"], config["items"])
    by_id = {item.id: item for item in items}
    served = {r["prompt"] for r in report["requests"]["A"] if r.get("text")}
    keys = [r["prompt"] for r in sorted(report["requests"]["B"], key=lambda r: r["started"])
            if r.get("text") and r["prompt"] in served][:limit]
    chats = {p.key: p.messages for p in build_prompts(items, config["orders"], config["seed"])}
    return keys, [chats[key] for key in keys], [by_id[key.split("@")[0]] for key in keys], documents


def answer(engine: KVBoost, messages: list[dict], tokens: int, strategy: str = "cacheblend", overrides=None) -> str:
    repair = dataclasses.replace(engine.config.repair, **overrides) if overrides else None
    return engine.generate(messages, max_new_tokens=tokens, strategy=strategy, repair=repair, write_back=False).text


@contextlib.contextmanager
def stored_after(passage: str):
    """Engines built inside store documents after `passage` instead of the shipped one. The product has no option
    for the passage's text (the context is part of the fingerprint, so a store never mixes the two)."""
    shipped, assembly.CONTEXT_PASSAGE = assembly.CONTEXT_PASSAGE, passage
    try:
        yield
    finally:
        assembly.CONTEXT_PASSAGE = shipped


def tally(name: str, texts: list[str], full: list[str], items: list) -> None:
    right = sum(correct(t, item.answers) for t, item in zip(texts, items, strict=True))
    lost = sum(correct(f, i.answers) > correct(t, i.answers) for t, f, i in zip(texts, full, items, strict=True))
    won = sum(correct(f, i.answers) < correct(t, i.answers) for t, f, i in zip(texts, full, items, strict=True))
    same = sum(t == f for t, f in zip(texts, full, strict=True))
    print(f"{name:45s} right {right:3.0f}  lost / won {lost} / {won}  = full's {same} / {len(texts)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="research/server_compare.py's --json")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--limit", type=int, help="the first N paired prompts only (a smoke run)")
    parser.add_argument("--engines", action=argparse.BooleanOptionalAction, default=True,
                        help="also the engines built otherwise (three more ingestions and calibrations)")
    parser.add_argument("--strategies", action=argparse.BooleanOptionalAction, default=True,
                        help="all the strategies and the reversed order, else full and the default only")
    parser.add_argument("--passage", action="append", default=[], type=Path,
                        help="a text file: one more engine, its documents stored after this passage")
    parser.add_argument("--json")
    args = parser.parse_args()

    report = json.loads(Path(args.report).read_text())
    config = report["config"]
    keys, prompts, paired, documents = paired_prompts(report, args.limit)

    engine = KVBoost.from_pretrained(dtype=config["dtype"])
    engine.ingest(documents, progress=False)
    texts = {"full": [answer(engine, m, args.tokens, "full") for m in prompts]}
    for name, (strategy, overrides) in STRATEGIES.items() if args.strategies else [("default", STRATEGIES["default"])]:
        texts[name] = [answer(engine, m, args.tokens, strategy, overrides) for m in prompts]
    if args.strategies:
        reversed_chats = [rag_messages(ordered_documents(item, key)[::-1], item.question, item.system)
                          for item, key in zip(paired, keys, strict=True)]
        texts["full, documents reversed"] = [answer(engine, m, args.tokens, "full") for m in reversed_chats]
    engine.close()
    builds = {}  # name: (engine config, documents ingested, what the engine is built inside)
    if args.engines:
        _, wide = read_items(Path(config["data"]), config["skip"], 4 * config["items"])
        builds["documents of 4x the items ingested"] = (EngineConfig(dtype=config["dtype"]), wide, None)
        for context in ("none", "template"):
            builds[f"doc_context={context}"] = (EngineConfig(dtype=config["dtype"],
                                                             chunking=ChunkingConfig(doc_context=context)),
                                                documents, None)
    for path in args.passage:
        builds[f"stored after {path.name}"] = (EngineConfig(dtype=config["dtype"]), documents,
                                               path.read_text().strip())
    for name, (engine_config, docs, passage) in builds.items():
        with stored_after(passage) if passage else contextlib.nullcontext():
            other = KVBoost.from_pretrained(config=engine_config)
        other.ingest(docs, progress=False)
        texts[name] = [answer(other, m, args.tokens) for m in prompts]
        other.close()

    print(f"{len(keys)} prompts both servers answered, {args.tokens} tokens")
    for name, answers in texts.items():
        tally(name, answers, texts["full"], paired)
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": keys, "answers": texts}, indent=1))


if __name__ == "__main__":
    main()
