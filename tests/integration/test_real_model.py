"""The truths, on the bundled SmolLM2-135M-Instruct in fp32: exact reuse is exact, approximate reuse
is measurably off, and repair brings it back towards a full prefill."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvboost_rag import ChunkingConfig, EngineConfig, KVBoost, RepairConfig, StoreConfig
from kvboost_rag.bench.data import bundled
from kvboost_rag.bench.run import kl


def test_rerotation_is_exact_on_every_layer(real_engine, docs):
    adapter = real_engine.adapter
    ids = torch.tensor(real_engine.document(docs[0]).token_ids)
    k0, _ = adapter.reference_kv(ids, start=0)
    for offset in (37, 700):
        k_at, v_at = adapter.reference_kv(ids, start=offset)
        moved = adapter.rotate_keys(k0, offset)
        for layer in range(adapter.num_layers):
            err = (moved[layer] - k_at[layer]).norm() / k_at[layer].norm()
            assert err <= 1e-4, (offset, layer, float(err))


def test_repeated_and_extended_prompts_reuse_the_exact_prefix(real_engine, docs, rag_prompt):
    engine = real_engine
    prompt = rag_prompt(docs, "In what year was the Halvorsen Brewing Company founded?")
    first = engine.generate(prompt, strategy="prefix", max_new_tokens=12)
    assert first.exact_tokens == 0
    repeat = engine.prefill(prompt, "prefix", max_new_tokens=12)
    truth = engine.adapter.reference_logits(repeat.plan.token_ids)[-1]
    # Every token an exact hit; the last one runs again for its logits, so it is not counted as reused.
    assert repeat.exact_tokens == repeat.reused_tokens == repeat.prompt_tokens - 1
    assert (repeat.logits - truth).abs().max() <= 1e-3
    again = engine.generate(prompt, strategy="prefix", max_new_tokens=12)
    full = engine.generate(prompt, strategy="full", max_new_tokens=12)
    assert again.text == full.text == first.text
    # Extended by a new turn: the shared head is reused exactly, the answer is the full prefill's.
    extended = prompt + [{"role": "assistant", "content": first.text},
                         {"role": "user", "content": "Who founded the Halvard Brewing Company?"}]
    ext = engine.prefill(extended, "cacheblend", max_new_tokens=12)
    truth = engine.adapter.reference_logits(ext.plan.token_ids)[-1]
    assert ext.exact_tokens > 0.8 * repeat.prompt_tokens
    assert (ext.logits - truth).abs().max() <= 1e-3
    assert (engine.generate(extended, strategy="prefix", max_new_tokens=12).text
            == engine.generate(extended, strategy="full", max_new_tokens=12).text)


def mean_first_token_kl(engine, prompts, runs: dict) -> dict:
    """Mean first-token KL(full || run) over prompts, for each named (strategy, repair) run."""
    totals = dict.fromkeys(runs, 0.0)
    for prompt in prompts:
        full = engine.prefill(prompt, "full", write_back=False)
        for name, (strategy, repair) in runs.items():
            other = engine.prefill(prompt, strategy, write_back=False, repair=repair)
            totals[name] += float(kl(full.logits[None], other.logits[None])[0]) / len(prompts)
    return totals


def test_naive_reuse_deviates_and_repair_reduces_the_deviation(real_engine, docs, rag_prompt):
    engine = real_engine
    engine.ingest(docs)
    questions = ["In what year was the Halvorsen Brewing Company founded?",
                 "How many works did Mira Castellane complete?", "Who founded the Halvard Brewing Company?"]
    orders = [[3, 1, 0, 2], [2, 0, 3, 1], [1, 3, 2, 0]]
    prompts = [rag_prompt([docs[i] for i in order], q) for q, order in zip(questions, orders, strict=True)]
    kls = mean_first_token_kl(engine, prompts, {
        "naive": ("naive", None), "selective": ("selective", None), "cacheblend": ("cacheblend", None),
        "everything": ("cacheblend", RepairConfig(recompute_ratio=1.0))})
    assert kls["naive"] > 0.01, kls  # the deviation is visible
    assert kls["selective"] < kls["naive"] and kls["cacheblend"] < kls["naive"], kls
    assert kls["everything"] < 1e-6, kls


def test_cacheblend_everything_matches_full_prefill(real_engine, docs, rag_prompt):
    real_engine.ingest(docs)
    prompt = rag_prompt(docs[::-1], "Who founded the Halvard Brewing Company?")
    full = real_engine.prefill(prompt, "full", write_back=False)
    blend = real_engine.prefill(prompt, "cacheblend", write_back=False, repair=RepairConfig(recompute_ratio=1.0))
    assert (blend.logits - full.logits).abs().max() <= 1e-3


def test_template_context_ingestion_stores_documents_after_the_chat_opening(real_loaded, docs, rag_prompt):
    engine = KVBoost(real_loaded, EngineConfig(chunking=ChunkingConfig(doc_context="template")))
    plain = KVBoost(real_loaded, EngineConfig())
    assert engine.fingerprint != plain.fingerprint
    engine.ingest(docs[:2])
    pre = engine.prefill(rag_prompt(docs[:2][::-1], "Who founded it?"), "naive", write_back=False)
    entries = [c.entry for c in pre.plan.chunks if c.is_document]
    assert all(e is not None and e.start > 10 for e in entries)  # encoded after the template's opening
    # A prompt that opens with the model's default template then the document is an exact hit.
    default = engine.prefill([{"role": "user", "content": docs[0] + "\n\nQuestion: Who?"}], "prefix",
                             write_back=False)
    assert default.exact_tokens >= len(engine.document(docs[0]).token_ids)


def test_passage_context_stores_documents_closer_to_their_kv_inside_a_prompt(real_loaded, docs, rag_prompt):
    """Why doc_context="passage" helps: every document stored alone carries a prompt start's KV (its first
    token a sink), wherever it is placed; encoded after a passage it is nearer what a full prefill computes
    for a document after others."""
    prompt = rag_prompt(docs[:4], "Who founded the Halvard Brewing Company?")
    distance = {}
    for context in ("none", "passage"):
        engine = KVBoost(real_loaded, EngineConfig(chunking=ChunkingConfig(doc_context=context)))
        engine.ingest(docs[:4])
        naive = engine.prefill(prompt, "naive", write_back=False)
        full = engine.prefill(prompt, "full", write_back=False)
        later = torch.cat([torch.arange(c.start, c.end) for c in naive.plan.chunks if c.is_document][1:])
        per_layer = [(naive.cache.keys[i][:, :, later] - full.cache.keys[i][:, :, later]).norm()
                     / full.cache.keys[i][:, :, later].norm() for i in range(engine.adapter.num_layers)]
        distance[context] = float(torch.stack(per_layer).mean())
    assert distance["passage"] < 0.8 * distance["none"], distance


def test_bench_command_end_to_end(tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "kvboost_rag.cli", "bench", "--data", str(bundled("tiny")), "--max-new-tokens",
           "4", "--json", str(out), "--plot", str(tmp_path / "plot.png")]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    report = json.loads(out.read_text())
    assert report["items"] == 3
    # The floors come last: the dtype floor (--noise-floor auto: a float32 bench gets a bf16 full prefill), then the
    # order floor (--order-floor on: a full prefill of the documents reversed).
    assert list(report["strategies"]) == ["full", "prefix", "naive", "selective", "cacheblend", "full (bfloat16)",
                                          "full (documents reversed)"]
    assert report["strategies"]["full (documents reversed)"]["reuse_fraction"] == 0
    for row in report["strategies"].values():
        assert set(row) >= {"ttft_ms", "speedup", "accuracy", "agreement", "first_token_kl", "continuation_kl",
                            "recompute_fraction", "reuse_fraction", "prompt_tokens"}
    assert report["strategies"]["full"]["first_token_kl"] == 0
    assert report["strategies"]["naive"]["reuse_fraction"] > 0.5
    assert (tmp_path / "plot.png").stat().st_size > 1000


@pytest.mark.parametrize("bits", [8])
def test_quantized_store_serves_close_answers(real_loaded, docs, rag_prompt, bits):
    exact = KVBoost(real_loaded, EngineConfig())
    quant = KVBoost(real_loaded, EngineConfig(store=StoreConfig(kv_bits=bits)))
    prompt = rag_prompt(docs[::-1], "Who founded the Halvard Brewing Company?")
    for engine in (exact, quant):
        engine.ingest(docs)
    a = exact.prefill(prompt, "naive", write_back=False)
    b = quant.prefill(prompt, "naive", write_back=False)
    assert float(kl(a.logits[None], b.logits[None])[0]) < 0.01
