"""Chunking at natural boundaries, dual-hash keys, and finding documents in prompts."""

from __future__ import annotations

import pytest

from kvboost_rag import keys
from kvboost_rag.chunking import chunk_document, split_tokens
from kvboost_rag.store.documents import Document, DocumentIndex

TEXT = ("First paragraph opens here. It has a second sentence that runs on for a while.\n\n"
        "Second paragraph starts now and keeps going with several words. Another sentence follows it. "
        "And a third one closes the paragraph.\n\nA last short paragraph.")


def test_chunks_cover_the_document_tokens_exactly_and_respect_the_limit(bundled_tokenizer):
    ids, chunks = chunk_document(TEXT, bundled_tokenizer, max_chunk_tokens=24)
    assert ids == bundled_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert chunks[0].start == 0 and chunks[-1].end == len(ids)
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:], strict=False))
    assert all(0 < c.end - c.start <= 24 for c in chunks)
    assert len(chunks) >= 3


def test_chunks_cut_at_paragraphs_then_sentences(bundled_tokenizer):
    ids, chunks = chunk_document(TEXT, bundled_tokenizer, max_chunk_tokens=40)
    pieces = [bundled_tokenizer.decode(ids[c.start:c.end]) for c in chunks]
    assert "".join(pieces) == TEXT
    # Every cut lands after a sentence end, never mid-word.
    for piece in pieces[:-1]:
        assert piece.rstrip().endswith("."), pieces
    assert pieces[1].startswith("Second")  # the paragraph break is the preferred cut


def test_short_document_is_one_chunk(bundled_tokenizer):
    ids, chunks = chunk_document("A short note.", bundled_tokenizer, max_chunk_tokens=512)
    assert len(chunks) == 1 and chunks[0].end == len(ids)


def test_split_without_any_boundary_still_respects_the_limit():
    chunks = split_tokens([0] * 50, 16)
    assert [c.end - c.start for c in chunks] == [16, 16, 16, 2]
    with pytest.raises(ValueError):
        split_tokens([0] * 5, 0)


def test_keys_separate_models_positions_and_contexts():
    def fingerprint(**changes):
        settings = dict(model_id="m", weights_digest="w1", config_digest="c", dtype="float32", tokenizer_digest="t",
                        encoding={})
        return keys.model_fingerprint(**(settings | changes))

    a, b = fingerprint(), fingerprint(dtype="bfloat16")
    assert a != b and a == fingerprint()
    changed = [fingerprint(config_digest="c2"), fingerprint(tokenizer_digest="t2"), fingerprint(weights_digest="w2"),
               fingerprint(encoding={"context": [[1]]})]
    assert len({a, *changed}) == 5
    doc, other, system = (5, 6, 7), (8, 9), (1, 2)
    assert keys.content_key(a, doc) != keys.content_key(b, doc)
    # Same document after two different chunks: same content key, different prefix keys.
    (_, _), (p1, c1) = keys.chain(a, [system, doc])
    (_, _), (p2, c2) = keys.chain(a, [other, doc])
    assert c1 == c2 and p1 != p2
    assert keys.chain(a, [system, doc]) == keys.chain(a, [system, doc])
    assert all(len(k) == keys.KEY_BYTES for pair in keys.chain(a, [doc]) for k in pair)


def test_document_index_finds_documents_in_any_order(tmp_path):
    def doc(text):
        return Document(text[:4], text, (1,), ())

    long_a = "Alpha document text that is certainly longer than the anchor."
    long_b = "Beta document, also long enough to be anchored by its first characters."
    short = "Tiny doc."
    index = DocumentIndex(tmp_path / "docs.jsonl")
    for text in (long_a, long_b, short):
        index.add(doc(text))
    prompt = f"system: {long_b}\n\n{short}\n{long_a}\nquestion?"
    spans = index.find(prompt)
    assert [s.document.text for s in spans] == [long_b, short, long_a]
    assert all(prompt[s.start:s.end] == s.document.text for s in spans)
    assert index.find("nothing here") == []
    # Only from the given starts (a prompt's token starts): a match elsewhere is not a candidate, and so cannot
    # shadow a usable one it overlaps.
    inner = "document text that is certainly longer than the anchor. And more."
    index.add(doc(inner))
    overlapping = f"{long_a} And more."
    assert [s.document.text for s in index.find(overlapping)] == [long_a]
    starts = [overlapping.index(inner)]
    assert [s.document.text for s in index.find(overlapping, starts=starts)] == [inner]
    assert [s.document.text for s in index.find(prompt, starts=[prompt.index(short), prompt.index(long_a)])] == [
        short, long_a]
    # Persisted: a new index over the same file knows the same documents.
    assert len(DocumentIndex(tmp_path / "docs.jsonl")) == 4
