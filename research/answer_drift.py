"""How far a reused cache's answer distributions drift from a full prefill's along a whole answer, beside the order
floor's drift: teacher-forced on full's own greedy answer, so each position is compared on the same tokens, with no
divergence compounding (docs/method.md, "Shuffled orders: accuracy within noise, the model at chance").

synthetic_k8's held-out items (eight look-alike documents) in shuffled orders: full's greedy answer, then per
position t the KL(full || other) of the next-token distributions and whether the top token differs, for the
default repair before any guard move (`fast` at the default budget), naive reuse, and a full prefill of the same
documents in reverse order (the order floor). Mean KL and top-token flips per block of answer positions.

    .venv/bin/python research/answer_drift.py --items 12 --orders 3     # ~11 min
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from kvboost_rag import KVBoost, RepairConfig
from kvboost_rag.bench.data import bundled, in_orders, load_items
from kvboost_rag.bench.run import kl as kl_divergence
from kvboost_rag.bench.run import render_prompt

SKIP = 130
BLOCKS = ((0, 1), (1, 16), (16, 32), (32, 64))


def teacher_forced(engine: KVBoost, messages, strategy: str, repair: RepairConfig | None, answer: list[int],
                   ) -> torch.Tensor:
    """Next-token logits [T, V] after the prompt and each of `answer`'s tokens but the last."""
    pre = engine.prefill(messages, strategy, write_back=False, max_new_tokens=len(answer), repair=repair)
    return torch.cat([pre.logits[None], engine.continuation_logits(pre, answer[:-1])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=12)
    parser.add_argument("--orders", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    items = load_items(bundled("synthetic_k8"), SKIP + args.items)[SKIP:]
    engine = KVBoost.from_pretrained(dtype="float32")
    engine.ingest(list(dict.fromkeys(doc for item in items for doc in item.documents)), progress=False)
    others = {"fast (default budget)": ("cacheblend", RepairConfig(fidelity="fast")),
              "naive": ("cacheblend", RepairConfig(fidelity="fast", recompute_ratio=0.0)),
              "order floor (reversed)": ("full", None)}
    kl = {name: [] for name in others}
    flips = {name: [] for name in others}
    for item in in_orders(items, args.orders):
        messages = render_prompt(item)
        answer = engine.generate(messages, max_new_tokens=args.tokens, strategy="full", write_back=False)
        ids = list(answer.token_ids)
        if len(ids) < 2:
            continue
        truth = teacher_forced(engine, messages, "full", None, ids)
        reversed_messages = render_prompt(replace(item, documents=item.documents[::-1]))
        for name, (strategy, repair) in others.items():
            other = teacher_forced(engine, reversed_messages if name.startswith("order") else messages, strategy,
                                   repair, ids)
            kl[name].append(kl_divergence(truth, other))
            flips[name].append((truth.argmax(-1) != other.argmax(-1)).float())
        print(item.id, len(ids), {n: f"{kl[n][-1].mean():.3f}" for n in others}, flush=True)
    print(f"{len(kl['naive'])} answers; mean KL(full || other) / share of positions whose top token differs")
    print("| | " + " | ".join(f"positions {a}-{b - 1}" for a, b in BLOCKS) + " |")
    print("|---|" + "---|" * len(BLOCKS))
    for name in others:
        cells = []
        for a, b in BLOCKS:
            k = torch.cat([x[a:b] for x in kl[name]])
            f = torch.cat([x[a:b] for x in flips[name]])
            cells.append(f"{k.mean():.3f} / {f.mean():.3f}" if len(k) else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
