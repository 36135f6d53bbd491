"""What the ladder's HALF step's tokens should be judged by (issue 41, item 2).

The HALF step serves a request from a bf16 full prefill of its prompt (and answer so far), decoding on in float32
from that prefill's K/V. Until fidelity VERSION 6 its tokens were judged by the dtype floor's curve: the chance that
a bf16 full prefill (bf16 throughout) picks another token than a float32 one, fitted against the *reused cache's*
margins at the request's budget, as measured (it is `strict`'s allowance too, so it has no pseudo-flip), and read at
the HALF step's own margin. On Gemma 3 270M, fidelity_holdout 49-72, that estimate was 10x low (0.016 against 0.167
differing answers). Since, the step has a curve of its own (fidelity.Predictor.half): fitted on what the step serves
(calibrate._half_steps: its margins and flips, teacher-forced on a float32 full prefill's answer), as measured (one
pseudo-flip, like the repairs' curves, doubled its estimate where calibration saw one flip: this probe), but raised
to expect at least half the flips bf16 throughout made on the same tokens (fitted plain on none where bf16 made
three, it predicted a twentieth of SmolLM2's differing answers on fidelity_holdout 1-24), refit by the shadow
checks.

This probe keeps what calibration fits on (captured as `ingest` calibrates the corpus as shipped), and on held-out
items the HALF step's margins and flips, teacher-forced on a float32 full prefill's answer, then scores the
candidates side by side: predicted flips over the held-out tokens against observed, the log loss, and the mean
predicted chance that an answer differs (1 - prod(1 - p) over its tokens) against the share of answers with a flip.

    .venv/bin/python research/half_curve.py --model gemma-3-270m --data research/data/fidelity_holdout.jsonl \
        --skip 48 --limit 24 --json out/g50/half_gemma_fh.json
"""

import math

import torch
from step_agreement import probe
from tqdm import tqdm

from kvboost_rag import KVBoost, calibrate, fidelity
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.generation import SamplingParams


def collect(args) -> dict:
    """Calibration's samples (the dtype floor's flips, the reused cache's margins at each budget, the HALF step's
    margins and flips), then the held-out items' HALF step margins and flips."""
    captured = {"budgets": {}}
    floor_flips, flips = calibrate._floor_flips, calibrate._flips

    def floors(engine, drawn, prompt_ids, answers, bar):
        found = floor_flips(engine, drawn, prompt_ids, answers, bar)
        captured["order"], captured["dtype"], (captured["half_margin"], captured["half_flip"]) = found
        captured["bf16_margin"] = bf16_margins(engine, prompt_ids, answers)
        return found

    def reused(engine, prompts, answers, budget, bar):
        margins, flipped = flips(engine, prompts, answers, budget, bar)
        captured["budgets"][str(budget)] = margins
        return margins, flipped

    items = load_items(args.data, limit=args.skip + args.limit)[args.skip:]
    engine = KVBoost.from_pretrained(args.model, dtype="float32")
    calibrate._floor_flips, calibrate._flips = floors, reused
    try:
        engine.ingest([d for item in items for d in item.documents])
    finally:
        calibrate._floor_flips, calibrate._flips = floor_flips, flips
    half = engine.half_adapter()
    if half is None:
        raise SystemExit("this engine has no bf16 step (bf16 is emulated here): nothing to probe")
    held = []
    for item in tqdm(items, desc="items"):
        prompt = render_prompt(item)
        pre = engine.prefill(prompt, "full", max_new_tokens=args.tokens, write_back=False)
        answer = list(list(engine.stream_from(pre, SamplingParams(max_new_tokens=args.tokens)))[-1].result.token_ids)
        if answer:
            margins, flipped = calibrate._half_steps(engine, half, pre.plan.token_ids, answer)
            held.append({"id": item.id, "margin": margins, "flip": flipped})
    return {"model": engine.model_id, "data": args.data, "skip": args.skip, "calibration": captured,
            "held_out": held}


def bf16_margins(engine, prompt_ids, answers) -> list[float]:
    """The margins of a bf16 full prefill throughout (the dtype floor's own), at the floors' steps: what the first
    version of the step's curve was fitted on, with the dtype floor's flips."""
    model, margins = engine.half_adapter().model, []
    for ids, answer in zip(prompt_ids, answers, strict=True):
        if answer:
            forward = torch.cat([ids, torch.tensor(answer[:-1], dtype=torch.long)])
            logits = model(input_ids=forward[None], use_cache=False).logits[0, ids.shape[0] - 1:]
            margins += [fidelity.margin(row) for row in logits]
    return margins


def candidates(cal: dict) -> dict:
    """Each candidate curve, as a flip chance of the HALF step's own margin."""
    margins, flips = cal["half_margin"], cal["half_flip"]
    found = {f"dtype floor at {b} (before)": fidelity.fit(reused, cal["dtype"]).flip_chance
             for b, reused in sorted(cal["budgets"].items(), key=lambda kv: float(kv[0]))[:2]}
    found["bf16 throughout, one pseudo-flip (tried first)"] = fidelity.fit(cal["bf16_margin"], cal["dtype"],
                                                                           pseudo_flips=1.0).flip_chance
    found["own, plain (before)"] = fidelity.fit(margins, flips).flip_chance
    found["own, one pseudo-flip"] = fidelity.fit(margins, flips, pseudo_flips=1.0).flip_chance
    found["own, one pseudo-flip where it saw none"] = fidelity.fit(margins, flips,
                                                                   pseudo_flips=0.0 if any(flips) else 1.0).flip_chance
    found["own, raised to half bf16's flips (shipped)"] = calibrate.fit_half(margins, flips, cal["dtype"]).flip_chance
    found["own, three pseudo-flips"] = fidelity.fit(margins, flips, pseudo_flips=3.0).flip_chance
    return found


def score(found: dict) -> None:
    cal, held = found["calibration"], found["held_out"]
    flips = sum(f for row in held for f in row["flip"])
    tokens = sum(len(row["flip"]) for row in held)
    differ = sum(any(row["flip"]) for row in held) / len(held)
    print(f"{found['model']} on {found['data']} (skip {found.get('skip', 0)}): calibration {sum(cal['dtype'])} bf16 "
          f"flips and {sum(cal['half_flip'])} HALF step flips in {len(cal['dtype'])} tokens; held out {flips} in "
          f"{tokens} tokens, {differ:.3f} of {len(held)} answers with one")
    print("| curve | predicted flips / observed | log loss | P(differs) / differs |\n|---|---|---|---|")
    for name, chance in candidates(cal).items():
        loss, predicted, risk = 0.0, 0.0, 0.0
        for row in held:
            p = [min(max(chance(m), 1e-9), 1 - 1e-9) for m in row["margin"]]
            loss -= sum(math.log(q if f else 1 - q) for q, f in zip(p, row["flip"], strict=True))
            predicted += sum(p)
            risk += 1 - math.prod(1 - q for q in p)
        print(f"| {name} | {predicted:.1f} / {flips} | {loss / tokens:.3f} | {risk / len(held):.3f} / {differ:.3f} |")


def main() -> None:
    probe(collect, score)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
