"""Which fit of the flip curves holds on held-out questions when calibration saw few flips (issue 41, item 2).

The curves are fitted per recompute budget on ~200 calibration tokens each. On Gemma 3 270M the 0.3 budget's
calibration sees almost no flips, and its curve predicts 0.4 flips over 480 held-out tokens where 15 happen (the
"young curve", docs/method.md). This script keeps what calibration fitted on (its margins and flips per budget,
captured as `ingest` calibrates the corpus as shipped) and, on held-out items, each budget's margins and flips
(step_agreement.measure: the repair teacher-forced on a full prefill's answer), then scores fits side by side:
predicted flips over the held-out tokens against observed, per budget, and the log loss. "shipped" is what
calibration fits since (fidelity.fit's pseudo_flips); the others were tried beside it (docs/method.md).

    .venv/bin/python research/curve_fits.py --model gemma-3-270m --limit 30 --json out/g49/fits_gemma.json
    .venv/bin/python research/curve_fits.py --score out/g49/fits_gemma.json
"""

import dataclasses
import math

import torch
from step_agreement import BUDGETS, measure, probe
from tqdm import tqdm

from kvboost_rag import KVBoost, calibrate, fidelity
from kvboost_rag.bench.data import load_items


def collect(args) -> dict:
    captured = {}
    flips = calibrate._flips

    def recording(engine, prompts, answers, budget, bar):
        margins, flipped = flips(engine, prompts, answers, budget, bar)
        captured[str(budget)] = {"margin": margins, "flip": flipped}
        return margins, flipped

    items = load_items(args.data, limit=args.skip + args.limit)[args.skip:]
    engine = KVBoost.from_pretrained(args.model, dtype="float32")
    calibrate._flips = recording
    try:
        engine.ingest([d for item in items for d in item.documents])
    finally:
        calibrate._flips = flips
    rows = [measure(engine, item, args.tokens) for item in tqdm(items, desc="items")]
    held = {}
    for budget in BUDGETS[1:]:
        key = str(budget)
        held[key] = {"margin": [m for r in rows for m in r["budgets"][key]["margin"]],
                     "flip": [t != a for r in rows for t, a in zip(r["budgets"][key]["top"], r["answer"], strict=True)]}
    return {"model": engine.model_id, "data": args.data, "calibration": captured, "held_out": held}


def score(found: dict) -> None:
    budgets = sorted(found["held_out"], key=float)
    for name, fitter in FITS.items():
        cells = []
        for budget in budgets:
            curve = fitter(found["calibration"], budget)
            held = found["held_out"][budget]
            p = [min(max(curve(m), 1e-9), 1 - 1e-9) for m in held["margin"]]
            loss = -sum(math.log(q if f else 1 - q) for q, f in zip(p, held["flip"], strict=True)) / len(p)
            cells.append(f"{budget}: {sum(p):5.1f}/{sum(held['flip']):3d} ll {loss:.3f}")
        print(f"{name:10s} " + " | ".join(cells))
    for budget in budgets:
        cal = found["calibration"][budget]
        print(f"calibration {budget}: {sum(cal['flip'])} flips / {len(cal['flip'])}")


def point(calibration, budget):
    cal = calibration[budget]
    return fidelity.fit(cal["margin"], cal["flip"]).flip_chance


def _hessian(curve, margins):
    """The fit's penalized log-likelihood curvature at its optimum (fidelity.fit's ridge): its inverse is the
    Laplace posterior's covariance of (intercept, slope)."""
    x = torch.tensor(margins, dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    p = torch.sigmoid(design @ torch.tensor([curve.intercept, curve.slope], dtype=torch.float64))
    return design.T @ (design * (p * (1 - p))[:, None]) + 1e-2 * torch.eye(2, dtype=torch.float64)


def laplace(calibration, budget):
    """The posterior predictive under the Laplace approximation (MacKay's probit moderation)."""
    cal = calibration[budget]
    curve = fidelity.fit(cal["margin"], cal["flip"])
    cov = torch.linalg.inv(_hessian(curve, cal["margin"]))

    def chance(m):
        v = torch.tensor([1.0, m], dtype=torch.float64)
        mu, var = curve.intercept + curve.slope * m, float(v @ cov @ v)
        return 1 / (1 + math.exp(-mu / math.sqrt(1 + math.pi * var / 8)))
    return chance


def pooled(calibration, budget, share=1.0):
    """Each budget's curve with every budget's samples as its prior, counted as `share` of its own tokens."""
    every = [(m, f) for cal in calibration.values() for m, f in zip(cal["margin"], cal["flip"], strict=True)]
    margins, flipped = zip(*every, strict=True)
    prior = fidelity.fit(margins, flipped)
    cal = calibration[budget]
    prior = dataclasses.replace(prior, tokens=int(share * len(cal["margin"])))
    return fidelity.fit(cal["margin"], cal["flip"], prior=prior).flip_chance


def cautious_below(calibration, budget):
    """A budget's curve fitted on its own samples and every smaller budget's (never surer than those)."""
    cals = [cal for b, cal in calibration.items() if float(b) <= float(budget)]
    return fidelity.fit([m for c in cals for m in c["margin"]], [f for c in cals for f in c["flip"]]).flip_chance


def succession(calibration, budget, extra=fidelity.PSEUDO_FLIPS):
    """What calibration ships: the fit raised until it expects `extra` more flips on its samples than they hold."""
    cal = calibration[budget]
    return fidelity.fit(cal["margin"], cal["flip"], pseudo_flips=extra).flip_chance


FITS = {"point": point, "laplace": laplace, "pooled": pooled,
        "pooled.5": lambda c, b: pooled(c, b, 0.5), "pooled2": lambda c, b: pooled(c, b, 2.0),
        "below": cautious_below, "shipped": succession, "plus3": lambda c, b: succession(c, b, 3.0)}


def main() -> None:
    probe(collect, score)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
