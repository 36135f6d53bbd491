"""Requests whose documents are records of one template are held to `strict` (likeness.py, guard.held_to)."""

from __future__ import annotations

import pytest

from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.config import ConfigError, EngineConfig, RepairConfig
from kvboost_rag.likeness import likeness
from kvboost_rag.llm import request_figures
from kvboost_rag.repair import guard

RECORDS = [f"{town} is a harbour town of {1000 + 37 * i} people. Its mayor is {name} and its bridge was built in "
           f"{1800 + 11 * i}." for i, (town, name) in enumerate([("Brekkvik", "Ingrid"), ("Osterlund", "Tomas"),
                                                                ("Dovrino", "Mira"), ("Sarrento", "Edda")])]
PAGES = ["The kettle whistled while the baker folded rye dough on a floured board near the window.",
         "Lighthouse keepers log wind speed every four hours and repaint the lamp room each spring.",
         "A violin's soundpost transmits vibration from the top plate to the back plate of the body.",
         "Glaciers carve U-shaped valleys and leave moraines of unsorted rock where they melt back."]


def test_likeness_counts_shared_word_4grams():
    assert likeness(["one two three four five"] * 3) == 1.0
    assert likeness(PAGES) == 0.0
    assert likeness(RECORDS[:1]) == likeness([]) == 0.0  # no pair
    assert likeness(["too short", "too short"]) == 0.0  # no 4-gram: nothing alike to count
    # {a b c d, b c d e} against {a b c d, b c d f}: one 4-gram shared of the three either has
    assert likeness(["a b c d e", "A, b c d f"]) == pytest.approx(1 / 3)  # words, case and punctuation aside
    assert likeness(RECORDS) > EngineConfig().strict_likeness > likeness(PAGES + RECORDS[:1])


def test_the_bundled_sets_one_template_records_against_real_text():
    """The default threshold sits between the bundled look-alike families and real pages (docs/method.md)."""
    threshold = EngineConfig().strict_likeness
    families = load_items(bundled("synthetic_k8"), limit=24)
    pages = load_items(bundled("pydoc_k8"), limit=24)
    assert min(likeness(item.documents) for item in families) > threshold
    assert max(likeness(item.documents) for item in pages) < threshold / 10


@pytest.fixture
def engine(make_tiny_engine):
    engine = make_tiny_engine(EngineConfig(calibrate=False), guarded=True)
    engine.ingest(RECORDS + PAGES)
    return engine


def prompt_of(docs: list[str]) -> str:
    return "\n\n".join(docs) + "\n\nQuestion: Who is the mayor of Dovrino?"


THRESHOLD = EngineConfig().strict_likeness


@pytest.mark.parametrize(("docs", "settings", "threshold", "level"), [
    (RECORDS[::-1], RepairConfig(), THRESHOLD, "strict"),  # balanced, records of one template: strict
    (PAGES[::-1], RepairConfig(), THRESHOLD, "balanced"),
    (RECORDS[::-1], RepairConfig(), None, "balanced"),  # the cue off
    (RECORDS[::-1], RepairConfig(), 1.5, "balanced"),
    (RECORDS[::-1], RepairConfig(fidelity="fast"), THRESHOLD, "fast"),  # only balanced is moved
    (RECORDS[::-1], RepairConfig(fidelity=0.2), THRESHOLD, 0.2),
])
def test_a_request_is_held_to_strict_when_its_documents_are_alike(engine, docs, settings, threshold, level):
    held = guard.held_to(settings, engine.plan(prompt_of(docs), "cacheblend"), threshold)
    assert held.fidelity == level
    assert held.budget == RepairConfig(fidelity=level).budget  # strict's budget with strict's level


def test_a_budget_the_request_names_is_kept(engine):
    held = guard.held_to(RepairConfig(recompute_ratio=0.05), engine.plan(prompt_of(RECORDS), "cacheblend"), THRESHOLD)
    assert held.fidelity == "strict" and held.budget == 0.05


def test_the_answer_says_the_level_it_was_held_to(engine):
    alike = engine.generate(prompt_of(RECORDS[::-1]), max_new_tokens=2)
    unlike = engine.generate(prompt_of(PAGES[::-1]), max_new_tokens=2)
    assert alike.fidelity == "strict" and unlike.fidelity == "balanced"
    assert request_figures(alike)["fidelity"] == "strict"
    exact = engine.generate(prompt_of(RECORDS[::-1]), max_new_tokens=2, strategy="full")
    assert exact.fidelity is None  # nothing reused, nothing guarded


def test_the_engines_threshold_is_used_and_a_bad_one_refused_with_what_to_do(make_tiny_engine):
    off = make_tiny_engine(EngineConfig(calibrate=False, strict_likeness=None), guarded=True)
    off.ingest(RECORDS + PAGES)
    assert off.generate(prompt_of(RECORDS[::-1]), max_new_tokens=2).fidelity == "balanced"
    with pytest.raises(ConfigError, match="strict_likeness.*above 1 never"):
        EngineConfig(strict_likeness=-0.1)
