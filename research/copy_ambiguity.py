"""Does a step where the answer so far could be copied on from two documents predict the reused cache's flips,
beyond its margin? (issue 41, item 2; a pilot)

On families of near-identical records the repaired cache names a look-alike document's entity where a full
prefill reads the right one ("The look-alike families' answers need almost all of the cache right",
docs/method.md). Such a step continues a phrase several documents share, each with another next token ("... was
born in 18|31" / "18|18"). A step is *ambiguous* when the answer's last N tokens occur in the prompt followed by
two or more distinct tokens (over the prompt and the answer before the step); the guard could read it at no cost. And
per step whether the order floor (a full prefill of the documents reversed, teacher-forced) chooses otherwise: the
guard holds the cache's flips to the floor's, so what matters is whether ambiguity raises the one more than the
other.

Per set: ingest its items' documents as shipped (calibrated), and for each item a full prefill's greedy answer
and the default budget's repaired cache teacher-forced on it, unguarded (calibrate.py's samples, with questions);
per step its margin, whether the cache's top token differs from full's (a flip), and whether the step is
ambiguous. Prints flip rates by margin band and ambiguity, and the log-loss of a margin-only and a margin +
ambiguity logistic curve fitted on each set and judged on the others.

    .venv/bin/python research/copy_ambiguity.py out/g68/syn_700.jsonl research/data/package_pages.jsonl \
        --limit 24 --json out/g69/ambiguity3.json   # 13 min

(out/g68/syn_700.jsonl: research/datasets/synthetic_set.py --first 700 --n 64 --k 8 --words 150 --seed 0.) Found:
ambiguity raises the order floor's flips about as much as the repair's; docs/method.md, "A step two documents
could continue".
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from kvboost_rag import KVBoost, fidelity
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.calibrate import _changes, _forced
from kvboost_rag.generation import SamplingParams


def ambiguous_steps(prompt_ids: list[int], answer: list[int], n: int) -> list[bool]:
    """Per step t of `answer`: whether its last n tokens before t occur in the prompt and the answer before t
    followed by two or more distinct tokens: what the guard could read before the step, never the token chosen."""
    seen = list(prompt_ids)
    followers: dict[tuple, set] = {}
    for i in range(len(seen) - n):
        followers.setdefault(tuple(seen[i:i + n]), set()).add(seen[i + n])
    out = []
    for token in answer:
        out.append(len(followers.get(tuple(seen[-n:]), ())) >= 2)
        seen.append(token)
        if len(seen) > n:
            followers.setdefault(tuple(seen[-n - 1:-1]), set()).add(seen[-1])
    return out


@torch.inference_mode()
def samples(engine: KVBoost, item, tokens: int, n: int) -> list[tuple[float, bool, bool, bool]]:
    """Per step of full's answer: (the repaired cache's margin, its flip, ambiguous, the order floor's flip)."""
    messages = render_prompt(item)
    full = engine.prefill(messages, "full", max_new_tokens=tokens, write_back=False)
    *_, last = engine.stream_from(full, SamplingParams(tokens))
    answer = list(last.result.token_ids)
    if not answer:
        return []
    unguarded = replace(engine.config.repair, fidelity="fast")
    reused = engine.prefill(messages, "cacheblend", max_new_tokens=tokens, write_back=False, repair=unguarded)
    steps = torch.cat([reused.logits[None], engine.continuation_logits(reused, answer[:-1])]) \
        if len(answer) > 1 else reused.logits[None]
    amb = ambiguous_steps(full.plan.token_ids.tolist(), answer, n)
    reversed_ids = engine.plan(render_prompt(replace(item, documents=item.documents[::-1])), "full").token_ids
    order = _changes(_forced(engine.adapter, reversed_ids, answer), answer)
    return [(fidelity.margin(row), int(row.argmax()) != token, a, o)
            for row, token, a, o in zip(steps, answer, amb, order, strict=True)]


def design(rows, with_amb: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples' features [T, 2 or 3] (1, margin, and ambiguity where asked) and their flips [T]."""
    x = torch.tensor([[1.0, m] + ([float(a)] if with_amb else []) for m, _, a, _ in rows])
    return x, torch.tensor([float(f) for _, f, _, _ in rows])


def fit(rows, with_amb: bool) -> torch.Tensor:
    x, y = design(rows, with_amb)
    w = torch.zeros(x.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y) + 1e-3 * (w[1:] ** 2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return w.detach()


def log_loss(w: torch.Tensor, rows, with_amb: bool) -> float:
    x, y = design(rows, with_amb)
    return float(torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="+")
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--n", type=int, default=3, help="context tokens a step's ambiguity is read over")
    parser.add_argument("--json")
    args = parser.parse_args()
    by_set = {}
    for path in args.data:
        items = load_items(path, args.limit)
        engine = KVBoost.from_pretrained(dtype="float32")
        engine.ingest([d for item in items for d in item.documents], progress=False)
        by_set[Path(path).stem] = [s for item in items for s in samples(engine, item, args.tokens, args.n)]
        engine.close()
        rows = by_set[Path(path).stem]
        print(f"\n{Path(path).stem}: {len(rows)} steps, {sum(f for _, f, _, _ in rows)} flips, "
              f"{sum(r[2] for r in rows)} ambiguous", flush=True)
        for low, high in ((0, 1), (1, 3), (3, 6), (6, math.inf)):
            for amb in (False, True):
                band = [(f, o) for m, f, a, o in rows if low <= m < high and a == amb]
                print(f"  margin {low}-{high} {'ambiguous' if amb else 'plain    '}: {sum(f for f, _ in band)} / "
                      f"{len(band)} flips, the order floor {sum(o for _, o in band)}")
    print("\n| fitted on | judged on | log-loss margin only | margin + ambiguity | ambiguity coefficient |")
    print("|---|---|---|---|---|")
    for fitted, rows in by_set.items():
        plain, both = fit(rows, False), fit(rows, True)
        for judged, other in by_set.items():
            print(f"| {fitted} | {judged} | {log_loss(plain, other, False):.4f} | {log_loss(both, other, True):.4f} "
                  f"| {float(both[2]):+.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(by_set))


if __name__ == "__main__":
    main()
