"""The bundled sets' generators (research/datasets/, not part of the package): their guarantees, and that they
rebuild the bundled files byte for byte."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvboost_rag.bench.data import BenchItem, bundled, load_items, write_items

# research/ is not installed; its scripts import their neighbours by file name, as they do when run.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "research" / "datasets"))
import pydoc_set  # noqa: E402
import shipped  # noqa: E402
import synthetic_set  # noqa: E402
from pydoc_set import pydoc_items  # noqa: E402
from synthetic_set import synthetic_items  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# Synthetic set


@pytest.fixture(scope="module")
def syn_shipped():
    # The bundled set's recipe, generated once for the tests that only read it.
    return shipped.generate(*shipped.SHIPPED["synthetic_k8"])


def test_synthetic_is_deterministic_per_seed():
    assert synthetic_items(30, seed=3) == synthetic_items(30, seed=3)
    assert synthetic_items(30, seed=3) != synthetic_items(30, seed=4)


def test_synthetic_prefix_is_the_smaller_set():
    # A `limit` on a bundled file must be the same as generating fewer items.
    assert synthetic_items(50, seed=5)[:17] == synthetic_items(17, seed=5)
    # ...and `first` picks up where a set of `first` items ends.
    assert synthetic_items(20, seed=5, first=30) == synthetic_items(50, seed=5)[30:]


def test_synthetic_answer_is_in_the_answer_document_only(syn_shipped):
    for item in syn_shipped:
        docs, target = item["documents"], item["answer_doc"]
        assert len(docs) == 8
        assert item["answers"][0] in docs[target], item["id"]
        # Once, where the fact is stated: no other value in the document contains it (174 in 1740).
        assert not any(a in docs[target].replace(item["answers"][0], "") for a in item["answers"])
        for j, doc in enumerate(docs):
            if j != target:
                assert not any(a in doc for a in item["answers"]), (item["id"], j)


def test_synthetic_count_answers_have_a_plain_variant(syn_shipped):
    items = [i for i in syn_shipped if any("," in a for a in i["answers"])]
    assert items
    for item in items:
        assert item["answers"][1] == item["answers"][0].replace(",", "")


def test_synthetic_distractors_are_look_alikes_with_different_names():
    for i in range(100):
        item, names = synthetic_set._synthetic_item(i, 8, 150, seed=0)
        target = names[item["answer_doc"]]
        assert len(set(names)) == 8
        assert target in item["question"]
        assert target in item["documents"][item["answer_doc"]]
        for j, (name, doc) in enumerate(zip(names, item["documents"], strict=True)):
            if j != item["answer_doc"]:
                assert target not in doc
                assert name in doc
                # Look-alike: the same stem as the target (Halvorsen / Halvard).
                assert len(os.path.commonprefix([name, target])) >= 3


def test_synthetic_answer_position_is_uniform(syn_shipped):
    assert len(syn_shipped) % 8 == 0  # whole runs of 8: every place equally often
    counts = Counter(item["answer_doc"] for item in syn_shipped)
    assert counts == {pos: len(syn_shipped) // 8 for pos in range(8)}
    counts = Counter(item["answer_doc"] for item in synthetic_items(40, k_docs=5, seed=9))
    assert counts == {pos: 8 for pos in range(5)}


def test_synthetic_documents_have_about_the_asked_length_and_differ(syn_shipped):
    items = syn_shipped[:40]
    lengths = [len(doc.split()) for item in items for doc in item["documents"]]
    assert 135 <= sum(lengths) / len(lengths) <= 165
    assert min(lengths) >= 110 and max(lengths) <= 190
    for item in items:
        assert len(set(item["documents"])) == len(item["documents"])


def test_synthetic_covers_every_kind_and_has_no_stray_slots(syn_shipped):
    items = syn_shipped
    kinds = {item["id"].split("-")[2] for item in items}
    assert kinds == {kind.key for kind in synthetic_set.KINDS}
    for item in items:
        for text in [*item["documents"], item["question"]]:
            assert "{" not in text and "}" not in text


# ---------------------------------------------------------------------------------------------------
# Real-text set


def test_pydoc_is_deterministic_and_uses_distinct_topics():
    items = pydoc_items(20, seed=1)
    pydoc_set.pydoc_passages.cache_clear()  # determinism must not come from the cache
    assert items == pydoc_items(20, seed=1)
    assert items != pydoc_items(20, seed=2)
    passages = {p.text: p for p in pydoc_set.pydoc_passages(150)}
    for item in items:
        assert len(item["documents"]) == 8
        topics = [passages[doc].topic for doc in item["documents"]]
        assert len(set(topics)) == 8
        assert "answers" not in item
        target = passages[item["documents"][item["answer_doc"]]]
        assert target.heading.replace('"', "`") in item["question"] or "`" in item["question"]


def test_pydoc_answer_position_is_uniform():
    counts = Counter(item["answer_doc"] for item in pydoc_items(64, k_docs=8))
    assert counts == {pos: 8 for pos in range(8)}


def test_pydoc_passages_are_about_the_asked_length():
    passages = pydoc_set.pydoc_passages(150)
    lengths = [len(p.text.split()) for p in passages]
    assert len(passages) > 100
    assert 120 <= sum(lengths) / len(lengths) <= 170
    assert min(lengths) >= 75


def test_statement_headings_make_statement_questions():
    assert pydoc_set._pydoc_question(None, 'The "with" statement') == (
        "Based on the documents, explain briefly what the `with` statement does."
    )


# ---------------------------------------------------------------------------------------------------
# Generated items in the loader, and the bundled files


def test_generated_items_round_trip_through_the_loader(tmp_path):
    items = synthetic_items(5) + pydoc_items(5, k_docs=3)
    write_items(items, tmp_path / "mix.jsonl")
    loaded = load_items(tmp_path / "mix.jsonl")
    assert loaded == [BenchItem(i["id"], tuple(i["documents"]), i["question"], i["system"],
                                tuple(i.get("answers", ())), i["answer_doc"]) for i in items]


@pytest.mark.parametrize("name", sorted(shipped.SHIPPED))
def test_bundled_files_have_the_stated_sizes(name):
    kind, n, k, _, _ = shipped.SHIPPED[name]
    items = load_items(bundled(name))
    assert len(items) == n
    assert all(len(item.documents) == k and item.answer_doc is not None for item in items)
    assert all(bool(item.answers) == (kind == "synthetic") for item in items)


@pytest.mark.parametrize("name", [name for name, spec in shipped.SHIPPED.items() if spec[0] == "synthetic"])
def test_bundled_synthetic_files_are_what_the_generator_writes(name, tmp_path):
    # The pydoc set is left out: its text comes from the running Python's docs, which change.
    assert shipped.main(["--out-dir", str(tmp_path), name]) == 0
    assert (tmp_path / f"{name}.jsonl").read_bytes() == bundled(name).read_bytes()


def test_every_bundled_file_has_a_recipe():
    assert {p.stem for p in bundled("tiny").parent.glob("*.jsonl")} == set(shipped.SHIPPED)
