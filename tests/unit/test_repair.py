"""Boundary repair on a tiny random model: what is recomputed, what is left alone, and the limit r = 1."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvboost_rag import RepairConfig
from kvboost_rag.assembly import APPROX, COMPUTE, assemble
from kvboost_rag.repair import cacheblend
from kvboost_rag.repair.cacheblend import cacheblend_prefill, layer_fractions, top_deviations
from kvboost_rag.repair.selective import selective_positions


@pytest.fixture
def reordered(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine()
    engine.ingest(docs)
    return engine, rag_prompt(docs[::-1], "Who founded the company?")


def snapshot(cache):
    return [k.clone() for k in cache.keys], [v.clone() for v in cache.values]


def changed_positions(before, after_tensors, n) -> torch.Tensor:
    """Positions (< n) whose K differ, per layer: list of bool [n]."""
    return [(b[0, :, :n] != a[0, :, :n]).any(dim=(0, 2)) for b, a in zip(before, after_tensors, strict=True)]


def test_cacheblend_writes_exactly_the_selected_positions(reordered):
    engine, prompt = reordered
    plan = engine.plan(prompt, "cacheblend")
    n = plan.num_tokens
    config = RepairConfig(check_layer=1, recompute_ratio=0.25, taper=4.0, size_multiple=0)
    cache = assemble(plan, engine.adapter, n)
    before_k, before_v = snapshot(cache)
    with torch.inference_mode():
        result = cacheblend_prefill(engine.adapter, cache, plan, config)
    reused = plan.positions(APPROX)
    uncached = plan.positions(COMPUTE)
    sets = result.layer_positions
    assert len(sets) == engine.adapter.num_layers - config.check_layer - 1
    fractions = layer_fractions(0.25, 4.0, len(sets))
    keys_changed = changed_positions(before_k, cache.keys, n)
    values_changed = changed_positions(before_v, cache.values, n)
    for j, positions in enumerate(sets):
        layer = config.check_layer + 1 + j
        selected = positions[torch.isin(positions, reused)]
        assert selected.numel() == math.ceil(fractions[j] * reused.numel())
        assert torch.isin(uncached, positions).all()
        if j:  # the set only shrinks: a token dropped once keeps its cached K/V in all deeper layers
            assert torch.isin(positions, sets[j - 1]).all() and positions.numel() < sets[j - 1].numel()
        # After the check layer only that layer's set was written...
        in_set = torch.isin(torch.arange(n), positions)
        assert not (keys_changed[layer] & ~in_set).any()
        assert not (values_changed[layer] & ~in_set).any()
        # ...and every selected reused token did change (its context differs from ingestion's).
        assert keys_changed[layer][selected].all()
    # Up to the check layer every non-exact token ran (layer 1 K/V depend on context).
    assert keys_changed[1][reused].float().mean() > 0.9


def test_layer_fractions_average_to_the_budget_and_taper():
    for average, taper in ((0.15, 8.0), (0.3, 2.0), (0.05, 1.0), (0.6, 8.0)):
        fractions = layer_fractions(average, taper, 28)
        assert abs(sum(fractions) / 28 - average) < 1e-6
        assert all(a >= b for a, b in zip(fractions, fractions[1:], strict=False))
        assert all(0.0 <= f <= 1.0 for f in fractions)
    assert layer_fractions(0.15, 8.0, 28)[0] / layer_fractions(0.15, 8.0, 28)[-1] == pytest.approx(8.0)
    assert layer_fractions(0.2, 1.0, 10) == pytest.approx([0.2] * 10)  # taper 1: one set, original CacheBlend
    assert layer_fractions(1.0, 8.0, 5) == [1.0] * 5 and layer_fractions(0.0, 8.0, 5) == [0.0] * 5
    assert layer_fractions(0.3, 8.0, 0) == []


def test_recency_weight_prefers_later_tokens_at_equal_deviation(reordered, monkeypatch):
    """With deviation flattened, the recency weight alone decides: the set after the check keeps the
    latest reused tokens."""
    engine, prompt = reordered
    plan = engine.plan(prompt, "cacheblend")
    reused = plan.positions(APPROX)
    config = RepairConfig(check_layer=0, recompute_ratio=0.2, taper=1.0, recency=1.0, size_multiple=0)
    monkeypatch.setattr(cacheblend, "kv_deviation", lambda fresh, cached: torch.ones(fresh[0].shape[2]))
    with torch.inference_mode():
        result = cacheblend_prefill(engine.adapter, assemble(plan, engine.adapter, plan.num_tokens), plan, config)
    selected = result.layer_positions[0][torch.isin(result.layer_positions[0], reused)]
    assert torch.equal(selected, reused[-selected.numel():])


def test_selective_recomputes_chunk_heads_and_uncached_tokens(reordered):
    engine, prompt = reordered
    plan = engine.plan(prompt, "selective")
    positions = selective_positions(plan, boundary_tokens=5)
    heads = torch.cat([torch.arange(c.start, c.start + 5) for c in plan.chunks if c.source == APPROX])
    expected = torch.unique(torch.cat([plan.positions(COMPUTE), heads, torch.tensor([plan.num_tokens - 1])]))
    assert torch.equal(positions, expected)
    pre = engine.prefill(prompt, "selective", write_back=False,
                         repair=dataclasses.replace(engine.config.repair, boundary_tokens=5))
    assert pre.recomputed_tokens == expected.numel()
    assert pre.reused_tokens == plan.num_tokens - expected.numel()


def test_cacheblend_budget_ends_are_full_prefill_and_naive_reuse(reordered):
    engine, prompt = reordered
    full = engine.prefill(prompt, "full", write_back=False)
    blend = engine.prefill(prompt, "cacheblend", write_back=False,
                           repair=RepairConfig(recompute_ratio=1.0, fidelity="fast"))
    naive = engine.prefill(prompt, "naive", write_back=False)
    assert blend.recomputed_tokens == blend.prompt_tokens
    assert (blend.logits - full.logits).abs().max() < 1e-4
    assert (naive.logits - full.logits).abs().max() > 1e-3  # the comparison can see reuse
    none = engine.prefill(prompt, "cacheblend", write_back=False,
                          repair=RepairConfig(recompute_ratio=0.0, drift=False, fidelity="fast"))
    assert none.recomputed_tokens == naive.recomputed_tokens and torch.equal(none.logits, naive.logits)


def test_strict_repairs_more_than_balanced_unless_a_budget_is_given(reordered):
    engine, prompt = reordered
    plan = engine.plan(prompt, "cacheblend")

    def recomputed(repair: RepairConfig) -> int:  # the repair alone: the guard may fall back on a random model
        with torch.inference_mode():
            return cacheblend_prefill(engine.adapter, assemble(plan, engine.adapter, plan.num_tokens), plan,
                                      dataclasses.replace(repair, size_multiple=0)).recomputed_tokens

    runs = {name: recomputed(repair) for name, repair in (
        ("balanced", RepairConfig()), ("strict", RepairConfig(fidelity="strict")),
        ("strict at balanced's", RepairConfig(fidelity="strict", recompute_ratio=0.07)),
        ("fast", RepairConfig(fidelity="fast")), ("0.15 given", RepairConfig(recompute_ratio=0.15)))}
    assert runs["strict"] == runs["0.15 given"] > runs["balanced"] == runs["strict at balanced's"] == runs["fast"], runs


def test_selection_ranks_by_deviation():
    deviation = torch.tensor([0.0, 5.0, 1.0, 9.0, 3.0])
    candidates = torch.tensor([0, 1, 2, 3])  # index 4 is not a candidate
    assert sorted(top_deviations(deviation, candidates, 2).tolist()) == [1, 3]
    assert top_deviations(deviation, candidates, 0).numel() == 0
    assert sorted(top_deviations(deviation, candidates, 9).tolist()) == [0, 1, 2, 3]


def test_projected_kv_is_what_the_layer_writes(reordered):
    """The repair refreshes dropped tokens' K/V by projection alone; it must equal the layer's own write."""
    engine, prompt = reordered
    adapter = engine.adapter
    plan = engine.plan(prompt, "full")
    n = plan.num_tokens
    positions = torch.arange(n)
    cache = adapter.new_buffers(n)
    with torch.inference_mode():
        hidden = adapter.run_layers(adapter.embed(plan.token_ids), positions, cache, range(2), n)
        keys, values = adapter.project_kv(2, hidden, positions)
        adapter.run_layers(hidden, positions, cache, range(2, 3), n)
    assert torch.allclose(keys, cache.keys[2][:, :, :n], atol=1e-5, rtol=1e-5)
    assert torch.allclose(values, cache.values[2][:, :, :n], atol=1e-5, rtol=1e-5)


def test_size_multiple_rounds_every_set(reordered):
    engine, prompt = reordered
    plan = engine.plan(prompt, "cacheblend")
    everything = torch.unique(torch.cat([plan.positions(APPROX), plan.positions(COMPUTE)])).numel()
    with torch.inference_mode():
        sizes = {}
        for multiple in (0, 8):
            config = RepairConfig(check_layer=0, recompute_ratio=0.3, size_multiple=multiple)
            cache = assemble(plan, engine.adapter, plan.num_tokens)
            result = cacheblend_prefill(engine.adapter, cache, plan, config)
            sizes[multiple] = [p.numel() for p in result.layer_positions]
    assert all(size % 8 == 0 or size == everything for size in sizes[8]), sizes
    assert sizes[8] != sizes[0] and all(abs(a - b) <= 4 for a, b in zip(sizes[8], sizes[0], strict=True)), sizes

    def auto_sizes():  # size_multiple left at its default: exact in fp32, 16 in bf16
        with torch.inference_mode():
            config = RepairConfig(check_layer=0, recompute_ratio=0.3)
            cache = assemble(plan, engine.adapter, plan.num_tokens)
            return [p.numel() for p in cacheblend_prefill(engine.adapter, cache, plan, config).layer_positions]

    assert auto_sizes() == sizes[0]
    engine.adapter.model.to(torch.bfloat16)
    assert all(size % 16 == 0 or size == everything for size in auto_sizes())


def test_rounded_sets_do_not_depend_on_the_template_being_a_cache_hit(make_tiny_engine, docs, rag_prompt):
    """With rounding on, a request and its repeat (whose opening text was written back in between, so is
    now an exact hit instead of computed) choose the same reused tokens at every layer."""
    engine = make_tiny_engine(num_hidden_layers=8)  # several repaired layers with sets to round
    engine.adapter.model.to(torch.bfloat16)  # rounding is on by default in 16-bit floats
    engine.ingest(docs)
    # A short system text: the opening (computed, then a hit) is not a multiple of 16 tokens long.
    prompt = [{"role": "system", "content": "Answer."}, rag_prompt(docs[::-1], "Who founded the company?")[-1]]

    def reused_sets():
        plan = engine.plan(prompt, "cacheblend")
        with torch.inference_mode():
            result = cacheblend_prefill(engine.adapter, assemble(plan, engine.adapter, plan.num_tokens), plan,
                                        RepairConfig(recompute_ratio=0.3))
        reused = plan.positions(APPROX)
        return plan, [p[torch.isin(p, reused)].tolist() for p in result.layer_positions]

    first_plan, first = reused_sets()
    engine.prefill(prompt, "cacheblend", write_back=True)  # stores the opening text's chunks
    second_plan, second = reused_sets()
    opening = second_plan.count("exact") - first_plan.count("exact")  # computed first, a hit now
    assert opening > 0 and opening % 16
    assert first == second


def test_prefix_reuses_a_short_cached_prefix_and_a_long_one(make_tiny_engine, docs, rag_prompt):
    """Any cached prefix is reused, the template's opening as well as a whole repeat, and gives full's logits."""
    engine = make_tiny_engine()
    prompt = rag_prompt(docs, "Who founded the company?")
    engine.ingest(docs)
    rendered = engine.render(prompt)
    engine.prefill(rendered[:rendered.index(docs[0])], "prefix")  # the opening, stored under its prefix keys
    full = engine.prefill(prompt, "full", write_back=False)
    short = engine.prefill(prompt, "prefix", write_back=False)
    assert 0 < short.exact_tokens < 0.25 * short.prompt_tokens
    assert short.recomputed_tokens == short.prompt_tokens - short.exact_tokens
    assert (short.logits - full.logits).abs().max() < 1e-4
    engine.prefill(prompt, "prefix")  # written back: the repeat is all exact hits
    long = engine.prefill(prompt, "prefix", write_back=False)
    assert long.recomputed_tokens < 0.1 * long.prompt_tokens
    assert (long.logits - full.logits).abs().max() < 1e-4
