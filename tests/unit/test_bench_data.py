"""Benchmark data: the loader's errors, the writer, and the bundled files. (The generators of the bundled files
are research code; tests/unit/test_datasets.py tests them.)"""

from __future__ import annotations

import json

import pytest

from kvboost_rag.bench.data import BENCH_DIR, BenchItem, bundled, in_orders, load_items, write_items

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


def test_written_items_load_back(tmp_path):
    written = [GOOD, {**GOOD, "id": "b", "system": "sys", "documents": ["ünïcode", "d"], "answers": ["x"],
                      "answer_doc": 0}]
    write_items(written, tmp_path / "out.jsonl")
    assert load_items(tmp_path / "out.jsonl") == [
        BenchItem("a", ("doc one", "doc two"), "q?"),
        BenchItem("b", ("ünïcode", "d"), "q?", "sys", ("x",), 0),
    ]
    assert "ünïcode" in (tmp_path / "out.jsonl").read_text(encoding="utf-8")  # written as is, not escaped


# ---------------------------------------------------------------------------------------------------
# Bundled files


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH_DIR.glob("*.jsonl")))
def test_bundled_files_load(name):
    items = load_items(bundled(name))
    assert items and all(item.answer_doc is not None for item in items)
    # The synthetic sets are scored by their answers; the pydoc set by its distributions only.
    assert all(bool(item.answers) != name.startswith("pydoc") for item in items)


def test_bundled_names_the_available_files():
    assert bundled("synthetic_k8") == bundled("synthetic_k8.jsonl")
    with pytest.raises(ValueError, match="no bundled benchmark file 'nope'; available: .*synthetic_k8"):
        bundled("nope")


def test_each_item_is_asked_in_several_orders_the_files_first():
    item = BenchItem("q1", ("a", "b", "c", "d"), "which?", answers=("x",), answer_doc=2)
    asked = in_orders([item, BenchItem("q2", ("e", "f"), "and?")], orders=4, seed=3)
    first = [a for a in asked if a.id.startswith("q1")]
    assert first[0] == item  # the file's order, its id unchanged
    assert len(first) == 4 and len({a.documents for a in first}) == 4
    for a in first[1:]:
        order = tuple(int(i) for i in a.id.split("@")[1].split("."))
        assert a.documents == tuple(item.documents[i] for i in order)
        assert a.documents[a.answer_doc] == "c" and a.answers == item.answers and a.question == item.question
    assert [a.documents for a in asked if a.id.startswith("q2")] == [("e", "f"), ("f", "e")]  # only two orders
    assert in_orders([item], orders=4, seed=3) == first  # seeded
    assert in_orders([item], orders=1) == [item]
    with pytest.raises(ValueError, match="orders"):
        in_orders([item], orders=0)
