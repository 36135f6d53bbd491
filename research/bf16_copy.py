"""Why models.in_dtype keeps the rotary frequencies in float32: a bf16 copy made with a plain `.to(bf16)` against
one made by in_dtype and one loaded in bf16, as the guard's HALF step serves from it (repair/guard.py: a full
prefill in bf16, decoded on in float32). Per item, whether the first N tokens equal a float32 full prefill's.

    .venv/bin/python research/bf16_copy.py --limit 10      # 3 min; 7 / 10 / 10 of 10 at commit 7c827d4
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math

import torch

from kvboost_rag import KVBoost, fidelity, models
from kvboost_rag.adapter import ModelAdapter
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt


def constant(chance: float, budget: float) -> fidelity.Predictor:
    """A curve with this flip chance at every margin, with floors that trust a bf16 cache (HALF) and nothing else."""
    curve = fidelity.Predictor(math.log(chance / (1 - chance)), 0.0, tokens=1000, budget=budget)
    floors = tuple(fidelity.Predictor(math.log(c / (1 - c)), 0.0, budget=budget) for c in (0.5, 1e-20))
    return dataclasses.replace(curve, floors=floors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="research/data/fidelity_holdout.jsonl")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()

    engine = KVBoost.from_pretrained(None, dtype="float32", calibrate=False, ladder_costs=False)
    items = load_items(args.data)[:args.limit]
    engine.ingest(list(dict.fromkeys(d for item in items for d in item.documents)), progress=False)
    # Every repair refused, a bf16 cache trusted: each guarded request is served by the HALF step.
    never = 1 - 1e-12
    engine.predictor = constant(never, 0.07).with_others([constant(never, 0.15), constant(never, 0.3)])
    rounded = copy.deepcopy(engine.adapter.model).to(torch.bfloat16)  # the plain cast: inv_freq rounded too
    copies = {".to(bf16)": ModelAdapter(rounded), "in_dtype": ModelAdapter(models.in_dtype(engine.adapter.model,
                                                                                            torch.bfloat16))}
    loaded = KVBoost.from_pretrained(None, dtype="bfloat16", calibrate=False)
    same = dict.fromkeys([*copies, "loaded in bf16 (full)"], 0)
    for item in items:
        messages = render_prompt(item, "bench")
        full = engine.generate(messages, strategy="full", max_new_tokens=args.tokens, write_back=False).token_ids
        for name, adapter in copies.items():
            engine._half = adapter  # the engine's bf16 model, swapped (research only)
            out = engine.generate(messages, max_new_tokens=args.tokens, write_back=False)
            assert out.served[0].step == "half", out.served
            same[name] += out.token_ids == full
        same["loaded in bf16 (full)"] += loaded.generate(messages, strategy="full", max_new_tokens=args.tokens,
                                                         write_back=False).token_ids == full
    print(f"first {args.tokens} tokens equal float32 full's, of {len(items)}: {same}")


if __name__ == "__main__":
    main()
