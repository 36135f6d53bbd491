"""Online calibration on a distribution the offline calibration never saw (issue 41): does the guard's estimate come
within 2x of the observed share of differing answers after at most 50 served requests?

The engine is calibrated the way `ingest` does it, on one corpus and layout (bundled synthetic_calib, the bench's
layout); then another corpus is ingested without calibrating (multidoc_other, written apart, LangChain's layout),
and its questions are served with the defaults as shipped: `balanced`, shadow checks at their default shares
(shadow.py: 25% while a curve is young, 5% after). Every answer is also compared with a full prefill's greedy answer
(not counted in any check): per window of requests, the mean predicted chance of a differing answer
(fidelity_estimate) against the share that differ, and the shadow checks and refits so far. At the end, the floors
the checks measured on the served corpus (another order, bf16) against the offline floor curves' expectation.

    .venv/bin/python research/online_calibration.py                              # ~19 min, bundled model
    .venv/bin/python research/online_calibration.py --model gemma-3-270m         # Gemma 3 270M
    .venv/bin/python research/online_calibration.py --wrong-by -3 --requests 60  # a curve made wrong on purpose

`--wrong-by N` shifts every calibrated curve's intercept by N nats before serving (its floors and token counts kept,
so the checks weigh it as they weigh a calibrated one): -3 predicts ~20x fewer flips at small chances, the case of a
curve fitted where the reused cache is far better than where it serves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from kvboost_rag import KVBoost
from kvboost_rag.bench.data import bundled, in_orders, load_items
from kvboost_rag.bench.run import render_prompt


def means(rows: list[dict]) -> tuple[float, float]:
    """The mean predicted chance of a differing answer, and the share that differed."""
    return tuple(sum(r[k] for r in rows) / len(rows) for k in ("estimate", "differs"))


def window_row(rows: list[dict], first: int, checks: int, refits: int) -> str:
    predicted, observed = means(rows)
    ratio = f"{predicted / observed:.2f}" if observed else "-"
    return (f"| {first + 1}-{first + len(rows)} | {predicted:.3f} | {observed:.3f} | {ratio} | {checks} | {refits} "
            f"| {sum(r['moved'] for r in rows) / len(rows):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="unset: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--calibration", default=str(bundled("synthetic_calib")))
    parser.add_argument("--calibration-layout", default="bench")
    parser.add_argument("--data", default="research/data/multidoc_other.jsonl")
    parser.add_argument("--layout", default="langchain")
    parser.add_argument("--orders", type=int, default=2, help="each item asked in N document orders")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--wrong-by", type=float, default=0.0, help="nats added to every curve's intercept")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    engine = KVBoost.from_pretrained(args.model, dtype="float32", calibration_layout=args.calibration_layout)
    calibration = load_items(args.calibration)
    engine.ingest(list(dict.fromkeys(d for item in calibration for d in item.documents)), progress=False)
    offline = engine.predictor
    if args.wrong_by:
        def shifted(curve):
            return dataclasses.replace(curve, intercept=curve.intercept + args.wrong_by, others=())
        offline = shifted(offline).with_others([shifted(c) for c in offline.others])
        engine.set_predictor(offline)
    print(f"calibrated offline on {len(engine.documents)} documents of {args.calibration}: {offline.tokens} tokens, "
          f"{offline.flips} flips at budget {offline.budget}", flush=True)
    items = in_orders(load_items(args.data), args.orders)[:args.requests]
    engine.ingest(list(dict.fromkeys(d for item in items for d in item.documents)), progress=False, calibrate=False)
    assert engine.predictor is offline  # the served corpus is not calibrated on: only the checks may refit

    rows = []
    print("| requests | mean P(differs) | differs | predicted / observed | shadow checks so far | refits so far "
          "| moved to a full prefill |\n|---|---|---|---|---|---|---|", flush=True)
    for i, item in enumerate(items):
        messages = render_prompt(item, args.layout)
        served = engine.generate(messages, max_new_tokens=args.tokens, write_back=False)
        engine.shadow.drain()  # a server runs them while idle; here, before the next request's truth is computed
        full = engine.generate(messages, max_new_tokens=args.tokens, strategy="full", write_back=False)
        rows.append({"id": item.id, "estimate": served.fidelity_estimate,
                     "differs": float(served.token_ids != full.token_ids),
                     "moved": float(any(s.step == "full" for s in served.served)),
                     "served": [[s.first_token, s.step, s.budget] for s in served.served],
                     "first_differing": next((k for k, (a, b) in enumerate(zip(served.token_ids, full.token_ids,
                                                                                strict=False)) if a != b), None)})
        if (i + 1) % args.window == 0 or i + 1 == len(items):
            figures = engine.shadow.figures()
            first = i - i % args.window
            print(window_row(rows[first:], first, figures["checks"], figures["refits"]), flush=True)
    for first, last in ((0, 50), (50, len(rows))):  # the rule: within 2x after at most 50 requests
        part = rows[first:last]
        if part:
            predicted, observed = means(part)
            print(f"requests {first + 1}-{first + len(part)}: mean P(differs) {predicted:.3f}, differs {observed:.3f}")
    print("shadow checks:", json.dumps(engine.shadow.figures()))
    floors = engine.shadow.floor_figures(offline)  # the offline curves' expectations are out of sample
    for row in floors:
        print(f"{row['floor']} floor at budget {row['budget']:g}: {row['flips']} of {row['samples']} checked tokens "
              f"differ from full's; the offline curve expected {row['expected_before']:.1f}, the refit one "
              f"{row['expected_now']:.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows,
                                         "shadow": engine.shadow.figures(), "floors": floors}, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
