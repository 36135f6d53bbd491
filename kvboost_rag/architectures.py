"""What differs between the decoder families the adapter drives, read from their config and modules.

adapter.py runs every family the same way: embed, the decoder layers' own forward over our cache, norm,
lm_head. This module answers the questions whose answers differ by family: which layers slide over a
window and how wide it is, which RoPE table (if any) rotates each layer's keys, how an attention module
makes its K/V, which attention kernel runs the layers, whether the logits are soft-capped, and what
cannot be supported at all. With adapter.py it is the only code that knows transformers internals.

    family          what is particular to it, and where it is handled here
    llama           the reference layout
    mistral         every layer slides when `sliding_window` is set (no `layer_types`)    layer_plan
    qwen2, qwen3    q/k/v biases (inside k_proj/v_proj); qwen3 q/k norms                  project_kv
    gemma2          sliding layers mixed with global ones; attention and final soft-caps   layer_plan,
                    (sdpa cannot soft-cap: eager attention); scaled embeddings (the        attention_kernel,
                    embedding module scales them itself)                                  logit_softcap
    gemma3_text     as gemma2, plus one RoPE table per layer type (local and global bases) rope_tables
    phi3            one fused qkv projection; optional partial rotary                      project_kv
    smollm3         layers without RoPE (`no_rope_layers`)                                 layer_plan
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import CausalRows, PerRow, causal_attention, one_query_per_row, rows_attention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3")
# RoPE variants whose rotation composes, R(a + b) = R(b) R(a), so stored keys can be moved to a new place.
# Not dynamic NTK (its frequencies change with the sequence length), nor YaRN or LongRoPE (their cos/sin carry
# an attention scaling, and LongRoPE switches tables past the original context).
COMPOSABLE_ROPE = ("default", "linear", "llama3")
FULL, SLIDING = "full_attention", "sliding_attention"
SHARED = "shared"  # the name of the one RoPE table of a family that has one for all layers


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class Layer:
    attention: str  # FULL or SLIDING: which attention mask it takes
    window: int | None  # SLIDING: a query sees the last `window` positions, itself included
    rope: str | None  # the RoPE table rotating its queries and keys (SHARED, or a layer type); None: no RoPE


@dataclass(frozen=True)
class RopeTable:
    rope_type: str
    attention_scaling: float

    @property
    def composes(self) -> bool:
        return self.rope_type in COMPOSABLE_ROPE and self.attention_scaling == 1.0


def check_supported(model) -> None:
    """Refuse, at load, a model whose layers our driver cannot run exactly as its own forward does."""
    config = model.config
    inner = getattr(model, "model", None)
    missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, name)]
    if config.model_type not in SUPPORTED_MODEL_TYPES or missing or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(
            f"model_type {config.model_type!r} is not supported: kvboost-rag drives RoPE decoders "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
            + (f"; this model lacks model.{', model.'.join(missing)}" if missing else "")
            + ". Use one of those architectures (for a multimodal checkpoint, its text-only causal LM).")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"this {config.model_type} attends both ways (use_bidirectional_attention=True): an encoder, not a "
            "causal decoder, so a prompt's KV cannot be assembled from chunks. Use a causal checkpoint.")
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {FULL, SLIDING}:
        raise UnsupportedModelError(
            f"layer types {', '.join(sorted(kinds - {FULL, SLIDING}))} are not supported: kvboost-rag masks full and "
            "sliding-window attention only. Use a model whose layers are all full_attention or sliding_attention.")


def layer_plan(model) -> tuple[Layer, ...]:
    """Each decoder layer's attention kind, window and RoPE table, as the model's own forward uses them."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    # Mistral and Phi-3 have no `layer_types`: their forward slides every layer when a window is set.
    kinds = getattr(config, "layer_types", None) or [SLIDING if window else FULL] * config.num_hidden_layers
    per_type = _rope_per_layer_type(model.model.rotary_emb)
    plan = []
    for block, kind in zip(model.model.layers, kinds, strict=True):
        uses_rope = bool(getattr(block.self_attn, "use_rope", True))  # SmolLM3's NoPE layers have use_rope 0
        table = (kind if per_type else SHARED) if uses_rope else None
        sliding = kind == SLIDING and window is not None
        plan.append(Layer(SLIDING if sliding else FULL, int(window) if sliding else None, table))
    return tuple(plan)


def _rope_per_layer_type(rotary) -> bool:
    """Gemma 3's rotary embedding holds one table per layer type (local and global bases) and takes the type."""
    return "layer_type" in inspect.signature(type(rotary).forward).parameters


def rope_tables(rotary) -> dict[str, RopeTable]:
    """Every RoPE table of the model, by the name its layers use (see Layer.rope)."""
    if _rope_per_layer_type(rotary):
        return {kind: RopeTable(rotary.rope_type[kind], float(getattr(rotary, f"{kind}_attention_scaling")))
                for kind in rotary.rope_type}
    return {SHARED: RopeTable(rotary.rope_type, float(getattr(rotary, "attention_scaling", 1.0)))}


def rope(rotary, positions: torch.Tensor, like: torch.Tensor, table: str) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [S] -> cos, sin: [1, S, R] in like's dtype (R: the rotated channels, the head dim or fewer)."""
    if table == SHARED:
        return rotary(like, positions[None])
    return rotary(like, positions[None], table)


GQA_SDPA = "kvboost_sdpa"
# CUDA attention runs without cuDNN's kernel, torch's first choice on Hopper: it builds a graph for each new shape,
# and a cacheblend repair runs a new query count at each layer, so on an H200 a prompt's first repair cost ~1 s
# against ~0.1 s once its shapes had run (docs/gpu_h200/). Flash takes the unmasked causal runs, memory-efficient
# attention the masked ones; neither sets up per shape. False: torch's own choice (research/gpu_profile.py --cold).
CUDA_WITHOUT_CUDNN = True
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_gqa_masked(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, except that with a mask on the CPU the K/V heads are shared (enable_gqa)
    rather than copied once per query head: transformers repeats them whenever a mask is given, because CUDA's
    fused kernels refuse GQA with a mask, and on the CPU that copy of the whole cache, every layer, cost more than
    the attention of a reuse path's few queries. query: [B, H, Q, D]; key, value: [B, H_kv, K, D]; the same result
    bit for bit. A causal mask described (attention.CausalRows, made by the adapter on the CPU) runs in the
    pieces attention.py splits it into. A 16-bit decode step (one query per row) runs as fp32 matmuls instead: the
    flash kernel's setup costs several times its arithmetic there (attention.one_query_per_row)."""
    if isinstance(attention_mask, CausalRows):
        return causal_attention(query, key, value, attention_mask, scaling), None
    if isinstance(key, PerRow):  # a batched decode step's rows, each over its own cache (kvcache.RowsCache)
        return rows_attention(query, key, value, attention_mask, scaling), None
    if (query.shape[2] == 1 and query.dtype in (torch.bfloat16, torch.float16) and query.device.type == "cpu"
            and not dropout and kwargs.get("position_bias") is None
            and (attention_mask is None or attention_mask.is_floating_point())):  # (a boolean one: the model's own)
        mask = None if attention_mask is None else attention_mask[..., :key.shape[2]]
        return one_query_per_row(query, key, value, mask, scaling), None
    if attention_mask is None or query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        with sdpa_kernel(_CUDA_BACKENDS) if query.is_cuda and CUDA_WITHOUT_CUDNN else contextlib.nullcontext():
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None  # [B, Q, H, D], as the attention modules take it back


AttentionInterface.register(GQA_SDPA, _sdpa_gqa_masked)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)  # the model's own forward (the reference) masks as for sdpa


def attention_kernel(model) -> str:
    """The attention implementation our masks are given to: sdpa's (GQA_SDPA: sdpa without the K/V copy), which
    takes an additive mask as it is. sdpa cannot soft-cap the scores (Gemma's tanh before the mask), which
    transformers runs only in its eager attention (or in flex attention and a few flash kernels): a model that
    soft-caps runs eager, with a mask always."""
    if getattr(model.config, "attn_logit_softcapping", None) is not None or not getattr(model, "_supports_sdpa", True):
        return "eager"
    return GQA_SDPA


def project_kv(attn, normed: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K (before RoPE) and V an attention module makes of its normed input, the same operations as its own
    forward. normed: [1, Q, H] -> keys, values: [1, H_kv, Q, D]."""
    shape = (1, normed.shape[1], -1, head_dim)
    if hasattr(attn, "qkv_proj"):  # Phi-3: one projection whose rows are [queries | keys | values]
        queries = attn.config.num_attention_heads * head_dim
        bias = attn.qkv_proj.bias
        kv = torch.nn.functional.linear(normed, attn.qkv_proj.weight[queries:],
                                        None if bias is None else bias[queries:])
        keys, values = kv.chunk(2, dim=-1)
    else:  # Qwen2's biases live inside k_proj / v_proj
        keys, values = attn.k_proj(normed), attn.v_proj(normed)
    keys = keys.view(shape)
    if getattr(attn, "k_norm", None) is not None:  # Qwen3, Gemma 3: RMSNorm over each head's channels
        keys = attn.k_norm(keys)
    return keys.transpose(1, 2), values.view(shape).transpose(1, 2)


def logit_softcap(config) -> float | None:
    """Gemma's final soft-cap: logits -> cap * tanh(logits / cap)."""
    return getattr(config, "final_logit_softcapping", None)
