"""`kvboost-rag ask --docs PATH... "question"`: answer from documents, with timing and reuse figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..prompts import DEFAULT_SYSTEM, rag_messages
from .common import add_engine_options, add_strategy_option, engine_config, make_engine, read_documents, sampling_params


def add_parser(sub) -> None:
    p = sub.add_parser("ask", help="answer a question from documents (ingesting them if needed)")
    p.add_argument("question")
    p.add_argument("--docs", nargs="+", type=Path, required=True, help="text files or folders, in prompt order")
    p.add_argument("--system", default=DEFAULT_SYSTEM)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--compare", action="store_true",
                   help="also answer with a full prefill: both warmed up once, then timed; prints the TTFT ratio "
                        "and whether the answers are the same")
    add_strategy_option(p)
    add_engine_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if not args.question.strip():
        raise ValueError("empty question: ask something")
    # Every setting checked before the documents are read or the model is loaded.
    sampling_params(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    config = engine_config(args)
    docs = [text.strip() for _, text in read_documents(args.docs)]
    engine = make_engine(args, config)
    try:
        return _run(args, engine, docs)
    finally:
        engine.close()


def _run(args, engine, docs) -> int:
    engine.ingest(docs, progress=True)
    c = engine.counters
    print(f"documents: {c['documents_computed']} computed, {c['documents_stored']} found in the store")
    prompt = rag_messages(docs, args.question, args.system)
    runs = [args.strategy] + (["full"] if args.compare and args.strategy != "full" else [])
    if len(runs) > 1:  # a first request pays for one-time setup (kernels, reads from disk): not what is compared
        for strategy in runs:
            engine.prefill(prompt, strategy, write_back=False)
    answers = {}
    for strategy in runs:
        out = None
        print(f"[{strategy}] ", end="", flush=True)
        for piece in engine.stream(prompt, max_new_tokens=args.max_new_tokens, strategy=strategy,
                                   temperature=args.temperature):
            sys.stdout.write(piece.text)
            sys.stdout.flush()
            out = piece.result or out
        answers[strategy] = out
        print(f"\n  ttft {out.ttft_ms:.1f} ms | prompt {out.prompt_tokens} tokens: reused {out.reused_tokens} "
              f"(exact {out.exact_tokens}), recomputed {out.recomputed_tokens} | {out.generated_tokens} new "
              f"tokens in {out.total_ms:.0f} ms ({out.finish_reason})")
        if out.strategy != "full":
            how = ("fell back to a full prefill" if out.fell_back else "from the reused cache" if out.exact_from is None
                   else f"exact cache from token {out.exact_from} on")
            if out.recompute_budget is not None and not out.fell_back:
                how += f", {out.recompute_budget:.0%} of the reused tokens repaired per layer"
            print(f"  fidelity: {out.fidelity_estimate:.1%} predicted chance the answer differs from a full "
                  f"prefill's ({how})")
    if len(runs) > 1:
        ours, full = answers[args.strategy], answers["full"]
        verdict = "the same answer as" if ours.token_ids == full.token_ids else "a different answer from"
        print(f"{args.strategy}: {full.ttft_ms / ours.ttft_ms:.2f}x faster to the first token than full, "
              f"{verdict} full")
    return 0
