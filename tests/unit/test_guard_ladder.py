"""The guard's ladder (repair/guard.py) on a tiny random Llama: escalation to a larger budget, the full prefill last,
and the report of which step served which tokens.

The flip curves are set, not fitted: a curve with slope 0 gives every token the same flip chance, so a test decides
which steps the guard trusts; the caches, logits and answers are the model's own. The corpus is records of one
template, which `balanced` holds to `strict` (test_likeness.py): the engines of balanced's own tests keep it
(strict_likeness=None)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time

import pytest
import torch

from kvboost_rag import calibrate, fidelity, models
from kvboost_rag.assembly import APPROX
from kvboost_rag.config import ConfigError, EngineConfig, RepairConfig
from kvboost_rag.repair import guard, routes
from kvboost_rag.repair.guard import ESCALATE, FULL, HALF, REPAIR, Served


def corpus() -> list[str]:
    return [f"{town} is a harbour town of {1000 + 37 * i} people. Its mayor is {name} and its bridge was built "
            f"in {1800 + 11 * i}." for i, (town, name) in enumerate([("Brekkvik", "Ingrid"), ("Osterlund", "Tomas"),
                                                                    ("Dovrino", "Mira"), ("Sarrento", "Edda")])]


def prompt_of(docs: list[str]) -> list[dict]:
    return [{"role": "user", "content": "\n\n".join(docs) + "\n\nQuestion: Who is the mayor of Dovrino?"}]

TOKENS = 8
BALANCED, STRICT = RepairConfig().budget, RepairConfig(fidelity="strict").budget


def constant(chance: float, budget: float = 0.0) -> fidelity.Predictor:
    """A curve that gives every token this flip chance, whatever its margin."""
    return fidelity.Predictor(math.log(chance / (1 - chance)), 0.0, budget=budget)


NEVER = 1e-20  # a flip chance every target allows
ALWAYS = 1 - 1e-12  # one no target allows


@pytest.fixture
def engine(make_tiny_engine):
    """A guarded engine (balanced) over the corpus, not calibrated: each test sets its curves."""
    engine = make_tiny_engine(EngineConfig(calibrate=False, strict_likeness=None), guarded=True)
    engine.ingest(corpus())
    return engine


@pytest.fixture
def prompt(engine):
    prompt = prompt_of(corpus()[::-1])
    assert engine.plan(prompt, "cacheblend").count(APPROX) > 0  # content hits: a guarded request that escalates
    return prompt


def fast(ratio: float) -> RepairConfig:
    """Unguarded, at this budget: what a step of the ladder repairs."""
    return RepairConfig(fidelity="fast", recompute_ratio=ratio)


def test_the_ladders_budgets():
    ceiling = EngineConfig().escalate_to
    assert guard.escalations(RepairConfig(), ceiling) == (STRICT, ceiling)  # balanced: strict's budget, the ceiling
    assert guard.escalations(RepairConfig(fidelity="strict"), ceiling) == (ceiling,)
    assert guard.escalations(RepairConfig(), 0.0) == ()
    assert guard.escalations(RepairConfig(recompute_ratio=0.5), ceiling) == ()  # already above the ceiling
    assert guard.escalations(RepairConfig(recompute_ratio=0.1), 0.2) == (STRICT, 0.2)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ConfigError, match="escalate_to"):
            EngineConfig(escalate_to=bad)


def test_a_ladder_that_reaches_a_full_prefill_answers_exactly_as_full(engine, prompt):
    engine.predictor = constant(ALWAYS)  # no step is trusted, at any budget
    guarded = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False)
    full = engine.generate(prompt, max_new_tokens=TOKENS, strategy="full", write_back=False)
    assert guarded.token_ids == full.token_ids
    n = guarded.prompt_tokens
    assert guarded.served == (Served(0, FULL, 1.0, n),)
    assert guarded.fell_back and guarded.exact_from == 0 and guarded.recompute_budget == 1.0
    assert guarded.fidelity_estimate == 0.0
    pre = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False)
    assert torch.equal(pre.logits, engine.prefill(prompt, "full", write_back=False).logits)


def test_a_first_token_refused_at_the_requests_budget_is_served_by_a_larger_repair(engine, prompt):
    engine.predictor = constant(ALWAYS, BALANCED).with_others([constant(NEVER, STRICT)])
    pre = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False)
    own = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False, repair=fast(BALANCED))
    larger = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False, repair=fast(STRICT))
    assert pre.served == (Served(0, ESCALATE, STRICT, larger.recomputed_tokens),)
    assert pre.recomputed_tokens == larger.recomputed_tokens > own.recomputed_tokens  # run at the larger budget
    assert not pre.fell_back and pre.recompute_budget == STRICT
    assert torch.equal(pre.logits, larger.logits)  # the same plan, repaired at strict's budget
    assert not torch.equal(pre.logits, own.logits)
    out = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False)
    assert out.token_ids == engine.generate(prompt, max_new_tokens=TOKENS, write_back=False,
                                            repair=fast(STRICT)).token_ids
    assert out.served == pre.served and out.exact_from is None
    # Without escalation the same request falls back at once.
    engine.config = dataclasses.replace(engine.config, escalate_to=0.0)
    straight = engine.prefill(prompt, write_back=False)
    assert straight.fell_back and straight.served == (Served(0, FULL, 1.0, straight.prompt_tokens),)


def test_a_larger_repair_that_picks_another_first_token_than_the_refused_one_is_not_trusted(engine):
    """Two repairs of one plan that pick apart: the token rests on what they left stale, however sure the larger
    one is. Its curve trusts every token here, and still the request climbs past it to a full prefill."""
    engine.config = dataclasses.replace(engine.config, escalate_to=STRICT)  # the ladder: strict's repair, then full
    engine.predictor = constant(ALWAYS, BALANCED).with_others([constant(NEVER, STRICT)])
    apart = agreeing = None
    for docs in itertools.permutations(corpus()):
        prompt = prompt_of(list(docs))
        if engine.plan(prompt, "cacheblend").count(APPROX) == 0:
            continue
        tops = [int(engine.prefill(prompt, write_back=False, repair=fast(b)).logits.argmax()) for b in (BALANCED,
                                                                                                       STRICT)]
        if tops[0] != tops[1]:
            apart = apart or prompt
        else:
            agreeing = agreeing or prompt
    assert apart is not None and agreeing is not None  # the random model has both kinds of prompt
    pre = engine.prefill(apart, max_new_tokens=TOKENS, write_back=False)
    assert pre.served == (Served(0, FULL, 1.0, pre.prompt_tokens),)
    assert torch.equal(pre.logits, engine.prefill(apart, "full", write_back=False).logits)
    refused = [j for j in pre.judged if j.step == ESCALATE]
    assert len(refused) == 1 and not refused[0].served and refused[0].chance == pytest.approx(NEVER)
    # Where the two repairs agree, the larger one serves, as its curve says.
    assert engine.prefill(agreeing, max_new_tokens=TOKENS, write_back=False).served[0].step == ESCALATE


def risky_then(later: float) -> fidelity.Predictor:
    """At balanced's budget each token risks 5%: a 12% target takes two, and refuses the third; at strict's budget
    a token risks `later`."""
    return constant(0.05, BALANCED).with_others([constant(later, STRICT)])


TARGET = 0.12  # 1 - 0.95 ** 2 < TARGET < 1 - 0.95 ** 3


def test_a_later_token_escalates_and_the_answer_so_far_is_run_through_the_larger_repair(engine, prompt):
    engine.predictor = risky_then(NEVER)
    out = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False, repair=RepairConfig(fidelity=TARGET))
    own = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False, repair=fast(BALANCED))
    assert out.generated_tokens == TOKENS  # the random model says no end of text this soon
    larger = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False, repair=fast(STRICT))
    assert out.served == (Served(0, REPAIR, BALANCED, own.recomputed_tokens),
                          Served(2, ESCALATE, STRICT, larger.recomputed_tokens))
    assert larger.recomputed_tokens > own.recomputed_tokens
    assert out.token_ids[:2] == own.token_ids[:2] and out.exact_from is None
    assert out.fidelity_estimate == pytest.approx(1 - 0.95 ** 2)  # the escalated tokens risk nothing
    # From token 2 on: greedy from strict's repair with the first two tokens teacher-forced after the prompt.
    after = engine.continuation_logits(larger, out.token_ids[:-1])  # [T - 1, V]: row k - 1 chooses token k
    assert [int(row.argmax()) for row in after[1:]] == list(out.token_ids[2:])


def test_a_later_token_no_budget_trusts_moves_to_a_full_prefill(engine, prompt):
    engine.predictor = risky_then(0.05)  # strict's budget (and 0.3's, the same curve) refuses the third token too
    out = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False, repair=RepairConfig(fidelity=TARGET))
    own = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False, repair=fast(BALANCED))
    assert out.served == (Served(0, REPAIR, BALANCED, own.recomputed_tokens), Served(2, FULL, 1.0, out.prompt_tokens))
    assert out.exact_from == 2 and not out.fell_back and out.token_ids[:2] == own.token_ids[:2]
    # From token 2 on: exactly what full prefills of the prompt and the answer so far choose.
    ids = engine.plan(prompt, "full").token_ids
    for k in range(2, out.generated_tokens):
        so_far = torch.cat([ids, torch.tensor(out.token_ids[:k])])
        _, logits = guard.exact_cache(engine.adapter, engine.lock, so_far, ids.numel() + TOKENS)
        assert int(logits.argmax()) == out.token_ids[k]


@pytest.mark.parametrize("checks", [True, False])
def test_a_step_the_guard_never_trusts_is_skipped_once_it_is_measured_not_to_pay(make_tiny_engine, prompt, monkeypatch,
                                                                                  checks):
    """routes.py: a repair refused every time costs its prefill and then a full prefill's; once measured so, the
    request goes straight to the full prefill (the same answer, fewer prefills), and the repair is tried again now
    and then in case what is asked has changed: after routes.EXPLORE_EVERY skips, then twice as many while it still
    does not pay. With shadow checks, the trial is made once the request is done, by the checks' thread (the request
    never builds it); without, by the request itself."""
    config = EngineConfig(calibrate=False, strict_likeness=None)
    config = config if checks else dataclasses.replace(config, shadow_share=0.0, shadow_share_young=0.0)
    engine = make_tiny_engine(config, guarded=True)
    engine.ingest(corpus())
    engine.predictor = constant(ALWAYS)  # no repair trusted, at any budget
    built = []
    monkeypatch.setattr(guard.Builder, "repaired", _counting(guard.Builder.repaired, built))
    full = engine.generate(prompt, max_new_tokens=2, strategy="full", write_back=False)
    for _ in range(routes.MIN_OUTCOMES):
        out = engine.generate(prompt, max_new_tokens=2, write_back=False)
        assert out.token_ids == full.token_ids and out.served == (Served(0, FULL, 1.0, out.prompt_tokens),)
    engine.shadow.drain()
    tried = len(built)
    steps = 1 + len(guard.escalations(RepairConfig(), engine.config.escalate_to))  # its own repair, escalations
    assert tried == 1 + steps * routes.MIN_OUTCOMES  # full's own prefill, then each request's every step
    assert {thread for thread, _ in built} == {threading.current_thread().name}  # not measured yet: all on its path
    # Measured: a repair refused every time never pays (any cost > 0 is above a trusted share of 0).
    own = ("cacheblend", "balanced", BALANCED)
    assert engine.routes.trusted_share(own) == 0.0
    judged = len(engine.routes._trusted[own])
    for i in range(1, routes.EXPLORE_EVERY + 1):
        out = engine.generate(prompt, max_new_tokens=2, write_back=False)
        assert out.token_ids == full.token_ids and out.served == (Served(0, FULL, 1.0, out.prompt_tokens),)
        engine.shadow.drain()
        assert len(built) == tried + (steps if i == routes.EXPLORE_EVERY else 0)  # only the exploring one's steps
    # ... built by the checks' thread, or without checks by the request's
    assert {thread for thread, _ in built[tried:]} == {"kvboost-shadow" if checks else threading.current_thread().name}
    tried = len(built)
    assert engine.routes.counters["skipped"] == steps * (routes.EXPLORE_EVERY - 1)
    assert len(engine.routes._trusted[own]) == judged + 1 and engine.routes.trusted_share(own) == 0.0  # refused again
    assert engine.shadow.counters["trials_refused"] == (steps if checks else 0)
    for i in range(1, 2 * routes.EXPLORE_EVERY + 1):  # refused again: the next trial waits twice as long
        engine.generate(prompt, max_new_tokens=2, write_back=False)
        engine.shadow.drain()
        assert len(built) == tried + (steps if i == 2 * routes.EXPLORE_EVERY else 0)


def test_a_trial_off_the_requests_path_is_judged_along_the_answer_it_was_served(engine, prompt):
    """guard.tried: the skipped step's cache, built again, must trust the served answer's first token and every
    later one, teacher-forced, to count as having served it; the judgment goes into the ladder's record."""
    engine.predictor = constant(0.06)  # a fixed risk of 0.1 per answer: one token trusted, two are not (0.116)
    pre = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False, repair=RepairConfig(fidelity=0.1))
    assert pre.served[0].step == REPAIR
    answer = engine.generate(prompt, max_new_tokens=TOKENS, strategy="full", write_back=False).token_ids
    key = ("cacheblend", "0.1", BALANCED)
    trial = guard.Trial(key, REPAIR, BALANCED, pre.policy)
    assert guard.tried(pre.builder, trial, answer[:1])
    assert not guard.tried(pre.builder, trial, answer[:2])
    engine.predictor = constant(NEVER)
    pre = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False, repair=RepairConfig(fidelity=0.1))
    assert guard.tried(pre.builder, dataclasses.replace(trial, policy=pre.policy), answer)
    assert list(engine.routes._trusted[key]) == [True, False, True]


def test_a_trial_that_holds_off_the_requests_path_is_counted_for_the_step(engine, prompt):
    """What is asked changed: the skipped repair's trial, made by the checks' thread along the answer served, finds
    it trusted to the end, and the record counts it (while the request itself was served by the next step)."""
    engine.predictor = constant(ALWAYS)
    for _ in range(routes.MIN_OUTCOMES):
        engine.generate(prompt, max_new_tokens=2, write_back=False)
    own = ("cacheblend", "balanced", BALANCED)
    assert engine.routes.trusted_share(own) == 0.0
    engine.predictor = constant(NEVER)  # every repair would be trusted now
    for _ in range(routes.EXPLORE_EVERY):
        out = engine.generate(prompt, max_new_tokens=2, write_back=False)
        engine.shadow.drain()
    assert out.served[0].step != REPAIR  # skipped for the request
    assert engine.routes._trusted[own][-1] is True and engine.routes.trusted_share(own) > 0.0
    assert engine.shadow.counters["trials_held"] >= 1


def test_a_trial_off_the_requests_path_gives_the_engine_to_a_request_between_layers(engine, prompt, monkeypatch):
    """A trial builds a whole repair (a third of a prefill or more); a request that comes meanwhile gets the engine
    before the trial's next layer, as a shadow check's would, not after the trial."""
    engine.predictor = constant(ALWAYS)
    for _ in range(routes.MIN_OUTCOMES + routes.EXPLORE_EVERY - 1):
        engine.generate(prompt, max_new_tokens=2, write_back=False)
    engine.shadow.drain()
    mid_trial = threading.Event()
    project = engine.adapter.project_kv

    def held_in_trials(*args):  # cacheblend's per-layer projections; in the trial, the first one waits
        if threading.current_thread().name == "kvboost-shadow" and not mid_trial.is_set():
            mid_trial.set()
            deadline = time.monotonic() + 30
            while not engine.lock.others and time.monotonic() < deadline:  # until the request below waits for it
                time.sleep(0.001)
        return project(*args)

    monkeypatch.setattr(engine.adapter, "project_kv", held_in_trials)
    engine.generate(prompt, max_new_tokens=2, write_back=False)  # its steps' trial is due: made after it
    assert mid_trial.wait(timeout=30)
    with engine.lock:  # a request's forward
        finished = engine.shadow.counters["trials_refused"]
    engine.shadow.drain()
    assert finished == 0 and engine.shadow.counters["trials_refused"] > 0


native_bf16 = pytest.mark.skipif(not models.native_matmuls(torch.bfloat16, torch.device("cpu")),
                                 reason="this CPU emulates bf16: the ladder has no HALF step here")


def floored(curve: fidelity.Predictor, order: float, dtype: float) -> fidelity.Predictor:
    """`curve` with floors: the order floor's and the dtype floor's flip chances, constant too; and a bf16
    prefill's own curve (HALF's) the same as the dtype floor's."""
    return dataclasses.replace(curve, floors=(constant(order, curve.budget), constant(dtype, curve.budget)),
                               half=constant(dtype, 1.0))


@native_bf16
def test_a_first_token_no_repair_is_trusted_with_is_served_by_a_bf16_full_prefill(engine, prompt):
    """HALF: where no repair is trusted, a full prefill in bf16 (the dtype floor's cache) before one in float32,
    judged by its own curve (fidelity.Predictor.half); its K/V decoded on in float32."""
    engine.predictor = floored(constant(ALWAYS, BALANCED), order=0.5, dtype=NEVER)  # every repair refused
    pre = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False)
    n = pre.prompt_tokens
    assert pre.served == (Served(0, HALF, 1.0, n),)
    assert pre.fell_back and pre.recompute_budget == 1.0 and pre.risk == pytest.approx(NEVER)
    half = engine.half_adapter()
    assert half.dtype == torch.bfloat16 and pre.cache.all_keys.dtype == torch.float32
    ids = engine.plan(prompt, "full").token_ids
    low, logits = guard.exact_cache(half, engine.lock, ids, n)
    assert torch.equal(pre.logits, logits)  # the bf16 model's own prefill
    assert torch.equal(pre.cache.all_keys[:, :, :, :n], low.all_keys.float())
    assert not torch.equal(pre.logits, engine.prefill(prompt, "full", write_back=False).logits)  # not float32's
    out = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False)
    assert out.served == pre.served and out.exact_from is None and out.token_ids[0] == int(logits.argmax())
    # Its judgments are the shadow check's samples of the bf16 prefill's own curve, not of a budget's.
    engine.shadow.drain()
    assert engine.shadow.counters["checks"] >= 1 and 1.0 not in engine.shadow.samples
    assert len(engine.shadow.samples[HALF]) == TOKENS
    # Without a curve of its own (a predictor with floors and no HALF curve), no HALF step: float32's.
    engine.predictor = dataclasses.replace(engine.predictor, half=None)
    assert engine.prefill(prompt, write_back=False).served == (Served(0, FULL, 1.0, n),)
    # Without floors (uncalibrated) there is no curve to judge it by; with bf16_step off, no bf16 model: a
    # full prefill in float32.
    engine.predictor = constant(ALWAYS, BALANCED)
    assert engine.prefill(prompt, write_back=False).served == (Served(0, FULL, 1.0, n),)
    off = make_engine_like(engine, bf16_step=False)
    off.ingest(corpus())
    off.predictor = floored(constant(ALWAYS, BALANCED), order=0.5, dtype=NEVER)
    assert off.prefill(prompt, write_back=False).served == (Served(0, FULL, 1.0, n),) and off.half_adapter() is None
    assert guard.half_adapter(half) is None  # from bf16 the other dtype is the slower one


def make_engine_like(engine, **config):
    """A second engine on the same model and store, with these EngineConfig fields changed (its own document
    index: ingest again)."""
    from kvboost_rag.engine import KVBoost
    from kvboost_rag.models import LoadedModel

    loaded = LoadedModel(engine.adapter.model, engine.tokenizer, engine.model_id, "seed0")
    return KVBoost(loaded, dataclasses.replace(engine.config, **config), store=engine.store)


@native_bf16
def test_a_later_token_no_repair_trusts_moves_to_a_bf16_prefill_of_the_answer_so_far(engine, prompt):
    engine.predictor = floored(risky_then(0.05), order=0.5, dtype=NEVER)  # every repair refuses the third token
    out = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False, repair=RepairConfig(fidelity=TARGET))
    own = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False, repair=fast(BALANCED))
    assert out.served == (Served(0, REPAIR, BALANCED, own.recomputed_tokens), Served(2, HALF, 1.0, out.prompt_tokens))
    assert out.exact_from is None and not out.fell_back and out.token_ids[:2] == own.token_ids[:2]
    assert out.fidelity_estimate == pytest.approx(1 - 0.95 ** 2)  # the HALF step's tokens: its curve's NEVER
    # Token 2 is the bf16 prefill's of the prompt and the first two tokens; later ones decode on in float32.
    ids = torch.cat([engine.plan(prompt, "full").token_ids, torch.tensor(out.token_ids[:2])])
    _, logits = guard.exact_cache(engine.half_adapter(), engine.lock, ids, ids.numel())
    assert int(logits.argmax()) == out.token_ids[2]
    # A dtype floor that refuses as well: the float32 full prefill, last.
    engine.predictor = floored(risky_then(0.05), order=0.5, dtype=ALWAYS)
    out = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False, repair=RepairConfig(fidelity=TARGET))
    assert out.served[-1] == Served(2, FULL, 1.0, out.prompt_tokens) and out.exact_from == 2


def test_a_step_trusted_at_first_and_left_part_way_is_skipped_once_measured(engine, prompt):
    """routes.py judges a step by whole answers: a repair whose first tokens are trusted but which every answer
    leaves part-way (here at its third token, for strict's budget) has cost its prefill and the next one's; once
    measured, requests start from the step that serves their answers to the end."""
    engine.predictor = risky_then(NEVER)
    repair = RepairConfig(fidelity=TARGET)
    for _ in range(routes.MIN_TIMINGS):  # a full prefill's time: what a step's cost is measured against
        engine.generate(prompt, max_new_tokens=1, strategy="full", write_back=False)
    for _ in range(routes.MIN_OUTCOMES):
        out = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False, repair=repair)
        assert [s.step for s in out.served] == [REPAIR, ESCALATE]
    own, larger = ("cacheblend", str(TARGET), BALANCED), ("cacheblend", str(TARGET), STRICT)
    assert engine.routes.trusted_share(own) == 0.0 and engine.routes.trusted_share(larger) == 1.0
    out = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False, repair=repair)
    # Its own repair skipped: served from the first token on by an escalation (strict's budget, or the ceiling
    # where strict's is measured slower than a full prefill on the tiny model), to the end.
    assert len(out.served) == 1 and out.served[0].first_token == 0 and out.served[0].step == ESCALATE


def measured(trusted: bool, repair_s: float, full_s: float = 1.0) -> routes.Routes:
    """Routes that have seen balanced's own repair judged enough times, and timed it and a full prefill."""
    record = routes.Routes()
    for _ in range(routes.MIN_OUTCOMES):
        record.judged(("cacheblend", "balanced", BALANCED), trusted)
    for _ in range(routes.MIN_TIMINGS):
        record.timed("cacheblend", BALANCED, repair_s, 100)
        record.timed("full", routes.FULL, full_s, 100)
    return record


def test_a_skipped_step_is_tried_less_often_while_it_still_does_not_pay_and_soon_again_once_it_did():
    record, step = measured(False, 0.5), ("cacheblend", "balanced", BALANCED)
    record.timed("full", FULL, 1.0, 100)

    def trials(requests: int) -> list[int]:
        return [i for i in range(1, requests + 1) if record.verdict(step) == routes.TRIAL]

    every = routes.EXPLORE_EVERY
    assert trials(7 * every) == [every, 3 * every, 7 * every]  # after 8, then 16, then 32 skips
    assert trials(2 * routes.EXPLORE_MAX) == [routes.EXPLORE_MAX, 2 * routes.EXPLORE_MAX]  # then at most 64
    record.judged(step, True)  # a trial held (still not paying: 1 trusted of 9): the next one after 8 skips again
    assert record.trusted_share(step) < 0.5 and trials(3 * every) == [every, 3 * every]
    for _ in range(routes.WINDOW):  # what is asked has changed: its trials hold now, and it pays again
        record.judged(step, True)
    assert record.verdict(step) == routes.TRY
    for _ in range(routes.WINDOW):  # and changes back: trials start again from EXPLORE_EVERY
        record.judged(step, False)
    assert trials(every) == [every]


@pytest.mark.parametrize("trusted, repair_s, repairs", [(True, 0.5, True), (True, 2.0, False), (False, 0.01, False)])
def test_a_step_is_tried_when_its_trusted_share_is_above_its_cost(engine, prompt, trusted, repair_s, repairs):
    engine.predictor = constant(NEVER)  # the repair would be trusted: only the record decides
    engine.routes = measured(trusted, repair_s)
    assert engine.routes.cost("cacheblend", BALANCED) == pytest.approx(repair_s)
    pre = engine.prefill(prompt, write_back=False)
    assert (pre.served[0].step == REPAIR) == repairs  # skipped: served by the next step (escalated), never worse


def test_without_ladder_costs_every_step_is_tried(make_tiny_engine, prompt):
    engine = make_tiny_engine(EngineConfig(calibrate=False, ladder_costs=False), guarded=True)
    engine.ingest(corpus())
    engine.predictor = constant(ALWAYS)
    for _ in range(routes.MIN_OUTCOMES + routes.EXPLORE_EVERY):
        engine.generate(prompt, max_new_tokens=1, write_back=False)
    assert engine.routes.counters["skipped"] == 0
    with pytest.raises(ConfigError, match="ladder_costs"):
        EngineConfig(ladder_costs="yes")


def _counting(method, calls: list):
    def counted(self, *args, **kwargs):
        calls.append((threading.current_thread().name, args))
        return method(self, *args, **kwargs)
    return counted


def test_a_level_held_on_average_serves_from_the_repair_what_an_exact_answer_left_of_its_floor(make_tiny_engine,
                                                                                                 prompt):
    """An answer the repair is less sure of than the order floor moves to an exact cache while its level's account
    is empty; served exactly, it lends on part of the floor's risk over its tokens, and the next such answer is
    served from the repair on it. `strict` is held answer by answer; floor_credit=0 holds every answer."""
    curves = floored(constant(0.3), order=0.1, dtype=NEVER)  # 30% a token at every budget, the order floor 10%
    curves = dataclasses.replace(curves, half=None)  # no bf16 step: a refused repair goes to a full prefill
    engine = make_tiny_engine(EngineConfig(calibrate=False, ladder_costs=False, shadow_share=0.0, strict_likeness=None),
                              guarded=True)
    engine.ingest(corpus())
    engine.predictor = curves
    first = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False)
    assert first.served[0].step == FULL and first.fidelity_estimate == 0.0
    account = engine.accounts["balanced"]
    assert account.credit > 0.15 and account.loans == 0  # 30% against max(10%, BALANCED's 15%): short 0.15
    # Lent: half the floor's risk over every token, the first (served by the prefill's fall-back) included.
    assert account.credit == pytest.approx(fidelity.LEND * (1 - 0.9 ** len(first.token_ids)))
    second = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False)
    assert second.served[0].step == REPAIR and account.loans >= 1
    strict = engine.generate(prompt, max_new_tokens=TOKENS, write_back=False,
                             repair=RepairConfig(fidelity="strict"))
    assert strict.served[0].step == FULL and "strict" not in engine.accounts
    held = make_tiny_engine(EngineConfig(calibrate=False, ladder_costs=False, shadow_share=0.0, floor_credit=0.0,
                                         strict_likeness=None),
                            guarded=True)
    held.ingest(corpus())
    held.predictor = curves
    answers = [held.generate(prompt, max_new_tokens=TOKENS, write_back=False) for _ in range(2)]
    assert [a.served[0].step for a in answers] == [FULL, FULL] and held.accounts["balanced"].credit == 0.0


def test_a_trial_at_a_level_held_on_average_may_borrow_what_its_account_holds(make_tiny_engine, prompt):
    """A skipped step's trial is judged as an answer of its level would be served: at `balanced`, held on average,
    borrowing what the account holds now, from a copy (nothing is lent to a trial). Judged per answer, a repair that
    serves answers on credit never lasted in its trials, and was skipped for good with the account full."""
    curves = dataclasses.replace(floored(constant(0.3), order=0.1, dtype=NEVER), half=None)
    engine = make_tiny_engine(EngineConfig(calibrate=False, ladder_costs=False, shadow_share=0.0, strict_likeness=None),
                              guarded=True)
    engine.ingest(corpus())
    engine.predictor = curves
    pre = engine.prefill(prompt, max_new_tokens=TOKENS, write_back=False)
    account = pre.policy.account
    assert account is engine.accounts["balanced"] and account.credit == 0.0
    answer = engine.generate(prompt, max_new_tokens=TOKENS, strategy="full", write_back=False).token_ids
    trial = guard.Trial(("cacheblend", "balanced", BALANCED), REPAIR, BALANCED, pre.policy)
    assert not guard.tried(pre.builder, trial, answer)  # 30% a token against the floor's 10%: nothing to borrow
    account.repay(0.0, 4.0 / fidelity.LEND)  # earlier answers left their floor's risk unspent: the cap, 2.0
    assert guard.tried(pre.builder, trial, answer)  # the shortfall over its 8 tokens (~0.37) borrowed
    assert account.figures() == {"cap": 2.0, "credit": 2.0, "loans": 0, "borrowed": 0.0}  # from a copy
    assert list(engine.routes._trusted[trial.key])[-2:] == [False, True]  # after the request's own refusal


@pytest.mark.parametrize("floor_credit", [2.0, 0.0])
def test_calibration_seeds_a_level_held_on_average_as_its_answers_are_served(make_tiny_engine, floor_credit):
    """calibrate._seed_routes judges calibration's answers in turn, `balanced` borrowing from an account the answers
    before it lent to, as served: a repair 30% unsure a token against a floor of 10% serves some later answers on
    credit, where held answer by answer (`strict`, or floor_credit 0) it serves none."""
    engine = make_tiny_engine(EngineConfig(calibrate=False, floor_credit=floor_credit), guarded=True)
    predictor = floored(constant(0.3, BALANCED), order=0.1, dtype=NEVER)
    lengths = [TOKENS] * 12
    calibrate._seed_routes(engine, predictor, {"balanced": (BALANCED,), "strict": (STRICT,)},
                           {BALANCED: [1.0] * sum(lengths), STRICT: [1.0] * sum(lengths)}, lengths)
    balanced = list(engine.routes._trusted[("cacheblend", "balanced", BALANCED)])
    assert len(balanced) == len(lengths) and not balanced[0]  # the account starts empty
    # On credit some hold (each held one spends ~0.37 of it, each refused one lends), per answer none does.
    assert any(balanced) == (floor_credit > 0)
    assert not any(engine.routes._trusted[("cacheblend", "strict", STRICT)])
