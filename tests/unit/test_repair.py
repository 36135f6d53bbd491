"""Boundary repair on a tiny random model: what is recomputed, what is left alone, and the limit r = 1."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvboost_rag import RepairConfig
from kvboost_rag.assembly import APPROX, COMPUTE, assemble
from kvboost_rag.repair.cacheblend import cacheblend_prefill, choose
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
    config = RepairConfig(check_layer=1, recompute_ratio=0.25)
    cache = assemble(plan, engine.adapter, n)
    before_k, before_v = snapshot(cache)
    with torch.inference_mode():
        _, recomputed = cacheblend_prefill(engine.adapter, cache, plan, config)
    reused = plan.positions(APPROX)
    uncached = plan.positions(COMPUTE)
    selected = recomputed[torch.isin(recomputed, reused)]
    assert selected.numel() == -(-reused.numel() // 4)  # ceil(r * reused)
    assert torch.isin(uncached, recomputed).all()
    keys_changed = changed_positions(before_k, cache.keys, n)
    values_changed = changed_positions(before_v, cache.values, n)
    in_recomputed = torch.isin(torch.arange(n), recomputed)
    for layer in range(config.check_layer + 1, engine.adapter.num_layers):
        # After the check layer only the selected and uncached tokens were written...
        assert not (keys_changed[layer] & ~in_recomputed).any()
        assert not (values_changed[layer] & ~in_recomputed).any()
        # ...and every selected reused token did change (its context differs from ingestion's).
        assert keys_changed[layer][selected].all()
    # Up to the check layer every non-exact token ran (layer 1 K/V depend on context).
    assert keys_changed[1][reused].float().mean() > 0.9


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


def test_cacheblend_with_everything_selected_is_a_full_prefill(reordered):
    engine, prompt = reordered
    full = engine.prefill(prompt, "full", write_back=False)
    blend = engine.prefill(prompt, "cacheblend", write_back=False, repair=RepairConfig(recompute_ratio=1.0))
    naive = engine.prefill(prompt, "naive", write_back=False)
    assert blend.recomputed_tokens == blend.prompt_tokens
    assert (blend.logits - full.logits).abs().max() < 1e-4
    assert (naive.logits - full.logits).abs().max() > 1e-3  # the comparison can see reuse


def test_selection_ranks_by_deviation_and_random_is_a_control():
    deviation = torch.tensor([0.0, 5.0, 1.0, 9.0, 3.0])
    candidates = torch.tensor([0, 1, 2, 3])  # index 4 is not a candidate
    assert sorted(choose(deviation, candidates, 2, "deviation", 0).tolist()) == [1, 3]
    picks = {tuple(sorted(choose(deviation, candidates, 2, "random", s).tolist())) for s in range(20)}
    assert len(picks) > 1 and all(set(p) <= {0, 1, 2, 3} for p in picks)
    with pytest.raises(ValueError, match="unknown select mode"):
        choose(deviation, candidates, 2, "best", 0)
