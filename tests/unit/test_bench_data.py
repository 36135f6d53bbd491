"""Benchmark data: the generators' guarantees, the loader's errors, and the shipped files."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from kvboost_rag.bench import data
from kvboost_rag.bench.data import (
    SHIPPED,
    BenchItem,
    bundled,
    load_items,
    pydoc_items,
    synthetic_items,
    write_items,
)

# ---------------------------------------------------------------------------------------------------
# Synthetic set


@pytest.fixture(scope="module")
def syn_shipped():
    # The shipped set's recipe, generated once for the tests that only read it.
    return data.generate(*SHIPPED["synthetic_k8"])


def test_synthetic_is_deterministic_per_seed():
    assert synthetic_items(30, seed=3) == synthetic_items(30, seed=3)
    assert synthetic_items(30, seed=3) != synthetic_items(30, seed=4)


def test_synthetic_prefix_is_the_smaller_set():
    # A `limit` on a shipped file must be the same as generating fewer items.
    assert synthetic_items(50, seed=5)[:17] == synthetic_items(17, seed=5)


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
        item, names = data._synthetic_item(i, 8, 150, seed=0)
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
    assert kinds == {kind.key for kind in data.KINDS}
    for item in items:
        for text in [*item["documents"], item["question"]]:
            assert "{" not in text and "}" not in text


# ---------------------------------------------------------------------------------------------------
# Real-text set


def test_pydoc_is_deterministic_and_uses_distinct_topics():
    items = pydoc_items(20, seed=1)
    data.pydoc_passages.cache_clear()  # determinism must not come from the cache
    assert items == pydoc_items(20, seed=1)
    assert items != pydoc_items(20, seed=2)
    passages = {p.text: p for p in data.pydoc_passages(150)}
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
    passages = data.pydoc_passages(150)
    lengths = [len(p.text.split()) for p in passages]
    assert len(passages) > 100
    assert 120 <= sum(lengths) / len(lengths) <= 170
    assert min(lengths) >= 75


def test_statement_headings_make_statement_questions():
    assert data._pydoc_question(None, 'The "with" statement') == (
        "Based on the documents, explain briefly what the `with` statement does."
    )


# ---------------------------------------------------------------------------------------------------
# Loader


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = {"id": "a", "documents": ["doc one", "doc two"], "question": "q?"}


def test_load_items_reads_all_fields(tmp_path):
    full = {**GOOD, "id": "b", "system": "sys", "answers": ["x", "y"], "answer_doc": 1}
    path = _write_lines(tmp_path / "ok.jsonl", [json.dumps(GOOD), "", json.dumps(full)])
    items = load_items(path)
    assert items == [
        BenchItem("a", ("doc one", "doc two"), "q?"),
        BenchItem("b", ("doc one", "doc two"), "q?", "sys", ("x", "y"), 1),
    ]
    assert load_items(path, limit=1) == items[:1]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"id": "x", "documents": ["d"]}), "missing 'question'"),
        (json.dumps({**GOOD, "question": "  "}), "'question' must be a non-empty string"),
        (json.dumps({"documents": ["d"], "question": "q"}), "missing 'id'"),
        (json.dumps({**GOOD, "documents": []}), "'documents' is empty"),
        (json.dumps({**GOOD, "documents": "d"}), "'documents' must be a list"),
        (json.dumps({**GOOD, "documents": ["d", ""]}), r"documents\[1\] must be a non-empty string"),
        (json.dumps({**GOOD, "documents": ["d", 3]}), r"documents\[1\] must be a non-empty string"),
        (json.dumps({**GOOD, "answers": []}), "'answers' must be a non-empty list"),
        (json.dumps({**GOOD, "answers": ["a", ""]}), r"answers\[1\]"),
        (json.dumps({**GOOD, "answer_doc": 2}), "'answer_doc' must be an index"),
        (json.dumps({**GOOD, "answer_doc": True}), "'answer_doc' must be an index"),
        (json.dumps({**GOOD, "answer": ["x"]}), r"unknown key\(s\) \['answer'\]"),
        (json.dumps({**GOOD, "system": 1}), "'system' must be a non-empty string"),
        (json.dumps(GOOD), "duplicate id 'a' \\(first on line 1\\)"),
    ],
)
def test_load_items_names_file_line_and_problem(tmp_path, bad, message):
    good_2 = json.dumps({**GOOD, "id": "b"})
    path = _write_lines(tmp_path / "bad.jsonl", [json.dumps(GOOD), good_2, bad])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: {message}"):
        load_items(path)


def test_load_items_limit_stops_before_a_later_bad_line(tmp_path):
    path = _write_lines(tmp_path / "late.jsonl", [json.dumps(GOOD), "{broken"])
    assert len(load_items(path, limit=1)) == 1


def test_load_items_refuses_an_empty_file(tmp_path):
    path = _write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="no items"):
        load_items(path)


def test_generated_items_round_trip_through_the_loader(tmp_path):
    items = synthetic_items(5) + pydoc_items(5, k_docs=3)
    write_items(items, tmp_path / "mix.jsonl")
    loaded = load_items(tmp_path / "mix.jsonl")
    assert [i.id for i in loaded] == [i["id"] for i in items]
    assert [list(i.documents) for i in loaded] == [i["documents"] for i in items]


# ---------------------------------------------------------------------------------------------------
# Shipped files


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_files_load_with_the_stated_sizes(name):
    kind, n, k, _, _ = SHIPPED[name]
    items = load_items(bundled(name))
    assert len(items) == n
    assert all(len(item.documents) == k and item.answer_doc is not None for item in items)
    assert all(bool(item.answers) == (kind == "synthetic") for item in items)


@pytest.mark.parametrize("name", [name for name, spec in SHIPPED.items() if spec[0] == "synthetic"])
def test_shipped_synthetic_files_match_the_generator(name, syn_shipped):
    # The pydoc set is left out: its text comes from the running Python's docs, which change.
    expected = syn_shipped if name == "synthetic_k8" else data.generate(*SHIPPED[name])
    lines = bundled(name).read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == expected


def test_bundled_names_the_available_files():
    assert bundled("synthetic_k8") == bundled("synthetic_k8.jsonl")
    with pytest.raises(ValueError, match="no bundled benchmark file 'nope'; available: .*synthetic_k8"):
        bundled("nope")
