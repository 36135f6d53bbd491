"""Where a naive prefill's time goes, in bf16 on the bundled model: its stages one by one (render, tokenize, plan,
assemble, the decoder layers, the logits), and the layers' own small operations alone (docs/method.md, note 1g).

The stages run in turn, round after round, medians of ROUNDS; the layers three ways on the same assembled
cache: the adapter's `run_layers` (transformers' decoder layers); the same operations written out for a Llama
layer (checked to give the same hidden states bit for bit); and that loop with every linear and the attention
replaced by a ready output of the right shape (a "skeleton": what norms, RoPE, residual adds, cache writes and
views cost on their own). Written out for Llama's layer only (the bundled SmolLM2).

    .venv/bin/python research/naive_breakdown.py 1000
"""

import statistics
import sys
import time

import torch

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.assembly import assemble, plan
from kvboost_rag.attention import causal_attention
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt, store_shared_prefix
from kvboost_rag.bench.scaling import build_prompts, token_counter

ROUNDS = 15


def rms_norm(norm, x):  # LlamaRMSNorm's operations, in its order
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def layers_written_out(adapter, hidden, positions, cache, n, stub: dict | None = None):
    """Llama's decoder layers over `hidden` [1, Q, H] at `positions`; with `stub`, linears and attention replaced by
    its ready outputs."""
    q_rows, dim = positions.shape[0], adapter.head_dim
    cache.write_positions, cache.attend_len = positions, n
    mask = adapter.causal_mask(positions, n, hidden.dtype).by_kind["full_attention"]
    cos, sin = (t[:, None] for t in adapter.rope(positions, hidden))

    def linear(module, x, out):
        return module(x) if stub is None else stub[out]

    for i, layer in enumerate(adapter.layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = rms_norm(layer.input_layernorm, hidden)
        q = linear(attn.q_proj, x, "q").view(1, q_rows, -1, dim).transpose(1, 2)
        k = linear(attn.k_proj, x, "kv").view(1, q_rows, -1, dim).transpose(1, 2)
        v = linear(attn.v_proj, x, "kv").view(1, q_rows, -1, dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys, values = cache.update(k, v, i)
        out = causal_attention(q, keys, values, mask, attn.scaling) if stub is None else stub["attention"]
        hidden = hidden + linear(attn.o_proj, out.reshape(1, q_rows, -1), "h")
        x = rms_norm(layer.post_attention_layernorm, hidden)
        hidden = hidden + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, x, "m")) * linear(mlp.up_proj, x, "m"),
                                 "h")
    return hidden


def medians_ms(stages: dict) -> dict[str, float]:
    """Each stage once per round, the stages in turn (after a round to warm up): medians over the rounds."""
    times: dict[str, list[float]] = {name: [] for name in stages}
    for round_ in range(ROUNDS + 1):
        for name, fn in stages.items():
            started = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(spent) * 1e3 for name, spent in times.items()}


@torch.inference_mode()
def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    engine = KVBoost.from_pretrained(config=EngineConfig(dtype="bfloat16", calibrate=False,
                                                         repair=RepairConfig(fidelity="fast")))
    adapter = engine.adapter
    items = load_items("kvboost_rag/bench/synthetic_k8.jsonl")[130:]
    sized = next(iter(build_prompts(items, [size], 1, token_counter(engine))))
    engine.ingest(list(sized.item.documents), progress=False, calibrate=False)
    store_shared_prefix(engine, sized.item)
    prompt = render_prompt(sized.item)
    text = engine.render(prompt)
    chunks = engine.tokenize(text).chunks
    p = plan(chunks, engine.fingerprint, engine.store, True, True)
    n, positions = p.num_tokens, p.computed_positions()
    hidden = adapter.embed(p.token_ids[positions])
    cache = assemble(p, adapter, n)
    out = adapter.run_layers(hidden, positions, cache, range(adapter.num_layers), n)
    assert torch.equal(out, layers_written_out(adapter, hidden, positions, assemble(p, adapter, n), n))
    rows, width = positions.shape[0], adapter.config.hidden_size
    like = dict(dtype=adapter.dtype)
    stub = {"q": torch.randn(1, rows, adapter.num_heads * adapter.head_dim, **like),
            "kv": torch.randn(1, rows, adapter.num_kv_heads * adapter.head_dim, **like),
            "h": torch.randn(1, rows, width, **like),
            "m": torch.randn(1, rows, adapter.config.intermediate_size, **like),
            "attention": torch.randn(1, rows, adapter.num_heads, adapter.head_dim, **like)}
    stages = {
        "full prefill (TTFT)": lambda: engine.prefill(prompt, "full", write_back=False),
        "naive prefill (TTFT)": lambda: engine.prefill(prompt, "naive", write_back=False),
        "  render": lambda: engine.render(prompt),
        "  tokenize": lambda: engine.tokenize(text),
        "  plan": lambda: plan(chunks, engine.fingerprint, engine.store, True, True),
        "  assemble": lambda: assemble(p, adapter, n),
        "  layers (run_layers)": lambda: adapter.run_layers(hidden, positions, cache, range(adapter.num_layers), n),
        "  layers written out": lambda: layers_written_out(adapter, hidden, positions, cache, n),
        "  layers' skeleton": lambda: layers_written_out(adapter, hidden, positions, cache, n, stub),
        "  logits": lambda: adapter.logits(out[:, -1:]),
    }
    print(f"bf16, {n} tokens, {rows} computed by naive; medians of {ROUNDS} (ms):")
    for name, ms in medians_ms(stages).items():
        print(f"  {name:<24} {ms:8.1f}")


if __name__ == "__main__":
    main()
