"""Online calibration (shadow.py) on a tiny random Llama: served answers checked against a full prefill in the
background correct a wrong curve, and never delay a response."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import threading
import time

import pytest
import torch

from kvboost_rag import fidelity, models, shadow
from kvboost_rag.assembly import segments_text
from kvboost_rag.cli import store as store_cli
from kvboost_rag.config import ConfigError, EngineConfig, RepairConfig, StoreConfig
from kvboost_rag.repair.guard import HALF, Judged
from kvboost_rag.shadow import with_curve

TOKENS = 16
BALANCED = 0.07  # the tests that read balanced's curve keep their records balanced (strict_likeness=None)
FAST = RepairConfig(fidelity="fast")  # the same repair, unguarded


def corpus() -> list[str]:
    return [f"{town} is a harbour town of {1000 + 37 * i} people. Its mayor is {name} and its bridge was built "
            f"in {1800 + 11 * i}." for i, (town, name) in enumerate([("Brekkvik", "Ingrid"), ("Osterlund", "Tomas"),
                                                                    ("Dovrino", "Mira"), ("Sarrento", "Edda")])]


def prompts(count: int) -> list[list[dict]]:
    """`count` prompts, each the corpus in another order with another question: what users ask."""
    orders = itertools.islice(itertools.permutations(corpus()), count)
    return [[{"role": "user", "content": "\n\n".join(order) + f"\n\nQuestion: What happened in year {1800 + i}?"}]
            for i, order in enumerate(orders)]


# A deliberately wrong curve: the repaired cache never flips a token, whatever its margin.
NEVER_FLIPS = fidelity.Predictor(-30.0, 0.0, budget=BALANCED)


@pytest.fixture
def engine(make_tiny_engine, tmp_path):
    """Guarded (balanced), every answer checked, the wrong curve in place."""
    engine = make_tiny_engine(EngineConfig(calibrate=False, shadow_share=1.0, shadow_share_young=1.0,
                                           store=StoreConfig(disk_dir=tmp_path)), guarded=True)
    engine.ingest(corpus())
    engine.predictor = NEVER_FLIPS
    yield engine
    engine.close()


def test_checks_of_served_answers_correct_a_wrong_curve_within_a_few_checks(engine, make_tiny_engine, tmp_path):
    checks_needed = math.ceil(fidelity.MIN_TOKENS / TOKENS)  # 2: each check of 16 served tokens refits from there
    served = []
    for i, prompt in enumerate(prompts(checks_needed)):
        served.append(engine.generate(prompt, max_new_tokens=TOKENS, write_back=False))
        assert engine.shadow.drain(timeout=60)
        assert engine.shadow.figures()["refits"] == (1 if i + 1 == checks_needed else 0)
    # Under the wrong curve every token came from the repaired cache, each predicted never to flip.
    assert all(out.generated_tokens == TOKENS and len(out.served) == 1 and out.served[0].step == "repair"
               for out in served)
    figures = engine.shadow.figures()
    assert figures["checks"] == checks_needed and figures["tokens"] == checks_needed * TOKENS
    assert figures["predicted_flips"] < 1e-6 and figures["predicted_differ"] < 1e-6
    # What the checks saw, recomputed here: the repaired cache's greedy tokens against full prefills of each prompt
    # and its answer, teacher-forced.
    flips, margins = 0, []
    for prompt, out in zip(prompts(checks_needed), served, strict=True):
        full = engine.prefill(prompt, "full", max_new_tokens=TOKENS, write_back=False)
        truth = torch.cat([full.logits[None], engine.continuation_logits(full, out.token_ids[:-1])]).argmax(-1)
        cached = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False, repair=FAST)
        logits = torch.cat([cached.logits[None], engine.continuation_logits(cached, out.token_ids[:-1])])  # [T, V]
        flips += int((logits.argmax(-1) != truth).sum())
        margins += [fidelity.margin(row) for row in logits]
    assert figures["observed_flips"] == flips > 0  # this model's repaired cache does flip tokens
    assert figures["observed_differ"] >= 1
    # The refitted curve, judged on the same tokens, predicts about as many flips as were seen.
    curve = engine.predictor.at(BALANCED)
    assert curve.budget == BALANCED and curve.tokens == checks_needed * TOKENS and curve.flips == flips
    assert sum(curve.flip_chance(m) for m in margins) == pytest.approx(flips, abs=0.5)
    # The guard now acts on what it sees: the next request no longer comes from the repair alone.
    after = engine.generate(prompts(checks_needed + 1)[-1], max_new_tokens=TOKENS, write_back=False)
    assert [step.step for step in after.served] != ["repair"]
    # Saved beside the store: the next engine on this folder starts from it.
    again = make_tiny_engine(EngineConfig(calibrate=False, store=StoreConfig(disk_dir=tmp_path)), guarded=True)
    assert again.predictor == engine.predictor


def _store(*argv) -> int:
    """`kvboost-rag store ...`, in this process."""
    parser = argparse.ArgumentParser(prog="kvboost-rag")
    store_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["store", *argv])
    return args.func(args)


def test_store_stats_shows_the_shadow_checks_figures_kept_with_the_curve_they_refit(engine, make_tiny_engine,
                                                                                    tmp_path, capsys):
    """Issue 41: what the checks saw (predicted against observed, per answer and per served token) goes with the curve
    a check refits, in the fidelity file beside the store: `store stats` shows it, and a restarted engine goes on
    counting from it."""
    assert _store("stats", str(tmp_path)) == 0
    assert "observed fidelity: no shadow checks yet" in capsys.readouterr().out  # no curve saved yet
    checks_needed = math.ceil(fidelity.MIN_TOKENS / TOKENS)
    for prompt in prompts(checks_needed):
        engine.generate(prompt, max_new_tokens=TOKENS, write_back=False)
        assert engine.shadow.drain(timeout=60)
    seen = engine.shadow.observed()  # the check before the refit counted in too
    assert engine.shadow.figures()["refits"] == 1 and seen.checks == seen.answers == checks_needed
    assert (seen.tokens, seen.observed_flips, seen.observed_differ) == tuple(
        engine.shadow.figures()[k] for k in ("tokens", "observed_flips", "observed_differ"))
    assert seen.observed_flips > 0 and seen.predicted_flips < 1e-6  # the wrong curve, seen to be wrong
    assert _store("stats", str(tmp_path), "--json") == 0
    assert json.loads(capsys.readouterr().out)["observed_fidelity"] == {engine.fidelity_path.name: seen.figures()}
    assert _store("stats", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert f"observed fidelity ({engine.fidelity_path.name}): {checks_needed} shadow checks" in out
    assert (f"served tokens that flip: predicted {seen.predicted_flips:.2f} of {seen.tokens} (0.000), observed "
            f"{seen.observed_flips} ({seen.observed_flips / seen.tokens:.3f}), predicted/observed 0.000") in out
    engine.close()
    # Restarted on the same folder: the curve comes back with its figures, and the next refit adds the new checks.
    again = make_tiny_engine(EngineConfig(calibrate=False, shadow_share=1.0, shadow_share_young=1.0,
                                          store=StoreConfig(disk_dir=tmp_path)), guarded=True)
    assert again.predictor.observed == seen
    again.predictor = dataclasses.replace(NEVER_FLIPS, observed=again.predictor.observed)  # the same answers again
    for prompt in prompts(2 * checks_needed)[checks_needed:]:
        again.generate(prompt, max_new_tokens=TOKENS, write_back=False)
        assert again.shadow.drain(timeout=60)
    assert again.shadow.figures()["refits"] == 1 and again.shadow.observed().checks == checks_needed
    saved = fidelity.from_bytes(again.fidelity_path.read_bytes(), again.fingerprint)
    assert saved.observed == seen + again.shadow.observed() and saved.observed.checks == 2 * checks_needed
    again.close()


CHECK_S = 1.5  # a check made slow on purpose: one run inline would add this to a response


def test_shadow_checks_never_delay_a_response(engine, monkeypatch):
    real = engine.shadow._tops

    def slow(check):  # slower than any response here; outside the lock, as a long check between its layers is
        time.sleep(CHECK_S)
        return real(check)

    monkeypatch.setattr(engine.shadow, "_tops", slow)
    asked = prompts(7)
    engine.shadow.share = engine.shadow.young_share = 0.0
    for prompt in asked[:2]:  # warm up: the first calls of a process are slower
        engine.generate(prompt, max_new_tokens=4, write_back=False)

    def serve(prompt) -> tuple[float, float]:
        started = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=4, write_back=False)
        return out.ttft_ms, (time.perf_counter() - started) * 1e3

    off = [serve(prompt) for prompt in asked[2:4]]
    engine.shadow.share = engine.shadow.young_share = 1.0
    on = [serve(prompt) for prompt in asked[4:7]]
    assert engine.shadow.figures()["checks"] < 3  # they run later, in the background
    assert max(total for _, total in on) < CHECK_S * 1e3 / 2  # no response waited for a check
    assert statistics.median(t for t, _ in on) < statistics.median(t for t, _ in off) + CHECK_S * 1e3 / 3
    assert engine.shadow.drain(timeout=60) and engine.shadow.figures()["checks"] == 3  # and they did run


def test_a_check_leaves_the_gap_between_a_clients_requests_alone(engine, monkeypatch):
    """A client's next request follows its answer within its preparation (rendering, tokenizing, planning: tens of
    ms); a check that took the engine in that gap made the request wait for one of its layers. Checks wait until
    the engine has been idle for shadow.QUIET_S (widened here, so that a loaded host cannot close the gap)."""
    monkeypatch.setattr(shadow, "QUIET_S", 0.5, raising=False)
    forwards = []  # (run by a thread other than the requests', when) for each forward
    run_layers, plan = engine.adapter.run_layers, engine.plan

    def logged(*args, **kwargs):
        forwards.append((threading.current_thread() is not threading.main_thread(), time.perf_counter()))
        return run_layers(*args, **kwargs)

    def prepared_slowly(*args, **kwargs):  # as a long prompt's preparation takes
        time.sleep(0.03)
        return plan(*args, **kwargs)

    monkeypatch.setattr(engine.adapter, "run_layers", logged)
    monkeypatch.setattr(engine, "plan", prepared_slowly)
    for prompt in prompts(4):  # back to back, each checked
        engine.generate(prompt, max_new_tokens=4, write_back=False)
    served = time.perf_counter()
    assert engine.shadow.drain(timeout=60) and engine.shadow.figures()["checks"] == 4
    checks = [when for background, when in forwards if background]
    assert checks and min(checks) > served  # none in the gaps, all after the last answer


def test_only_a_share_is_checked_and_a_full_queue_drops(make_tiny_engine):
    engine = make_tiny_engine(EngineConfig(calibrate=False, shadow_share=0.0, shadow_share_young=1.0,
                                           shadow_queue=1), guarded=True)
    engine.ingest(corpus())
    young = fidelity.Predictor(-30.0, 0.0, budget=BALANCED)
    grown = fidelity.Predictor(-30.0, 0.0, tokens=10_000, budget=BALANCED)
    engine.predictor = grown  # fitted on many tokens: the share, 0 here
    engine.generate(prompts(1)[0], max_new_tokens=2, write_back=False)
    assert engine.shadow.drain(timeout=60) and engine.shadow.figures()["checks"] == 0
    engine.predictor = young  # young: the young share, every request
    engine.lock.__enter__()  # the engine busy: the first check waits for it, the second in the queue, the third
    try:                       # finds the queue full
        for prompt in prompts(4)[1:]:
            engine.generate(prompt, max_new_tokens=2, write_back=False)
        assert engine.shadow.figures()["dropped"] == 1 and engine.shadow.figures()["checks"] == 0
    finally:
        engine.lock.__exit__(None, None, None)
    assert engine.shadow.drain(timeout=60) and engine.shadow.figures()["checks"] == 2
    engine.close()


def test_a_refit_curve_replaces_its_budgets_and_keeps_the_rest():
    main = fidelity.Predictor(0.0, -2.0, 128, 10, documents=40, budget=0.07)
    strict = fidelity.Predictor(0.5, -2.0, 128, 9, documents=40, budget=0.15)
    both = main.with_others([strict])
    new = fidelity.Predictor(-1.0, -3.0, 64, 4, budget=0.15)
    replaced = with_curve(both, new)
    assert replaced.at(0.07) == main.with_others([new]) and replaced.at(0.15) == new
    again = with_curve(both, fidelity.Predictor(-1.0, -3.0, 64, 4, budget=0.07))
    assert again.intercept == -1.0 and again.documents == 40 and again.others == (strict,)
    added = with_curve(fidelity.DEFAULT_PREDICTOR, new)
    assert added.at(0.0) == fidelity.DEFAULT_PREDICTOR.with_others([new]) and added.at(0.2) == new


@pytest.mark.parametrize("field,value", [("shadow_share", 1.5), ("shadow_share", math.nan),
                                         ("shadow_share_young", -0.1), ("shadow_queue", 0)])
def test_shadow_settings_are_checked(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})


def test_an_online_refit_keeps_the_floors_its_level_is_held_to():
    """A refit of the request's own curve keeps the order and dtype floors' curves at that budget (else balanced would
    fall back to a fixed 15% after the first refit); the floors are refit from their own samples (below)."""
    from dataclasses import replace

    floors = (fidelity.Predictor(0.5, -1.0, 64, 20, 40, 0.07), fidelity.Predictor(-3.0, -1.0, 64, 1, 40, 0.07))
    main = replace(fidelity.Predictor(0.0, -2.0, 64, 10, 40, 0.07), floors=floors)
    predictor = main.with_others([fidelity.Predictor(0.0, -2.5, 64, 8, 40, 0.15)])
    refit = with_curve(predictor, fidelity.Predictor(1.0, -1.5, 40, 12, 0, 0.07))
    assert (refit.intercept, refit.slope, refit.documents) == (1.0, -1.5, 40) and refit.floors == floors
    assert fidelity.target_for("balanced", refit.at(0.07)) == floors[0]


def test_the_share_is_checked_evenly_from_the_first_request(make_tiny_engine):
    """25% of the guarded requests: the first, the fifth, the ninth; not a random draw, which can skip many in a row
    (the old seeded draw checked none of an engine's first 25)."""
    engine = make_tiny_engine(EngineConfig(calibrate=False, shadow_share=0.0, shadow_share_young=0.25), guarded=True)
    engine.ingest(corpus())
    engine.predictor = fidelity.Predictor(-30.0, 0.0, budget=BALANCED)  # young
    checked = []
    for i, prompt in enumerate(prompts(9)):
        engine.generate(prompt, max_new_tokens=2, write_back=False)
        assert engine.shadow.drain(timeout=60)
        if engine.shadow.figures()["checks"] > len(checked):
            checked.append(i + 1)
    assert checked == [1, 5, 9]
    engine.close()


def test_a_curve_calibrated_on_many_tokens_is_moved_part_of_the_way_by_a_few_checks(make_tiny_engine):
    """The wrong curve of the test above, but as if calibrated on 10,000 tokens: two checks refit it with it as the
    prior (fidelity.fit), so it still says flips are rare, where replaced it would follow the 32 new samples."""
    engine = make_tiny_engine(EngineConfig(calibrate=False, shadow_share=1.0, shadow_share_young=1.0,
                                           strict_likeness=None), guarded=True)
    engine.ingest(corpus())
    engine.predictor = dataclasses.replace(NEVER_FLIPS, tokens=10_000)
    checks_needed = math.ceil(fidelity.MIN_TOKENS / TOKENS)
    for prompt in prompts(checks_needed):
        engine.generate(prompt, max_new_tokens=TOKENS, write_back=False)
        assert engine.shadow.drain(timeout=60)
    figures = engine.shadow.figures()
    assert figures["refits"] == 1 and figures["observed_flips"] > 0
    curve = engine.predictor.at(BALANCED)
    assert curve.tokens == 10_000 + checks_needed * TOKENS and curve.flips == figures["observed_flips"]
    alone = fidelity.fit(*zip(*engine.shadow.samples[BALANCED], strict=True))
    assert curve.flip_chance(0.5) < alone.flip_chance(0.5) / 2
    # Refit again: the prior is still the calibrated curve, not the refit one (its samples would count twice).
    engine.generate(prompts(checks_needed + 1)[-1], max_new_tokens=TOKENS, write_back=False)
    assert engine.shadow.drain(timeout=60) and engine.shadow.figures()["refits"] == 2
    assert engine.predictor.at(BALANCED).tokens == 10_000 + (checks_needed + 1) * TOKENS
    # A curve the corpus calibration fits meanwhile (the corpus doubled, say) is the prior from then on.
    engine.predictor = dataclasses.replace(NEVER_FLIPS, tokens=20_000)
    engine.generate(prompts(checks_needed + 2)[-1], max_new_tokens=TOKENS, write_back=False)
    assert engine.shadow.drain(timeout=60) and engine.shadow.figures()["refits"] == 3
    assert engine.predictor.at(BALANCED).tokens == 20_000 + (checks_needed + 2) * TOKENS
    engine.close()


def test_a_budget_first_judged_after_a_refit_is_refit_from_its_own_curve(make_tiny_engine):
    """A refit hands the engine every budget's curve; a later check whose answer escalated to a budget no check had
    judged before refits that budget too, from the curve the engine had there (it once failed with KeyError)."""
    engine = make_tiny_engine(EngineConfig(calibrate=False), guarded=True)
    larger = 0.3
    engine.predictor = NEVER_FLIPS.with_others([dataclasses.replace(NEVER_FLIPS, budget=larger)])

    def check(budget: float) -> shadow.Check:
        judged = tuple(Judged(i, budget, 0.5, 1e-13, 1, True) for i in range(fidelity.MIN_TOKENS))
        return shadow.Check(torch.zeros(4, dtype=torch.long), tuple([1] * fidelity.MIN_TOKENS), judged, 0.0)

    full_flips_every_token = torch.zeros(fidelity.MIN_TOKENS + 1, dtype=torch.long)  # full's token 0, served 1
    engine.shadow._learn(check(BALANCED), full_flips_every_token)
    engine.shadow._learn(check(larger), full_flips_every_token)
    assert engine.shadow.counters["refits"] == 2
    for budget in (BALANCED, larger):
        assert engine.predictor.at(budget).budget == budget and engine.predictor.at(budget).flip_chance(0.5) > 0.5
    engine.close()


@pytest.mark.skipif(not models.native_matmuls(torch.bfloat16, torch.device("cpu")),
                    reason="this CPU emulates bf16: the ladder has no HALF step here")
def test_checks_of_bf16_prefills_answers_correct_that_steps_wrong_curve(make_tiny_engine, tmp_path):
    """A `strict` request no repair serves is served by the bf16 full prefill (guard.HALF), judged by its own curve;
    here a wrong one, a flip at every other token. The checks' samples of it refit that curve, not a budget's,
    to the flips they saw, and the curve is saved with the rest."""
    engine = make_tiny_engine(EngineConfig(calibrate=False, shadow_share=1.0, shadow_share_young=1.0,
                                           ladder_costs=False, store=StoreConfig(disk_dir=tmp_path)), guarded=True)
    engine.ingest(corpus())
    wrong = fidelity.Predictor(0.0, 0.0, budget=1.0)  # 50% at every margin
    always = fidelity.Predictor(30.0, 0.0, budget=BALANCED)  # no repair trusted
    never = fidelity.Predictor(-30.0, 0.0, budget=BALANCED)
    engine.predictor = dataclasses.replace(always, floors=(never, never), half=wrong)
    strict = RepairConfig(fidelity="strict")
    checks_needed = math.ceil(fidelity.MIN_TOKENS / TOKENS)
    served = [engine.generate(p, max_new_tokens=TOKENS, write_back=False, repair=strict)
              for p in prompts(checks_needed)]
    assert engine.shadow.drain(timeout=60)
    assert all(out.served[0].step == HALF and len(out.served) == 1 and out.generated_tokens == TOKENS
               for out in served)  # the wrong curve's 50% is strict's own floor there: trusted
    # Its judgments are samples of its own curve (a repair's refused first tokens, of their budgets'), and the
    # refit curve expects on them the flips the checks counted, where the wrong one expected half of them.
    samples = engine.shadow.samples[HALF]
    flips = sum(flip for _, flip in samples)
    assert len(samples) == checks_needed * TOKENS and flips == engine.shadow.figures()["observed_flips"]
    half = engine.predictor.half
    assert half.tokens == len(samples) and half.flips == flips and engine.shadow.figures()["refits"] == 1
    assert sum(half.flip_chance(m) for m, _ in samples) == pytest.approx(flips, abs=0.5)
    assert abs(sum(wrong.flip_chance(m) for m, _ in samples) - flips) > 5
    assert (engine.predictor.intercept, engine.predictor.slope) == (always.intercept, always.slope)  # not refit
    again = make_tiny_engine(EngineConfig(calibrate=False, store=StoreConfig(disk_dir=tmp_path)), guarded=True)
    assert again.predictor.half == half


def _reversed_prompt(prompt: list[dict]) -> list[dict]:
    """The same user message with its documents in reverse order: what the order floor answers."""
    *documents, question = prompt[0]["content"].split("\n\n")
    return [{"role": "user", "content": "\n\n".join([*documents[::-1], question])}]


def test_checks_refit_the_floors_from_what_users_ask(make_tiny_engine, tmp_path):
    """The floors a level is held to are measured on the served requests too: each check also runs the documents in
    reverse order (and the model in bf16, where the engine has the HALF step's), teacher-forced along the served
    answer, and refits the floors' curves at the request's budget. Here both floors are wrong on purpose (another
    order changes 1 token in 21 whatever the margin); the refit order floor expects the changes a full prefill of the
    reversed prompt makes, counted here apart from the checks; the checks' figures hold the wrong curve's
    predictions (made before the refit) against those changes."""
    engine = make_tiny_engine(EngineConfig(calibrate=False, shadow_share=1.0, shadow_share_young=1.0,
                                           store=StoreConfig(disk_dir=tmp_path), strict_likeness=None), guarded=True)
    engine.ingest(corpus())
    planned = engine.plan(prompts(1)[0], "full")  # the text the check lays out again, documents found in it
    assert segments_text(planned.segments) == engine.render(prompts(1)[0])
    assert sum(not isinstance(s, str) for s in planned.segments) == len(corpus())
    rare = fidelity.Predictor(-3.0, 0.0, budget=BALANCED)  # no prior weight (tokens 0): the samples decide
    engine.predictor = wrong = dataclasses.replace(NEVER_FLIPS, floors=(rare, rare))
    checks_needed = math.ceil(fidelity.MIN_TOKENS / TOKENS)
    served = [engine.generate(p, max_new_tokens=TOKENS, write_back=False) for p in prompts(checks_needed)]
    assert engine.shadow.drain(timeout=120) and engine.shadow.figures()["refits"] == 1
    assert all(len(out.served) == 1 and out.served[0].step == "repair" for out in served)
    changed, margins = 0, []
    for prompt, out in zip(prompts(checks_needed), served, strict=True):
        tops = []
        for asked in (prompt, _reversed_prompt(prompt)):
            full = engine.prefill(asked, "full", max_new_tokens=TOKENS, write_back=False)
            tops.append(torch.cat([full.logits[None], engine.continuation_logits(full, out.token_ids[:-1])]).argmax(-1))
        changed += int((tops[0] != tops[1]).sum())
        cached = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False, repair=FAST)
        margins += [fidelity.margin(row) for row in
                    torch.cat([cached.logits[None], engine.continuation_logits(cached, out.token_ids[:-1])])]
    samples = engine.shadow.samples[("order", BALANCED)]
    assert [m for m, _ in samples] == pytest.approx(margins, abs=1e-4) and sum(f for _, f in samples) == changed > 0
    order, dtype = engine.predictor.at(BALANCED).floors
    assert order.tokens == checks_needed * TOKENS and order.flips == changed
    assert sum(order.flip_chance(m) for m in margins) == pytest.approx(changed, abs=0.5)
    assert fidelity.target_for("balanced", engine.predictor.at(BALANCED)) == order
    # Reported against the curve they were held to before (what the bench and research/online_calibration.py show)
    row = next(r for r in engine.shadow.floor_figures(wrong) if r["floor"] == "order")
    assert (row["budget"], row["samples"], row["flips"]) == (BALANCED, checks_needed * TOKENS, changed)
    assert row["expected_before"] == pytest.approx(len(margins) * rare.flip_chance(0.0))
    assert row["expected_now"] == pytest.approx(changed, abs=0.5)
    # Predicted against observed per floor, as /metrics and `store stats` show them: out of sample (the curve before)
    floor_figures = engine.shadow.figures()["floors"]["order"]
    assert (floor_figures["tokens"], floor_figures["observed_flips"]) == (checks_needed * TOKENS, changed)
    assert floor_figures["predicted_flips"] == pytest.approx(row["expected_before"])
    assert engine.predictor.observed.figures()["floors"]["order"] == floor_figures  # saved with the curve
    # The main curve was refit from the same checks, and kept apart from its floors.
    assert engine.predictor.at(BALANCED).flips == engine.shadow.figures()["observed_flips"]
    if engine.half_adapter() is not None:  # bf16 native here: the dtype floor's samples, fitted likewise
        dtype_flips = sum(f for _, f in engine.shadow.samples[("dtype", BALANCED)])
        assert dtype.tokens == checks_needed * TOKENS and dtype.flips == dtype_flips
        assert engine.shadow.figures()["floors"]["dtype"]["observed_flips"] == dtype_flips
    else:
        assert dtype == rare and engine.shadow.figures()["floors"]["dtype"]["tokens"] == 0
    again = make_tiny_engine(EngineConfig(calibrate=False, store=StoreConfig(disk_dir=tmp_path)), guarded=True)
    assert again.predictor.at(BALANCED).floors == (order, dtype)
    engine.close()


def test_a_check_of_one_document_or_no_floors_runs_no_floor(make_tiny_engine):
    """No other order for a single document; no floors to refit for an uncalibrated curve: the check runs full only."""
    engine = make_tiny_engine(EngineConfig(calibrate=False, shadow_share=1.0, shadow_share_young=1.0), guarded=True)
    engine.ingest(corpus())
    one = [{"role": "user", "content": corpus()[0] + "\n\nQuestion: Who is the mayor?"}]
    engine.predictor = dataclasses.replace(NEVER_FLIPS, floors=(NEVER_FLIPS, NEVER_FLIPS))
    engine.generate(one, max_new_tokens=TOKENS, write_back=False)
    engine.predictor = NEVER_FLIPS
    engine.generate(prompts(1)[0], max_new_tokens=TOKENS, write_back=False)
    assert engine.shadow.drain(timeout=60) and engine.shadow.figures()["checks"] == 2
    assert ("order", BALANCED) not in engine.shadow.samples
    assert len(engine.shadow.samples.get(("dtype", BALANCED), ())) in (0, TOKENS)  # the first, where bf16 runs
    engine.close()
