"""Whether two repairs of the same cache agreeing on a token says more than the margin does (issue 41, item 2).

The guard reads one number per token, its margin under the cache that serves it. On Gemma 3 270M `strict` serves
answers from a repair at 0.3 that is wrong with a large margin (docs/method.md). The ladder has, by the time it
judges the 0.3 repair, the logits of the repair below it (the one it refused): a free second opinion. Declared
before the run: on held-out items, among the tokens the upper repair's own curve would trust (flip chance within
the dtype floor's at that margin, strict's rule at a first token), those where the lower repair's top token differs
flip more often than those where it agrees, by at least 3x, and the disagreeing ones are few (under a quarter of
the trusted tokens). "climbed": the same among the tokens the lower repair's curve would not trust (the ladder's
case); the script was amended with that split before its first run ended, not after seeing it.

Per item: a full prefill's greedy answer (float32), then the cacheblend repair at each budget (fidelity "fast": its
margins measured, never acted on), teacher-forced on that answer; per token and budget the top token, the margin
and the curve's flip chance. The engine ingests the items' documents as shipped (it calibrates by itself).

    .venv/bin/python research/step_agreement.py --model gemma-3-270m --data research/data/multidoc_other.jsonl \
        --limit 30 --json out/g48/steps_gemma.json
"""

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

from kvboost_rag import KVBoost, RepairConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import continued_logits, render_prompt
from kvboost_rag.generation import SamplingParams

BUDGETS = (0.0, 0.07, 0.15, 0.3)
PAIRS = ((0.07, 0.15), (0.15, 0.3), (0.0, 0.15), (0.0, 0.3))


def measure(engine: KVBoost, item, tokens: int) -> dict:
    prompt = render_prompt(item)
    pre = engine.prefill(prompt, "full", max_new_tokens=tokens, write_back=False)
    answer = list(list(engine.stream_from(pre, SamplingParams(max_new_tokens=tokens)))[-1].result.token_ids)
    rows = {"id": item.id, "answer": answer, "budgets": {}}
    for budget in BUDGETS:
        repair = RepairConfig(fidelity="fast", recompute_ratio=budget)
        pre = engine.prefill(prompt, "cacheblend", max_new_tokens=tokens, write_back=False, repair=repair)
        logits = continued_logits(engine, pre, pre.logits[None], answer).float()  # [T, V]
        top2 = logits.topk(2, dim=-1).values
        curve = engine.predictor.at(budget) if engine.predictor is not None and budget > 0 else None
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        rows["budgets"][str(budget)] = {
            "top": logits.argmax(-1).tolist(), "margin": margins,
            "chance": [curve.flip_chance(m) if curve else None for m in margins],
            "dtype_floor": [curve.floors[1].flip_chance(m) if curve and curve.floors else None for m in margins]}
    return rows


def trusted(row: dict, t: int) -> bool:
    """A token strict admits at a first token: its flip chance within the dtype floor's at its margin."""
    return row["chance"][t] is not None and row["chance"][t] <= (row["dtype_floor"][t] or 0.03 / 16)


def summary(items: list[dict]) -> dict:
    out = {}
    for lo, hi in PAIRS:
        cells = {"agree": [0, 0], "differ": [0, 0], "agree_trusted": [0, 0], "differ_trusted": [0, 0],
                 "agree_first": [0, 0], "differ_first": [0, 0], "agree_climbed": [0, 0], "differ_climbed": [0, 0]}
        for row in items:
            a, b = row["budgets"][str(lo)], row["budgets"][str(hi)]
            for t, truth in enumerate(row["answer"]):
                flip = b["top"][t] != truth
                kind = "agree" if a["top"][t] == b["top"][t] else "differ"
                keys = [kind] + ([f"{kind}_first"] if t == 0 else [])
                if trusted(b, t):
                    keys.append(f"{kind}_trusted")
                    if a["chance"][t] is not None and not trusted(a, t):  # the ladder's case: lower refused
                        keys.append(f"{kind}_climbed")
                for k in keys:
                    cells[k][0] += 1
                    cells[k][1] += flip
        out[f"{lo}->{hi}"] = {k: {"tokens": n, "flips": f, "share": f / n if n else math.nan}
                              for k, (n, f) in cells.items()}
    return out


def arguments() -> argparse.ArgumentParser:
    """The items and model a probe of held-out tokens runs on (also curve_fits.py's)."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--data", default="research/data/multidoc_other.jsonl")
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--tokens", type=int, default=16)
    return p


def probe(collect, score) -> None:
    """A probe's command line (curve_fits.py's, half_curve.py's): measure and save (--json), or score a saved run
    (--score); `collect(args)` measures, `score(found)` prints the table."""
    p = arguments()
    p.add_argument("--json", type=Path, help="where to save the samples")
    p.add_argument("--score", type=Path, help="score a saved run instead")
    args = p.parse_args()
    if not (args.json or args.score):
        p.error("give --json (measure) or --score (a saved run)")
    if args.score:
        score(json.loads(args.score.read_text()))
        return
    found = collect(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(found))
    score(found)


def main() -> None:
    p = arguments()
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    items = load_items(args.data, limit=args.skip + args.limit)[args.skip:]
    engine = KVBoost.from_pretrained(args.model, dtype="float32")
    engine.ingest([d for item in items for d in item.documents])
    rows = [measure(engine, item, args.tokens) for item in tqdm(items, desc="items")]
    result = {"model": engine.model_id, "data": args.data, "items": len(rows), "summary": summary(rows),
              "per_item": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
