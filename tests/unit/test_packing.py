"""Linear weights laid out once for the CPU's kernels (packing.py): packed for oneDNN in bf16, the same numbers bit
for bit; transposed beside the weight as stored in float32, for inputs of a few rows; nothing else changed."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvboost_rag import EngineConfig, KVBoost, RepairConfig, batching, packing
from kvboost_rag.adapter import ModelAdapter
from kvboost_rag.calibrate import MIN_DOCUMENTS, _other_dtype
from kvboost_rag.models import LoadedModel, WidenedLinear, bf16_copy, in_dtype
from kvboost_rag.packing import (
    COLUMN_ROWS,
    ColumnsLinear,
    PackedLinear,
    Siblings,
    can_pack,
    column_linears,
    pack_linears,
)

needs_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU's oneDNN has no bf16 kernels to pack for")


def _tiny(dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama, built here (tests.conftest is not importable beside the integrations' conftest)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval().to(dtype)


def _linears(model) -> dict[str, type]:
    return {name: type(module) for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, PackedLinear))}


@pytest.fixture
def columns_pay(monkeypatch):
    """Transposed copies made whatever this machine's probe finds (packing.columns_pay times MKL's paths)."""
    monkeypatch.setattr(packing, "columns_pay", lambda device: True)


def test_a_cpu_that_emulates_bf16_packs_nothing(monkeypatch):
    """Without bf16 instructions oneDNN's packed and plain bf16 kernels round apart on real shapes: nothing is
    packed there, whatever the probe's small linear says."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_f": True, "avx512_bf16": False})
    model = _tiny(torch.bfloat16)
    assert not can_pack(torch.bfloat16, torch.device("cpu"))
    assert pack_linears(model) == 0 and set(_linears(model).values()) == {torch.nn.Linear}


@pytest.mark.parametrize("native", [True, False])
def test_the_dtype_floors_bf16_copy_runs_float32_kernels_only_where_bf16_is_emulated(monkeypatch, native):
    """Calibration's dtype floor (models.bf16_copy): where bf16 is emulated, its linears compute bf16 arithmetic
    (bf16 operands, float32 sums, one rounding to bf16) in float32 kernels; where bf16 is native, plain bf16."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_f": True, "avx512_bf16": native})
    source = _tiny(torch.float32)
    for copied in (bf16_copy(source), _other_dtype(source)):
        assert set(_linears(copied).values()) == ({torch.nn.Linear} if native else {WidenedLinear})
        assert {p.dtype for p in copied.parameters()} == {torch.bfloat16}
        x = torch.randn(40, 64).to(torch.bfloat16)
        out = copied.lm_head(x)
        exact = torch.nn.functional.linear(x.double(), copied.lm_head.weight.double()).to(torch.bfloat16)
        assert out.dtype == torch.bfloat16
        assert (out != exact).float().mean() < 1e-3  # the exact product's rounding, but at near-ties
    assert set(_linears(source).values()) == {torch.nn.Linear}  # the engine's model untouched
    assert {p.dtype for p in source.parameters()} == {torch.float32}


@needs_bf16
def test_a_packed_bf16_model_computes_the_same_logits_bit_for_bit():
    plain, packed = _tiny(torch.bfloat16), _tiny(torch.bfloat16)
    state = {name: tensor.clone() for name, tensor in packed.state_dict().items()}
    swapped = pack_linears(packed)
    # Every linear (7 per layer and the head) is swapped; the state dict (names and values) is unchanged.
    assert swapped == 7 * packed.config.num_hidden_layers + 1
    assert set(_linears(packed).values()) == {PackedLinear}
    # q/k/v and gate/up of every layer run as one call each (the head and o/down alone).
    fused = [name for name, module in packed.named_modules() if getattr(module, "siblings", None) is not None]
    assert len(fused) == 5 * packed.config.num_hidden_layers
    assert packed.state_dict().keys() == state.keys()
    assert all(torch.equal(packed.state_dict()[name], tensor) for name, tensor in state.items())
    ids = torch.randint(0, packed.config.vocab_size, (1, 37))
    with torch.inference_mode():
        for rows in (ids, ids[:, :1], ids[:, :5]):  # a prefill, a decode step, a few tokens
            assert torch.equal(packed(rows).logits, plain(rows).logits)


@needs_bf16
def test_tied_weights_stay_tied_and_are_packed_once():
    model = _tiny(torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight  # as SmolLM2 ties them
    pack_linears(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] += 1  # one Parameter: the head sees the change (its reads of .weight)
    assert model.lm_head.weight[0, 0] == model.model.embed_tokens.weight[0, 0]


@needs_bf16
def test_a_packed_model_moved_or_cast_later_computes_with_its_weights():
    packed, plain = _tiny(torch.bfloat16), _tiny(torch.bfloat16)
    pack_linears(packed)
    packed.float()  # the Parameters are cast; the packed bf16 copies are stale from here on
    ids = torch.randint(0, packed.config.vocab_size, (1, 9))
    with torch.inference_mode():
        assert torch.equal(packed(ids).logits, plain.float()(ids).logits)


def test_float32_and_oversized_models_are_left_as_they_are(monkeypatch):
    model = _tiny(torch.float32)
    assert pack_linears(model) == 0 and set(_linears(model).values()) == {torch.nn.Linear}
    monkeypatch.setattr("kvboost_rag.packing.MAX_PACKED_BYTES", 1024)
    small = _tiny(torch.bfloat16)
    assert pack_linears(small) == 0 and set(_linears(small).values()) == {torch.nn.Linear}


def test_a_build_whose_ops_fail_the_probe_packs_nothing(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken, raising=False)
    model = _tiny(torch.bfloat16)
    assert not can_pack(torch.bfloat16, torch.device("cpu"))
    assert pack_linears(model) == 0 and set(_linears(model).values()) == {torch.nn.Linear}


@needs_bf16
def test_a_bf16_engine_packs_its_model_and_keeps_the_exact_truths(bundled_tokenizer, docs, rag_prompt):
    loaded = LoadedModel(_tiny(torch.bfloat16), bundled_tokenizer, "tiny-random-llama", "seed0")
    engine = KVBoost(loaded, EngineConfig(dtype="bfloat16", calibrate=False, repair=RepairConfig(fidelity="fast")))
    assert engine.adapter.packed_linears > 0
    assert isinstance(engine.adapter.model.model.layers[0].mlp.down_proj, PackedLinear)
    engine.ingest(docs)
    prompt = rag_prompt(docs, "Who founded it?")
    full = engine.prefill(prompt, "full", write_back=False)
    engine.prefill(prompt, "prefix")  # computes the prompt's chunks and writes them back
    # The prompt computed once is an exact prefix hit the second time: a full prefill's logits, in the same dtype.
    again = engine.prefill(prompt, "prefix", write_back=False)
    assert again.exact_tokens > 0
    assert (again.logits - full.logits).abs().max() < 0.05
    reference = engine.adapter.reference_logits(full.plan.token_ids)[-1]
    assert torch.equal(full.logits, reference)


def test_the_adapter_reports_what_it_packed():
    adapter = ModelAdapter(_tiny(torch.float32))
    assert adapter.packed_linears == 0


@needs_bf16
def test_siblings_serve_the_input_they_were_computed_for_and_nothing_stale():
    model = _tiny(torch.bfloat16)
    pack_linears(model)
    attn = model.model.layers[0].self_attn
    group = attn.q_proj.siblings
    assert isinstance(group, Siblings) and group is attn.k_proj.siblings is attn.v_proj.siblings
    x, other = torch.randn(1, 7, 64, dtype=torch.bfloat16), torch.randn(1, 7, 64, dtype=torch.bfloat16)

    def alone(linear, x):
        return torch.nn.functional.linear(x, linear.weight, linear.bias)

    with torch.inference_mode():
        # As a layer calls them: each gets its own columns of one call, and once all are served nothing is kept.
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert torch.equal(proj(x), alone(proj, x))
        assert group.input is None and group.result is None
        # k and v on another input (cacheblend's project_kv) after q on x: their own weights, not x's columns.
        attn.q_proj(x)
        assert torch.equal(attn.k_proj(other), alone(attn.k_proj, other))
        assert torch.equal(attn.v_proj(other), alone(attn.v_proj, other))
        # A second call of the same sibling on the same input is computed again, not served twice from a stale result.
        attn.q_proj(x)
        first = attn.k_proj(x)
        assert torch.equal(attn.k_proj(x), first) and torch.equal(first, alone(attn.k_proj, x))
        assert torch.equal(attn.q_proj(other), alone(attn.q_proj, other))
        # gate and up: only k and v keep a weight of their own; up alone on another input still gets its columns.
        mlp = model.model.layers[0].mlp
        assert mlp.up_proj.packed is None and attn.k_proj.packed is not None
        mlp.gate_proj(x)
        assert torch.equal(mlp.up_proj(other), alone(mlp.up_proj, other))


@needs_bf16
def test_siblings_whose_columns_would_differ_are_left_apart(monkeypatch):
    monkeypatch.setattr(Siblings, "fits", lambda self: False)
    model = _tiny(torch.bfloat16)
    pack_linears(model)
    assert all(getattr(module, "siblings", None) is None for module in model.modules())
    assert all(module.packed is not None for module in model.modules() if isinstance(module, PackedLinear))


@needs_bf16
def test_a_packed_model_copied_into_float32_computes_as_the_unpacked_one():
    """Calibrating a bf16 engine copies its model into float32 (the dtype floor): oneDNN's packed weights cannot be
    deep-copied (it once failed there), so the copy shares them and computes with its own float32 weights."""
    plain, packed = _tiny(torch.bfloat16), _tiny(torch.bfloat16)
    pack_linears(packed)
    ids = torch.randint(0, packed.config.vocab_size, (1, 23))
    with torch.inference_mode():
        expected = in_dtype(plain, torch.float32)(ids).logits
        assert torch.equal(in_dtype(packed, torch.float32)(ids).logits, expected)
        assert torch.equal(packed(ids).logits, plain(ids).logits)  # the packed model itself is left as it was


@needs_bf16
def test_a_bf16_engine_calibrates_by_ingestion(bundled_tokenizer):
    """As shipped in bf16 (the guard on, ingestion calibrating): calibration fits the dtype floor on a float32 copy
    of the packed model, and the engine ends calibrated."""
    loaded = LoadedModel(_tiny(torch.bfloat16), bundled_tokenizer, "tiny-random-llama", "seed0")
    engine = KVBoost(loaded, EngineConfig(dtype="bfloat16"))
    assert engine.adapter.packed_linears > 0
    engine.ingest([f"Harbour {i} of Brekkvik holds {100 + 7 * i} boats and its keeper is called Ingrid {i}."
                   for i in range(MIN_DOCUMENTS)])
    assert engine.counters["calibrations"] == 1 and engine.predictor.at(0.07).floors is not None
    engine.close()


def test_float32_linears_take_their_transposed_copy_from_four_rows_on(columns_pay):
    """Float32 on the CPU (packing.ColumnsLinear): below COLUMN_ROWS rows the weight as stored, bit for bit what
    nn.Linear gives; from COLUMN_ROWS on the transposed copy, the same numbers up to float32 rounding. One copy per
    weight (a tied head shares its embedding's), the state dict and the tie untouched."""
    model, plain = _tiny(torch.float32), _tiny(torch.float32)
    for m in (model, plain):
        m.lm_head.weight = m.model.embed_tokens.weight  # as SmolLM2 ties them
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert column_linears(model) == 7 * model.config.num_hidden_layers + 1
    assert set(_linears(model).values()) == {ColumnsLinear}
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in state.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    down = model.model.layers[0].mlp.down_proj
    assert down.columns.shape == (128, 64) and down.columns.is_contiguous()
    assert torch.equal(down.columns, down.weight.t())
    ids = torch.randint(0, model.config.vocab_size, (1, 37))
    with torch.inference_mode():
        for rows in range(1, COLUMN_ROWS):  # a decode step, a step with drafts
            assert torch.equal(model(ids[:, :rows]).logits, plain(ids[:, :rows]).logits)
        for rows in (COLUMN_ROWS, 9, 37):  # drafts, a batch of streams, a prefill
            assert torch.allclose(model(ids[:, :rows]).logits, plain(ids[:, :rows]).logits, atol=1e-5, rtol=1e-5)
        # The copy is what serves COLUMN_ROWS rows and more, and nothing fewer: spoiled, it shows there only.
        down.columns.zero_()
        few, many = torch.randn(1, COLUMN_ROWS - 1, 128), torch.randn(1, COLUMN_ROWS, 128)
        assert torch.equal(down(few), torch.nn.functional.linear(few, down.weight))
        assert not down(many).any()


def test_a_batched_step_through_the_copies_is_each_streams_lone_step(columns_pay, bundled_tokenizer, docs,
                                                                       rag_prompt):
    """Three streams x 2 tokens (6 rows: the copies) against each stream's lone steps of 1 token (the weights as
    stored): the same logits within float32 rounding, on an engine that laid its model out by itself."""
    loaded = LoadedModel(_tiny(torch.float32), bundled_tokenizer, "tiny-random-llama", "seed0")
    engine = KVBoost(loaded, EngineConfig(calibrate=False, repair=RepairConfig(fidelity="fast")))
    assert engine.adapter.column_linears == 7 * 3 + 1
    prompts = [rag_prompt(docs[i:i + 2], "Who founded it?") for i in range(3)]
    pres = [engine.prefill(p, "full", max_new_tokens=4, write_back=False) for p in prompts]
    with torch.inference_mode():
        together = batching.decode(engine.adapter, [p.cache for p in pres], [7] * 3, [p.prompt_tokens for p in pres],
                                   [[11]] * 3)
        for pre, rows in zip(pres, together, strict=True):
            first = batching.decode(engine.adapter, [pre.cache], [7], [pre.prompt_tokens])[0]
            second = batching.decode(engine.adapter, [pre.cache], [11], [pre.prompt_tokens + 1])[0]
            assert torch.allclose(rows, torch.cat([first, second]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native", [True, False])
def test_copies_in_another_dtype_leave_the_transposed_copies_behind(columns_pay, monkeypatch, native):
    """The dtype floor's bf16 copy and any in_dtype copy of a laid-out float32 model: plain linears (widened where
    bf16 is emulated), no transposed copy copied; the model itself keeps its own."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_f": True, "avx512_bf16": native})
    model = _tiny(torch.float32)
    column_linears(model)
    for copied in (bf16_copy(model), in_dtype(model, torch.bfloat16)):
        assert not any(hasattr(module, "columns") for module in copied.modules())
    assert set(_linears(bf16_copy(model)).values()) == ({torch.nn.Linear} if native else {WidenedLinear})
    assert set(_linears(model).values()) == {ColumnsLinear}


def test_where_transposed_copies_are_not_made(monkeypatch):
    """Not for bf16 weights, not past MAX_PACKED_BYTES, not when the engine's config says no, not off the CPU, not
    where the probe finds no gain."""
    monkeypatch.setattr(packing, "columns_pay", lambda device: True)
    assert column_linears(_tiny(torch.bfloat16)) == 0
    model = _tiny(torch.float32)  # one that would get them (the probe forced, under the cap): the config declines
    assert ModelAdapter(model, transposed_weights=False).column_linears == 0  # EngineConfig.transposed_weights
    assert set(_linears(model).values()) == {torch.nn.Linear}
    assert ModelAdapter(_tiny(torch.float32)).column_linears > 0
    monkeypatch.setattr(packing, "MAX_PACKED_BYTES", 1024)
    assert column_linears(_tiny(torch.float32)) == 0
    monkeypatch.undo()
    assert not packing.columns_pay(torch.device("meta"))  # off the CPU: not MKL's kernels, nothing measured
    monkeypatch.setattr(packing, "columns_pay", lambda device: False)
    model = _tiny(torch.float32)
    assert column_linears(model) == 0 and set(_linears(model).values()) == {torch.nn.Linear}
