"""Drift correction on a tiny random model: the maps' frame, their fit, their file, and when they apply."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvboost_rag import EngineConfig, RepairConfig
from kvboost_rag.assembly import APPROX, EXACT, assemble
from kvboost_rag.calibrate import corpus_prompts, drift_samples
from kvboost_rag.config import StoreConfig
from kvboost_rag.drift import DriftMaps, fit


def affine_maps(adapter, scale: float = 1.0, bias: float | tuple[float, ...] = 0.0) -> DriftMaps:
    """x @ scale * I + bias at every layer and head; one map per place when `bias` is a tuple."""
    d, biases = adapter.head_dim, bias if isinstance(bias, tuple) else (bias,)
    w = torch.stack([torch.cat([scale * torch.eye(d), torch.full((1, d), b)]) for b in biases])  # [P, D + 1, D]
    w = w[:, None, None].expand(len(biases), adapter.num_layers, adapter.num_kv_heads, d + 1, d).clone()
    return DriftMaps(w, w.clone(), 1)


def naive_cache(engine, prompt, drift=None):
    p = engine.plan(prompt, "naive")
    cache = assemble(p, engine.adapter, p.num_tokens, drift=drift)
    # Positions without stored K/V are left uninitialized by assembly (a prefill writes them); zero them so
    # that comparisons see numbers, not whatever the memory held (NaN included).
    uncached = torch.isin(torch.arange(p.num_tokens), p.positions(APPROX), invert=True)
    cache.all_keys[:, 0, :, uncached] = 0
    cache.all_values[:, 0, :, uncached] = 0
    return p, cache


def error_from_truth(engine, prompt, maps=None) -> float:
    """Squared distance of the reused positions' assembled K/V (mapped by `maps`) from a full prefill's,
    over every layer after the first."""
    p, cache = naive_cache(engine, prompt, maps)
    reused = p.positions(APPROX)
    true_keys, true_values = engine.adapter.reference_kv(p.token_ids)
    return sum(float((cache.keys[i][0, :, reused] - true_keys[i][:, reused]).pow(2).sum()
                     + (cache.values[i][0, :, reused] - true_values[i][:, reused]).pow(2).sum())
               for i in range(1, engine.adapter.num_layers))


def unrotated(adapter, keys, positions):
    cos, sin = (t[0] for t in adapter.rope(positions, keys))
    return keys * cos - adapter.rotate_half(keys) * sin


def test_maps_act_on_reused_positions_in_the_unrotated_frame(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine()
    engine.ingest(docs)
    prompt = rag_prompt(docs[::-1], "Who founded the company?")
    engine.prefill(prompt, "naive")  # stores the template's opening: an exact hit next time
    p, cache = naive_cache(engine, prompt)
    reused, n = p.positions(APPROX), p.num_tokens
    assert p.count(EXACT) > 0 and any(c.start != c.entry.start for c in p.chunks if c.source == APPROX)
    before = [k[0, :, :n].clone() for k in cache.keys], [v[0, :, :n].clone() for v in cache.values]
    _, cache = naive_cache(engine, prompt, affine_maps(engine.adapter))  # identity
    for layer in range(engine.adapter.num_layers):
        torch.testing.assert_close(cache.keys[layer][0, :, :n], before[0][layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.values[layer][0, :, :n], before[1][layer])
    _, cache = naive_cache(engine, prompt, affine_maps(engine.adapter, bias=0.5))
    other = torch.isin(torch.arange(n), reused, invert=True)
    for layer in range(engine.adapter.num_layers):
        keys, old = cache.keys[layer][0, :, :n], before[0][layer]
        # A bias in the unrotated frame is the same shift for every reused token, whatever its position.
        shift = unrotated(engine.adapter, keys[:, reused], reused) - unrotated(engine.adapter, old[:, reused], reused)
        expected = 0.0 if layer == 0 else 0.5  # layer 0's K/V do not depend on context: left alone
        torch.testing.assert_close(shift, torch.full_like(shift, expected), atol=1e-4, rtol=0)
        assert torch.equal(keys[:, other], old[:, other])  # uncached and exact tokens untouched
        assert torch.equal(cache.values[layer][0, :, other], before[1][layer][:, other])


def test_each_reused_chunk_is_mapped_by_the_map_of_its_place(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine()
    engine.ingest(docs)
    p, before = naive_cache(engine, rag_prompt(docs[::-1], "Who founded the company?"))
    _, cache = naive_cache(engine, rag_prompt(docs[::-1], "Who founded the company?"), affine_maps(
        engine.adapter, bias=(0.5, -0.25, 0.125)))
    reused = [c for c in p.chunks if c.source == APPROX]
    assert len(reused) > 3  # places past the last map take the last map
    for place, chunk in enumerate(reused):
        span = torch.arange(chunk.start, chunk.end)
        for layer in range(1, engine.adapter.num_layers):
            shift = (unrotated(engine.adapter, cache.keys[layer][0][:, span], span)
                     - unrotated(engine.adapter, before.keys[layer][0][:, span], span))
            expected = (0.5, -0.25, 0.125)[min(place, 2)]
            torch.testing.assert_close(shift, torch.full_like(shift, expected), atol=1e-4, rtol=0)


def test_maps_per_place_fit_better_and_a_place_calibration_never_reached_takes_the_pooled_map(
        make_tiny_engine, docs):
    engine = make_tiny_engine()
    engine.ingest(docs)
    prompts = corpus_prompts(engine, docs, count=4, per_prompt=3)
    samples = drift_samples(engine, prompts)
    pooled, per_place = fit(engine.adapter, samples), fit(engine.adapter, samples, places=5)
    assert per_place.places == 5 and pooled.places == 1
    # Places 3 and 4 saw no calibration token: both get the map fitted on every place.
    for maps in (per_place.keys, per_place.values):
        assert torch.equal(maps[3], maps[4])
    torch.testing.assert_close(per_place.keys[4], pooled.keys[0])
    assert not torch.allclose(per_place.keys[0], pooled.keys[0], atol=1e-3)

    def error(maps):
        return sum(error_from_truth(engine, prompt, maps) for prompt in prompts)

    assert error(per_place) < error(pooled)  # a least-squares fit per place, on these very prompts
    with pytest.raises(ValueError, match="places must be >= 1"):
        fit(engine.adapter, samples, places=0)


def test_fitted_maps_bring_stale_kv_closer_to_the_truth(make_tiny_engine, docs):
    engine = make_tiny_engine()
    engine.ingest(docs)
    prompts = corpus_prompts(engine, docs, count=3, per_prompt=4)
    maps = fit(engine.adapter, drift_samples(engine, prompts))
    assert maps.prompts == 3
    for prompt in prompts:
        # least squares on these very prompts: strictly closer
        assert error_from_truth(engine, prompt, maps) < 0.9 * error_from_truth(engine, prompt)


def test_calibration_prompts_fit_the_context_window(make_tiny_engine, docs):
    engine = make_tiny_engine(max_position_embeddings=160)
    prompts = corpus_prompts(engine, docs, count=4, per_prompt=len(docs), seed=1)
    assert len(prompts) == 4
    for prompt in prompts:
        assert engine.plan(prompt, "full").num_tokens <= 160
    assert len({m[0]["content"] for m in prompts}) > 1  # drawn at random, not one fixed prompt

    def layout(documents):  # the application's own text before the documents
        return [{"role": "system", "content": "Answer from the documents."},
                {"role": "user", "content": "Documents:\n" + "\n\n".join(documents)}]

    laid_out = corpus_prompts(engine, docs, count=4, per_prompt=len(docs), seed=1, layout=layout)
    for prompt in laid_out:
        assert prompt[0]["role"] == "system" and prompt[1]["content"].startswith("Documents:\n")
        assert engine.plan(prompt, "full").num_tokens <= 160


def test_maps_apply_only_when_fitted_and_asked_for(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine()
    engine.ingest(docs)
    prompt = rag_prompt(docs[::-1], "Who founded the company?")
    off = RepairConfig(drift=False, fidelity="fast")
    stored = engine.prefill(prompt, "cacheblend", write_back=False, repair=off)
    assert engine.drift is None  # never fitted: the default (drift on) serves the stored K/V
    assert torch.equal(engine.prefill(prompt, "cacheblend", write_back=False).logits, stored.logits)
    engine.fit_drift(prompts=3, per_prompt=4)
    mapped = engine.prefill(prompt, "cacheblend", write_back=False)
    assert not torch.equal(mapped.logits, stored.logits)
    assert torch.equal(engine.prefill(prompt, "cacheblend", write_back=False, repair=off).logits, stored.logits)
    assert torch.equal(engine.prefill(prompt, "naive", write_back=False).logits,
                       engine.prefill(prompt, "cacheblend", write_back=False,
                                      repair=RepairConfig(recompute_ratio=0.0, drift=False, fidelity="fast")).logits)
    with pytest.raises(ValueError, match="at least two"):
        make_tiny_engine().fit_drift()


def test_saved_maps_are_found_by_the_next_engine_and_a_foreign_old_or_damaged_file_is_ignored(
        make_tiny_engine, docs, rag_prompt, tmp_path):
    config = EngineConfig(store=StoreConfig(disk_dir=tmp_path))
    first = make_tiny_engine(config)
    first.fit_drift(docs, prompts=3, per_prompt=4)
    assert first.drift_path.exists()
    prompt = rag_prompt(docs[::-1], "Who founded the company?")
    second = make_tiny_engine(config)
    assert torch.equal(second.drift.keys, first.drift.keys)
    assert torch.equal(second.prefill(prompt, "cacheblend", write_back=False).logits,
                       first.prefill(prompt, "cacheblend", write_back=False).logits)
    other = make_tiny_engine(config, seed=1)  # another model: its own file name; a copy of ours is refused
    assert other.drift is None
    other.drift_path.write_bytes(first.drift_path.read_bytes())
    with pytest.warns(UserWarning, match="not this model's, from an older kvboost-rag, or damaged"):
        assert make_tiny_engine(config, seed=1).drift is None
    with safe_open(str(first.drift_path), framework="pt") as f:
        old = dict(f.metadata(), version="0")
    save_file({"keys": first.drift.keys, "values": first.drift.values}, str(first.drift_path), metadata=old)
    with pytest.warns(UserWarning, match="from an older kvboost-rag"):
        assert make_tiny_engine(config).drift is None
    first.drift_path.write_bytes(b"not a safetensors file")
    with pytest.warns(UserWarning, match="refit them"):
        damaged = make_tiny_engine(config)
    assert damaged.drift is None
    assert torch.equal(damaged.prefill(prompt, "cacheblend", write_back=False).logits,
                       damaged.prefill(prompt, "cacheblend", write_back=False,
                                       repair=RepairConfig(drift=False, fidelity="fast")).logits)
