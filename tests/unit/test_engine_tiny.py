"""The engine on a tiny random-weight Llama: exactness of the machinery, keys, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvboost_rag import ChunkingConfig, EngineConfig, RepairConfig, StoreConfig
from kvboost_rag.adapter import ModelAdapter, UnsupportedModelError
from kvboost_rag.assembly import APPROX, CONTEXT_PASSAGE, EXACT
from kvboost_rag.cli import build_parser
from kvboost_rag.cli.common import engine_config


def first_token_gap(engine, prompt, strategy, **kw):
    pre = engine.prefill(prompt, strategy, write_back=False, **kw)
    reference = engine.adapter.reference_logits(pre.plan.token_ids)[-1]
    return (pre.logits - reference).abs().max().item(), pre


def test_full_strategy_matches_the_models_own_forward(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine()
    gap, pre = first_token_gap(engine, rag_prompt(docs, "Who founded it?"), "full")
    assert gap < 1e-4 and pre.reused_tokens == 0


def test_rerotation_matches_encoding_at_the_target_position(make_tiny_engine, docs):
    adapter = make_tiny_engine().adapter
    ids = adapter.model.config.vocab_size // 3 + torch.arange(40)
    k0, v0 = adapter.reference_kv(ids, start=0)
    k1, v1 = adapter.reference_kv(ids, start=257)
    moved = adapter.rotate_keys(k0, 257)
    assert (moved - k1).norm() / k1.norm() < 1e-5
    assert (v0 - v1).norm() / v1.norm() < 1e-5
    assert (k0 - k1).norm() / k1.norm() > 1e-2  # the test can see a wrong position


def _rotate_neighbours(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's pairing (channel 2i with 2i + 1), as some models write rotate_half."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


@pytest.mark.parametrize("way", ["halves", "matrix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rerotation_into_a_view_equals_rope_at_the_new_position(make_tiny_engine, monkeypatch, way, dtype):
    """Both ways rotate_keys moves keys (per-half products where channel i pairs with i + D/2, the rotation matrix
    for any other pairing), written into a strided view of a larger buffer: RoPE applied afresh at the new
    positions, to fp32 rounding (bf16: its own), and nothing outside the view touched."""
    adapter = make_tiny_engine().adapter
    assert adapter._splits_halves(adapter.head_dim)
    if way == "matrix":
        monkeypatch.setattr(adapter, "_splits_halves", lambda r: False)
    start, delta, count = 5, 300, 24
    unturned = torch.randn(adapter.num_layers, adapter.num_kv_heads, count, adapter.head_dim)

    def at(first):  # keys [L, H_kv, S, D] as RoPE places them at first .. first + S - 1
        return adapter.apply_rope(unturned, *adapter.rope_frame(torch.arange(first, first + count)), fused=False)

    buffer = torch.full((adapter.num_layers, adapter.num_kv_heads, 3 * count, adapter.head_dim), 7.0, dtype=dtype)
    view = buffer[:, :, count:2 * count]
    returned = adapter.rotate_keys(at(start).to(dtype), delta, out=view)
    truth = at(start + delta)
    assert returned.data_ptr() == view.data_ptr()
    assert (view.float() - truth).norm() / truth.norm() < (1e-5 if dtype == torch.float32 else 1e-2)
    assert (at(start) - truth).norm() / truth.norm() > 1e-1  # the test can see a wrong position
    assert bool((buffer[:, :, :count] == 7.0).all()) and bool((buffer[:, :, 2 * count:] == 7.0).all())
    assert torch.equal(adapter.rotate_keys(at(start).to(dtype), delta), view)  # a new tensor, the same numbers


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("partial", [False, True])
def test_fused_rope_by_halves_equals_the_models_form(make_tiny_engine, inverse, partial):
    """apply_rope's fused path (products per half, into `out`, bf16 keys promoted to the fp32 frame) against the
    model's own form, rotate_half and all: per-token frames, forwards and back, full and partial rotary."""
    adapter = make_tiny_engine().adapter
    count, dim = 17, adapter.head_dim
    cos, sin = adapter.rope_frame(torch.arange(40, 40 + count))  # [1, 1, S, D]
    if partial:
        r = dim // 2
        angles = torch.atan2(sin, cos)[..., :r // 2]
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    keys = torch.randn(adapter.num_layers, adapter.num_kv_heads, count, dim).to(torch.bfloat16)
    truth = adapter.apply_rope(keys.float(), cos, sin, inverse=inverse, fused=False)
    fused = adapter.apply_rope(keys, cos, sin, inverse=inverse)
    assert fused.dtype == torch.float32 and fused.shape == keys.shape
    torch.testing.assert_close(fused, truth, atol=1e-6, rtol=1e-6)
    out = torch.full((adapter.num_layers, adapter.num_kv_heads, count + 4, dim), 7.0)[:, :, 2:2 + count]
    assert adapter.apply_rope(keys, cos, sin, inverse=inverse, out=out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, truth, atol=1e-6, rtol=1e-6)
    assert (truth - keys.float()).abs().max() > 1e-2  # the frame turns something


def test_other_rope_pairings_take_the_matrix(make_tiny_engine, monkeypatch):
    adapter = make_tiny_engine().adapter
    monkeypatch.setattr(adapter, "rotate_half", _rotate_neighbours)
    assert not adapter._splits_halves(adapter.head_dim)


def test_exact_prefix_hit_equals_full_prefill(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine()
    prompt = rag_prompt(docs, "Who founded it?")
    first = engine.prefill(prompt, "prefix")
    assert first.exact_tokens == 0
    gap, again = first_token_gap(engine, prompt, "prefix")
    # Every token an exact hit; the last one is run again for its logits, so it is not counted as reused.
    assert again.plan.count(EXACT) == again.prompt_tokens and again.recomputed_tokens == 1
    assert again.exact_tokens == again.reused_tokens == again.prompt_tokens - 1
    assert gap < 1e-4


def test_reordered_documents_are_content_hits_and_prefix_misses(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine(EngineConfig(chunking=ChunkingConfig(doc_context="none")))
    engine.ingest(docs)
    pre = engine.prefill(rag_prompt(docs[::-1], "Where?"), "naive", write_back=False)
    sources = [c.source for c in pre.plan.chunks if c.is_document]
    assert sources == [APPROX] * len(docs)
    assert pre.reused_tokens > 0.8 * pre.prompt_tokens
    # Encoded alone, a document placed first after nothing is an exact prefix hit: its ingested context is the truth.
    bare = engine.prefill(docs[0], "prefix", write_back=False)
    assert [c.source for c in bare.plan.chunks] == [EXACT]


def test_passage_context_stores_a_document_as_encoded_after_it(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine()  # "passage" is the default
    assert engine.config.chunking.doc_context == "passage"
    alone = make_tiny_engine(EngineConfig(chunking=ChunkingConfig(doc_context="none")))
    assert engine.fingerprint != alone.fingerprint  # a store never mixes the two encodings
    context = [t for tokens, _ in engine._doc_context for t in tokens]
    passage = engine.tokenizer(CONTEXT_PASSAGE, add_special_tokens=False)["input_ids"]
    # The opening, the passage, then a blank line tokenized as a prompt tokenizes it before a document.
    blank = engine.tokenizer("\n\nDocument", add_special_tokens=False)["input_ids"][:-1]
    assert context[-len(passage) - len(blank):] == passage + blank and len(blank) == 2
    engine.ingest(docs[:2])
    pre = engine.prefill(rag_prompt(docs[:2][::-1], "Who?"), "naive", write_back=False)
    entries = [c.entry for c in pre.plan.chunks if c.is_document]
    assert [e.start for e in entries] == [len(context)] * 2
    doc = list(entries[0].token_ids)
    keys, values = engine.adapter.reference_kv(torch.tensor(context + doc))
    assert torch.allclose(entries[0].keys, keys[:, :, len(context):], atol=1e-4)
    assert torch.allclose(entries[0].values, values[:, :, len(context):], atol=1e-4)
    with pytest.raises(ValueError, match="unknown doc_context 'magic'; use one of none, template, passage"):
        make_tiny_engine(EngineConfig(chunking=ChunkingConfig(doc_context="magic")))


def test_another_model_never_hits(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine()
    engine.ingest(docs)
    other = make_tiny_engine(seed=1, store=engine.store)  # same store, other weights digest
    assert other.fingerprint != engine.fingerprint
    other.ingest([docs[0]])  # so its index knows the text
    pre = other.prefill(rag_prompt(docs, "Where?"), "naive", write_back=False)
    assert pre.plan.count(APPROX) == len(other.document(docs[0]).token_ids)  # only its own ingestion


def test_nothing_half_computed_is_stored_and_bad_input_is_explained(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine(EngineConfig(store=StoreConfig()))
    with pytest.raises(ValueError, match="document 1: empty document"):
        engine.ingest([docs[0], "   "])
    with pytest.raises(TypeError, match="list"):
        engine.ingest(docs[0])
    with pytest.raises(ValueError, match="unknown strategy 'magic'"):
        engine.generate(rag_prompt(docs, "q"), strategy="magic")
    with pytest.raises(ValueError, match="context window"):
        engine.generate("word " * 5000, strategy="full", max_new_tokens=4)
    with pytest.raises(ValueError, match="context window"):
        engine.ingest(["word " * 5000])


def test_unsupported_model_is_refused_with_what_is_missing():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelAdapter(model)


def test_rope_that_does_not_compose_refuses_reuse(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert not engine.adapter.rope_composes
    engine.ingest(docs)
    with pytest.raises(UnsupportedModelError, match="does not compose"):
        engine.prefill(rag_prompt(docs[::-1], "q"), "naive")
    # Exact reuse needs no rotation and still works.
    engine.prefill(rag_prompt(docs, "q"), "prefix")
    assert engine.prefill(rag_prompt(docs, "q"), "prefix").exact_tokens > 0


def test_stream_and_stop_strings(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine()
    prompt = rag_prompt(docs, "q")
    out = engine.generate(prompt, max_new_tokens=12, strategy="full")
    pieces = list(engine.stream(prompt, max_new_tokens=12, strategy="full"))
    assert "".join(p.text for p in pieces) == out.text and pieces[-1].result.text == out.text
    assert out.generated_tokens == 12 and out.finish_reason == "length"
    if len(out.text) > 4:
        stop = out.text[2:4]
        cut = engine.generate(prompt, max_new_tokens=12, strategy="full", stop=[stop])
        assert cut.text == out.text[: out.text.find(stop)] and cut.finish_reason == "stop"
    sampled = [engine.generate(prompt, max_new_tokens=8, strategy="full", temperature=1.0, seed=s).token_ids
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


def test_cli_repair_options_reach_the_engine_config():
    parser = build_parser()
    args = parser.parse_args(["ask", "q?", "--docs", "a.txt", "--no-drift", "--taper", "2", "--recency", "2",
                              "--size-multiple", "0"])
    repair = engine_config(args).repair
    assert (repair.drift, repair.taper, repair.recency, repair.size_multiple) == (False, 2.0, 2.0, 0)
    # Every RepairConfig field has its flag, with the field's default; ingest answers nothing: no repair flags.
    assert {a.dest for a in parser._subparsers._group_actions[0].choices["ask"]._actions} >= set(
        f.name for f in dataclasses.fields(RepairConfig))
    assert not {a.dest for a in parser._subparsers._group_actions[0].choices["ingest"]._actions} & set(
        f.name for f in dataclasses.fields(RepairConfig))
    assert engine_config(parser.parse_args(["ask", "q?", "--docs", "a.txt"])).repair == RepairConfig()
    # An engine option of every command (packing.py's transposed copies), on by default.
    for command in (["ask", "q?", "--docs", "a.txt"], ["ingest", "a.txt"]):
        assert engine_config(parser.parse_args(command)).transposed_weights
        assert not engine_config(parser.parse_args([*command, "--no-transposed-weights"])).transposed_weights
