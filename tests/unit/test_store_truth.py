"""Nothing stored is ever served for another model, another config or other tokens (issue 23, items 1, 3,
8's text checks, 9's pins, 11), on a tiny random Llama with the bundled model's tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from kvboost_rag import EngineConfig, KVBoost, StoreConfig, ingestion
from kvboost_rag.assembly import APPROX, EXACT
from kvboost_rag.keys import content_key
from kvboost_rag.models import load


def test_cat_inside_concatenation_stays_text_and_full_sees_the_tokenizers_tokens(make_tiny_engine):
    engine = make_tiny_engine()
    tokenizer = engine.tokenizer
    engine.ingest(["cat"])
    prompt = "Spell the word 'concatenation' backwards, then say cat."
    expected = tokenizer(prompt)["input_ids"]
    for strategy in ("full", "prefix", "naive", "cacheblend"):
        p = engine.plan(prompt, strategy)
        assert p.token_ids.tolist() == expected, strategy
    # "cat" at the end is its own token (" cat"): the document's token "cat" has no leading space, so the
    # prompt's own tokens over that text differ and the document is not used there either.
    assert not any(c.is_document for c in engine.plan(prompt, "naive").chunks)


def test_a_document_on_token_boundaries_is_used_and_the_prompt_tokens_stay_exact(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine()
    engine.ingest(docs)
    rendered = engine.render(rag_prompt(docs[::-1], "Who founded it?"))
    p = engine.plan(rendered, "naive")
    assert sum(len(c.token_ids) for c in p.chunks if c.is_document) == sum(
        len(engine.document(d).token_ids) for d in docs)
    assert p.token_ids.tolist() == engine.tokenizer(rendered)["input_ids"]
    # After a space, the document's first word takes the space into its token (" The", not "The"): that seam
    # token is computed over the prompt's own token, and the rest of the document is reused (issue 39).
    glued = rendered.replace(docs[1], " " + docs[1])
    p = engine.plan(glued, "naive")
    assert p.token_ids.tolist() == engine.tokenizer(glued)["input_ids"]
    assert p.document_tokens_reused == p.document_tokens - 1
    doc = engine.document(docs[1])
    first = doc.chunks[0]
    whole = engine.store.find_content(content_key(engine.fingerprint, doc.token_ids[first.start:first.end]))
    cut = next(c for c in p.chunks if c.is_document and c.token_ids == doc.token_ids[1:first.end])
    assert cut.source == APPROX and cut.entry.token_ids == cut.token_ids  # a slice of the stored first chunk
    assert cut.entry.start == whole.start + 1 and torch.equal(cut.entry.values, whole.values[:, :, 1:])


def test_an_index_with_another_documents_tokens_is_never_served(make_tiny_engine, docs, rag_prompt):
    """The document index is a hint: a record whose token ids are not the text's (edited, swapped) is not
    used, and every strategy still sees the tokenizer's tokens."""
    engine = make_tiny_engine()
    engine.ingest(docs)
    real = engine.documents.get(docs[0].strip())
    other = engine.document(docs[1])
    forged = type(real)(real.doc_id, real.text, other.token_ids, other.chunks)
    engine.documents._by_text[real.text] = forged
    engine.documents._by_anchor[real.text[:32]] = [forged]
    prompt = rag_prompt(docs, "Who founded it?")
    truth = engine.tokenizer(engine.render(prompt))["input_ids"]
    for strategy in ("full", "naive", "cacheblend"):
        assert engine.plan(prompt, strategy).token_ids.tolist() == truth


def _save_tiny(folder, make_tiny_engine):
    engine = make_tiny_engine()
    engine.adapter.model.save_pretrained(folder)
    engine.tokenizer.save_pretrained(folder)


def test_an_edited_config_json_never_hits_the_old_store(tmp_path, make_tiny_engine, docs, rag_prompt):
    folder, store = tmp_path / "model", tmp_path / "store"
    _save_tiny(folder, make_tiny_engine)
    config = EngineConfig(store=StoreConfig(disk_dir=store))
    prompt = rag_prompt(docs, "Who founded it?")
    with KVBoost(load(str(folder)), config) as first:
        first.ingest(docs)
        first.prefill(prompt, "prefix")
        assert first.prefill(prompt, "prefix").exact_tokens > 0
        old = first.fingerprint
    settings = json.loads((folder / "config.json").read_text())
    settings["rope_parameters"]["rope_theta"] = 100.0
    (folder / "config.json").write_text(json.dumps(settings))
    with KVBoost(load(str(folder)), config) as second:
        assert second.fingerprint != old
        pre = second.prefill(prompt, "prefix", write_back=False)
        assert pre.exact_tokens == 0 and second.plan(prompt, "naive").count(EXACT) == 0
        truth = second.adapter.reference_logits(pre.plan.token_ids)[-1]
        assert (pre.logits - truth).abs().max() < 1e-4
        second.ingest(docs)
        assert second.counters["documents_computed"] == len(docs)


def test_the_fingerprint_covers_tokenizer_dtype_and_ingestion_context(make_tiny_engine, bundled_tokenizer):
    import copy

    from kvboost_rag import ChunkingConfig
    from kvboost_rag.models import LoadedModel

    base = make_tiny_engine()
    assert make_tiny_engine().fingerprint == base.fingerprint  # stable
    assert make_tiny_engine(EngineConfig(chunking=ChunkingConfig(doc_context="none"))).fingerprint != base.fingerprint
    model = base.adapter.model
    tokenizer = type(bundled_tokenizer).from_pretrained(bundled_tokenizer.name_or_path)
    tokenizer.add_tokens(["<kvboost-test>"])
    other = KVBoost(LoadedModel(model, tokenizer, "tiny-random-llama", "seed0"), EngineConfig())
    assert other.fingerprint != base.fingerprint
    half_model = copy.deepcopy(model).to(torch.bfloat16)
    half = KVBoost(LoadedModel(half_model, bundled_tokenizer, "tiny-random-llama", "seed0"),
                   EngineConfig(dtype="bfloat16"))
    assert half.fingerprint != base.fingerprint


def test_bad_text_is_refused_with_what_to_do(make_tiny_engine):
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match="document 0: .*NoneType.*pass a str"):
        engine.ingest([None])
    with pytest.raises(ValueError, match=r"document 0: .*bytes.*decode\('utf-8'\)"):
        engine.ingest([b"some text"])
    with pytest.raises(ValueError, match="document 0: .*lone surrogate"):
        engine.ingest(["text \udc80 more"])
    with pytest.raises(ValueError, match="prompt holds a lone surrogate"):
        engine.generate("question \ud800?", max_new_tokens=1)
    with pytest.raises(ValueError, match="content holds a lone surrogate"):
        engine.generate([{"role": "user", "content": "q \ud800"}], max_new_tokens=1)


def test_shared_context_chunks_are_written_once(tmp_path, make_tiny_engine, docs):
    engine = make_tiny_engine(EngineConfig(store=StoreConfig(disk_dir=tmp_path)))
    writes = []
    put = engine.store.put
    engine.store.put = lambda entry, pin=False: (writes.append(entry.prefix_key), put(entry, pin=pin))[1]
    engine.ingest(docs)
    context = len(engine._doc_context)
    chunks = sum(len(engine.document(d).chunks) for d in docs)
    assert context > 0 and len(writes) == context + chunks
    assert len(set(writes)) == len(writes)


def test_a_pin_that_does_not_fit_leaves_nothing_pinned(make_tiny_engine, docs):
    probe = make_tiny_engine()
    probe.ingest(docs[:1])
    one_doc = probe.store.nbytes
    engine = make_tiny_engine(EngineConfig(store=StoreConfig(memory_budget_bytes=one_doc * 2 // 3)))
    with pytest.raises(ValueError):
        engine.ingest(docs[:1], pin=True)
    assert engine.store.stats()["memory"]["pinned_bytes"] == 0
    # An ingest without pins, then with: the stored chunks are pinned as they are, not computed again.
    roomy = make_tiny_engine(EngineConfig(store=StoreConfig(memory_budget_bytes=one_doc * 4)))
    roomy.ingest(docs[:1])
    roomy.ingest(docs[:1], pin=True)
    assert roomy.counters["documents_computed"] == 1
    assert roomy.store.stats()["memory"]["pinned_bytes"] == roomy.store.nbytes


def test_the_ingestion_context_is_encoded_once_and_documents_attend_to_it(make_tiny_engine, docs):
    engine = make_tiny_engine()
    starts, rows = [], []
    run_layers = engine.adapter.run_layers
    engine.adapter.run_layers = lambda hidden, positions, *a, **kw: (
        starts.append(int(positions[0])), rows.append(hidden.shape[0]), run_layers(hidden, positions, *a, **kw))[2]
    engine.ingest(docs)
    offset = sum(len(tokens) for tokens, _ in engine._doc_context)
    # The context once, then the documents after it, side by side in one forward (they fit one batch).
    assert starts == [0, offset] and rows == [1, len(docs)]
    # What is stored is what one pass over context + document gives (fp32), whatever row it had in the batch.
    for row, (ids, read) in enumerate(engine._encode_after_context([engine.document(d) for d in docs])):
        keys, values = engine.adapter.reference_kv(ids)
        stored_keys, stored_values = read(offset, ids.shape[0])
        assert torch.allclose(stored_keys, keys[:, :, offset:], atol=1e-5), row
        assert torch.allclose(stored_values, values[:, :, offset:], atol=1e-5), row


def test_ingestion_batches_stay_under_their_token_budget_and_store_what_one_at_a_time_stores(make_tiny_engine, docs):
    texts = docs + [docs[0] + " " + docs[1], docs[2][:40]]  # unequal lengths: the short rows are padded
    longest = max(len(make_tiny_engine().document(t).token_ids) for t in texts)
    batched = make_tiny_engine(EngineConfig(ingest_batch_tokens=2 * longest))
    single = make_tiny_engine(EngineConfig(ingest_batch_tokens=1))
    batches = list(ingestion.batches([batched.document(t) for t in texts], 2 * longest))
    assert [doc.text for batch in batches for doc in batch] == [batched.document(t).text for t in texts]
    assert all(len(b) * max(len(doc.token_ids) for doc in b) <= 2 * longest for b in batches)
    assert 1 < max(len(b) for b in batches) < len(texts)
    assert batched.ingest(texts) == single.ingest(texts)
    for text in texts:
        doc = batched.document(text)
        for (start, _), (pkey, _) in batched._chunk_keys(doc):
            a, b = batched.store.get(pkey), single.store.get(pkey)
            assert a.token_ids == b.token_ids and a.start == b.start == start
            assert torch.allclose(a.keys.float(), b.keys.float(), atol=1e-4)
            assert torch.allclose(a.values.float(), b.values.float(), atol=1e-4)
