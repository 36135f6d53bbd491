"""The guard's ladder (repair/guard.py) on a tiny random Llama: escalation to a larger budget, the full prefill last,
and the report of which step served which tokens.

The flip curves are set, not fitted: a curve with slope 0 gives every token the same flip chance, so a test decides
which steps the guard trusts; the caches, logits and answers are the model's own."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvboost_rag import fidelity
from kvboost_rag.assembly import APPROX
from kvboost_rag.config import ConfigError, EngineConfig, RepairConfig
from kvboost_rag.repair import guard
from kvboost_rag.repair.guard import ESCALATE, FULL, REPAIR, Served


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
    engine = make_tiny_engine(EngineConfig(calibrate=False), guarded=True)
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
        _, logits = engine._exact_cache(torch.cat([ids, torch.tensor(out.token_ids[:k])]), ids.numel() + TOKENS)
        assert int(logits.argmax()) == out.token_ids[k]
