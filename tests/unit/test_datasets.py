"""The bundled sets' generators (research/datasets/, not part of the package): their guarantees, and that they
rebuild the bundled files byte for byte."""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from difflib import SequenceMatcher
from pathlib import Path

import pytest

from kvboost_rag.bench.data import BenchItem, bundled, load_items, write_items

# research/ is not installed; its scripts import their neighbours by file name, as they do when run.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "research" / "datasets"))
import fidelity_holdout  # noqa: E402
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


# ---------------------------------------------------------------------------------------------------
# Held-out fidelity set (research/data/fidelity_holdout.jsonl): nothing may be tuned on it


HOLDOUT = Path(__file__).resolve().parents[2] / "research" / "data" / "fidelity_holdout.jsonl"


@pytest.fixture(scope="module")
def holdout():
    # Regenerated with the bundled tokenizer, which sizes its documents (a few seconds).
    return fidelity_holdout.items()


def _look_alike(name: str, other: str) -> bool:
    # One step apart: a shared first or last word (Larkspur Inn / Larkspur Lodge, Kelloch Moor / Kellach Moor)
    # or a near-identical spelling (2K41 / 2K14, PQ-5333 / PQ-1333).
    a, b = name.split(), other.split()
    return name != other and (a[0] == b[0] or a[-1] == b[-1] or SequenceMatcher(None, name, other).ratio() >= 0.7)


def test_holdout_file_is_what_the_generator_writes(holdout, tmp_path):
    write_items([item for item, _ in holdout], tmp_path / "holdout.jsonl")
    assert (tmp_path / "holdout.jsonl").read_bytes() == HOLDOUT.read_bytes()
    assert len(load_items(HOLDOUT)) == fidelity_holdout.N_ITEMS == 96


def test_holdout_answers_are_in_the_answer_document(holdout):
    for item, meta in holdout:
        assert 4 <= len(item["documents"]) <= 8
        assert all(a.casefold() in item["documents"][item["answer_doc"]].casefold() for a in item["answers"])
        assert meta["needs"][0] == item["answer_doc"]


def test_holdout_has_look_alikes_with_other_values(holdout):
    for item, meta in holdout:
        target, answer = meta["target"], item["answers"][0].casefold()
        alikes = [j for j, name in enumerate(meta["names"]) if name and _look_alike(target, name)]
        assert alikes, item["id"]
        for j in alikes:
            # The same fact, another value, and neither value inside the other: a reply quoting the look-alike's
            # value is not counted as right.
            value, mine = meta["values"][j].casefold(), meta["values"][item["answer_doc"]].casefold()
            assert value not in mine and mine not in value, (item["id"], j)
            assert target.casefold() not in item["documents"][j].casefold()
            if meta["qtype"] == "compare":
                assert answer not in item["documents"][j].casefold()


def test_holdout_two_document_questions_need_both(holdout):
    qtypes = Counter(meta["qtype"] for _, meta in holdout)
    assert qtypes["compare"] >= 16 and qtypes["bridge"] >= 16
    for item, meta in holdout:
        if meta["qtype"] == "single":
            assert meta["needs"] == [item["answer_doc"]]
            continue
        answer_doc, other = meta["needs"]
        assert answer_doc != other
        if meta["qtype"] == "compare":
            # Both records are named in the question; the answer is the winner's name.
            partner = meta["names"][other]
            assert item["answers"] == [meta["target"]] and partner.casefold() in item["question"].casefold()
        else:
            # The memo ties the question's nickname to the record; the question never names the record.
            assert meta["names"][other] is None and meta["target"] in item["documents"][other]
            assert meta["target"] not in item["question"]


def test_holdout_names_are_not_the_other_sets_names():
    fh = fidelity_holdout
    here = Path(__file__).resolve().parents[2] / "research" / "datasets"
    theirs = " ".join((here / f).read_text() for f in ("synthetic_set.py", "multidoc_other.py")).casefold()
    ours = (*fh._STATIONS, *fh._INN_WORDS, *fh._STATION_WORDS, *fh._MAKERS, *fh._GAME_FIRST, *fh._GAME_SECOND)
    assert not [n for n in ours if re.search(rf"\b{re.escape(n.casefold())}\b", theirs)]


def test_holdout_document_edges_vary(holdout):
    docs = [d for item, _ in holdout for d in item["documents"]]
    assert {d[-1] for d in docs} >= {".", "!", "?", ":", '"', ")"}
    assert {d[0] for d in docs} & set("0123456789") and {d[0] for d in docs} >= {'"', "-"}
    assert {item["system"] for item, _ in holdout} == set(fidelity_holdout.SYSTEMS)


# ---------------------------------------------------------------------------------------------------
# Held-out set of real text (research/data/package_pages.jsonl): packages' own pages; nothing may be tuned on it.
# The file is the set (it depends on what is installed), so its rules are checked, not a regeneration.


PAGES = Path(__file__).resolve().parents[2] / "research" / "data" / "package_pages.jsonl"


def test_package_pages_answers_are_in_their_own_page_only():
    items = load_items(PAGES)
    assert len(items) == 64
    assert Counter(item.id.split("-")[2] for item in items) == {q: 16 for q in ("version", "requires", "author",
                                                                                 "reverse")}
    for item in items:
        assert 4 <= len(item.documents) <= 8 and len(item.answers) == 1
        answer = item.answers[0].casefold()
        where = [j for j, doc in enumerate(item.documents) if answer in doc.casefold()]
        assert where == [item.answer_doc], item.id


def test_package_pages_are_the_packages_own_text():
    # Every page carries its METADATA header lines and is cut from its description at a line end, not rewritten.
    for item in load_items(PAGES):
        for doc in item.documents:
            assert re.search(r"^Name: \S+$", doc, re.M) and re.search(r"^Version: \S+$", doc, re.M), item.id
            assert not re.search(r"^Name: (kvboost|langchain-kvboost|llama-index-llms-kvboost)", doc, re.M)


# ---------------------------------------------------------------------------------------------------
# Held-out set of real text (research/data/man_pages.jsonl): the system's manual pages as `man` renders them; nothing
# may be tuned on it. The file is the set (it depends on what is installed), so its rules are checked.


MAN_PAGES = Path(__file__).resolve().parents[2] / "research" / "data" / "man_pages.jsonl"


def test_man_pages_answers_are_in_their_own_page_only():
    items = load_items(MAN_PAGES)
    assert len(items) == 64
    assert Counter(item.id.split("-")[2] for item in items) == {q: 16 for q in ("option", "long", "reverse", "author")}
    for item in items:
        assert 4 <= len(item.documents) <= 8 and len(item.answers) == 1
        answer = item.answers[0].casefold()
        where = [j for j, doc in enumerate(item.documents) if answer in doc.casefold()]
        assert where == [item.answer_doc], item.id
        if item.id.split("-")[2] in ("option", "long"):  # a long option, named in its page as an option line
            assert re.fullmatch(r"--[a-z][a-z0-9-]+", item.answers[0]), item.id
            assert re.search(rf"^\s*(-\w, )?{re.escape(item.answers[0])}\b", item.documents[item.answer_doc], re.M)


def test_man_pages_are_rendered_pages_cut_at_a_line_end():
    # Every page starts with its NAME section as man renders it ("command - summary"), in ASCII, not rewritten.
    for item in load_items(MAN_PAGES):
        for doc in item.documents:
            assert re.match(r"NAME\n\S+ - \S", doc), item.id
            assert doc.isascii() and doc == doc.rstrip() and "\n\n\n" not in doc, item.id
