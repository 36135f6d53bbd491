"""The only module that knows transformers internals.

It drives a Llama-family decoder layer by layer over our own `KVBuffers`, so that any subset of
positions can be (re)computed against a cache assembled from stored chunks. Everything else in
kvboost_rag speaks plain tensors: token ids, positions, hidden states [1, S, H], K/V [L, H_kv, S, D].

Tested with transformers 5.24 (the API moved in 5.x: the layers' cache keyword is `cache` from
5.2x, `past_key_values` before; both are handled).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch

from .kvcache import KVBuffers

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# RoPE variants whose rotation composes: R(a + b) = R(b) R(a), so stored keys can be moved.
COMPOSABLE_ROPE = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    pass


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def _max_context(config) -> int:
    limit = int(getattr(config, "max_position_embeddings", 2048))
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    sliding = ("sliding_attention" in layer_types) or (
        window is not None and getattr(config, "use_sliding_window", True) and config.model_type == "mistral")
    # Our explicit masks are plain causal: past the window they would differ from the model's own.
    return min(limit, int(window)) if sliding and window else limit


@dataclass
class ModelAdapter:
    model: torch.nn.Module

    def __post_init__(self):
        config = self.model.config
        missing = [name for name in ("embed_tokens", "layers", "norm", "rotary_emb")
                   if not hasattr(getattr(self.model, "model", None), name)]
        if config.model_type not in SUPPORTED_MODEL_TYPES or missing or not hasattr(self.model, "lm_head"):
            raise UnsupportedModelError(
                f"model_type {config.model_type!r} is not supported: kvboost-rag drives Llama-family RoPE "
                f"decoders ({', '.join(SUPPORTED_MODEL_TYPES)})"
                + (f"; this model lacks model.{', model.'.join(missing)}" if missing else "")
                + ". Use one of those architectures.")
        # Our masks are passed to the attention kernel as they are: sdpa's contract.
        self.model.set_attn_implementation("sdpa")
        self.model.eval()
        self.config = config
        self.inner = self.model.model
        self.layers = list(self.inner.layers)
        self.num_layers = len(self.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_context = _max_context(config)
        self.rope_type = _rope_type(config)
        self.rope_composes = self.rope_type in COMPOSABLE_ROPE and getattr(
            self.inner.rotary_emb, "attention_scaling", 1.0) == 1.0
        # The model's own RoPE half-rotation (x1, x2 -> -x2, x1): RoPE(x) = x * cos + rotate_half(x) * sin.
        self.rotate_half = sys.modules[type(self.layers[0]).__module__].rotate_half
        params = inspect.signature(type(self.layers[0]).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.inner.embed_tokens.weight.device

    def new_buffers(self, capacity: int) -> KVBuffers:
        return KVBuffers(self.num_layers, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [S] -> hidden: [1, S, H]"""
        return self.inner.embed_tokens(token_ids.to(self.device)[None])

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [S] -> cos, sin: [1, S, D] in like's dtype."""
        return self.inner.rotary_emb(like, positions.to(self.device)[None])

    def rotate_keys(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Move keys by `delta` positions. keys: [L, H_kv, S, D] -> same, a new tensor."""
        if delta == 0:
            return keys
        if not self.rope_composes:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} does not compose, so stored keys cannot be moved to a new "
                "position; use strategy 'full' or 'prefix' with this model.")
        probe = torch.empty(0, dtype=torch.float32, device=keys.device)
        cos, sin = self.rope(torch.tensor([delta]), probe)  # [1, 1, D], fp32
        keys32 = keys.float()
        return (keys32 * cos[0] + self.rotate_half(keys32) * sin[0]).to(keys.dtype)

    def causal_mask(self, positions: torch.Tensor, attend_len: int, dtype: torch.dtype) -> torch.Tensor:
        """Each query (at `positions` [Q]) sees the cache up to its own position: [1, 1, Q, attend_len].

        Additive float mask: sdpa's CPU kernels run it faster than a boolean one."""
        positions = positions.to(self.device)
        visible = torch.arange(attend_len, device=self.device)[None, :] <= positions[:, None]
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, cache: KVBuffers,
                   layers: range, attend_len: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run `hidden` (the tokens at `positions`) through `layers`, writing their K/V into `cache`.

        hidden: [1, Q, H]; positions: [Q] ascending. Each query attends to every cached position
        up to and including its own (or as `mask`, from `causal_mask`, says); the cache must already
        hold K/V for the other positions.
        """
        positions = positions.to(self.device)
        q = positions.shape[0]
        contiguous = bool(q == 0 or positions[-1] - positions[0] + 1 == q)
        if contiguous:
            cache.write_positions, cache.write_start = None, int(positions[0]) if q else 0
        else:
            cache.write_positions = positions
        cache.attend_len = attend_len
        if mask is None and not (contiguous and int(positions[-1]) == attend_len - 1 and (q == attend_len or q == 1)):
            mask = self.causal_mask(positions, attend_len, hidden.dtype)
        # else: no mask is plain causal (sdpa's is_causal) or a single query that sees everything
        return self._drive(hidden, positions, cache, layers, mask)

    def _drive(self, hidden: torch.Tensor, positions: torch.Tensor, cache: KVBuffers, layers: range,
               mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder layers' own forward over `hidden`, with our cache and mask."""
        position_embeddings = self.rope(positions, hidden)
        kwargs = {self._cache_kw: cache, "attention_mask": mask, "position_ids": positions[None],
                  "position_embeddings": position_embeddings, "use_cache": True}
        for i in layers:
            out = self.layers[i](hidden, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def project_kv(self, layer: int, hidden: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V layer `layer` writes for its input `hidden` [1, Q, H] at `positions` [Q], without
        running its attention or MLP: [1, H_kv, Q, D] each, the same operations as its attention module."""
        block = self.layers[layer]
        attn = block.self_attn
        normed = block.input_layernorm(hidden)
        shape = (1, hidden.shape[1], -1, self.head_dim)
        keys = attn.k_proj(normed).view(shape)
        if getattr(attn, "k_norm", None) is not None:  # qwen3
            keys = attn.k_norm(keys)
        keys, values = keys.transpose(1, 2), attn.v_proj(normed).view(shape).transpose(1, 2)
        cos, sin = self.rope(positions, hidden)
        cos, sin = cos[:, None], sin[:, None]
        return keys * cos + self.rotate_half(keys) * sin, values

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [1, S, H] -> logits: [S, V] in fp32."""
        return self.model.lm_head(self.inner.norm(hidden))[0].float()

    @torch.inference_mode()
    def reference_kv(self, token_ids: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own forward over `token_ids` alone at positions start..start+S-1.

        Returns keys, values: [L, H_kv, S, D], straight from transformers' DynamicCache."""
        positions = torch.arange(start, start + token_ids.shape[0], device=self.device)[None]
        out = self.model(input_ids=token_ids.to(self.device)[None], position_ids=positions, use_cache=True)
        # The output's cache is `cache` from transformers 5.2x (`past_key_values` before, now a warning).
        layers = (out.cache if "cache" in out else out.past_key_values).layers
        return torch.stack([layer.keys[0] for layer in layers]), torch.stack([layer.values[0] for layer in layers])

    @torch.inference_mode()
    def reference_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The model's own forward over the whole sequence, no cache of ours: [S, V]. The truth."""
        out = self.model(input_ids=token_ids.to(self.device)[None], use_cache=False)
        return out.logits[0].float()
