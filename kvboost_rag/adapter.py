"""The only module (with architectures.py, its per-family details) that knows transformers internals.

It drives a RoPE decoder layer by layer over our own `KVBuffers`, so that any subset of positions can be
(re)computed against a cache assembled from stored chunks. Everything else in kvboost_rag speaks plain
tensors: token ids, positions, hidden states [1, S, H], K/V [L, H_kv, S, D].

Layers differ within one model: some slide over a window (Mistral, Qwen2, Gemma, Phi-3), some have no RoPE
(SmolLM3), Gemma 3 rotates local and global layers with different bases. So masks are made per kind of
layer and RoPE frames per layer; architectures.py says which layer is which.

Concurrent requests decode together (batching.py): `decode_rows` runs the same layers over B sequences at once,
a few new tokens each (a token and its drafts), every one at its own position in its own KVBuffers
(kvcache.RowsCache).

Tested with transformers 5.24 (the API moved in 5.x: the layers' cache keyword is `cache` from 5.2x,
`past_key_values` before; both are handled, in `_cache_kw`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from . import architectures as arch
from . import packing
from .architectures import COMPOSABLE_ROPE, SUPPORTED_MODEL_TYPES, UnsupportedModelError
from .attention import CausalRows
from .kvcache import KVBuffers, RowsCache

__all__ = ["COMPOSABLE_ROPE", "SUPPORTED_MODEL_TYPES", "Masks", "ModelAdapter", "UnsupportedModelError"]


@functools.cache
def _pairs_halves(rotate_half, r: int) -> bool:
    """ModelAdapter._splits_halves, probed once per rotate_half and width: assembly asks for every reused chunk."""
    probe = torch.arange(1.0, r + 1)
    return r % 2 == 0 and torch.equal(rotate_half(probe), torch.cat([-probe[r // 2:], probe[:r // 2]]))


@dataclass(frozen=True)
class Masks:
    """Attention masks, one per kind of layer (architectures.FULL, SLIDING): additive [1, 1, Q, K] tensors, causal
    masks described (attention.CausalRows, on the CPU), or None where the kernel's own
    causal masking is exactly right (see ModelAdapter.run_layers)."""

    by_kind: dict[str, torch.Tensor | CausalRows | None]

    def rows(self, rows: torch.Tensor) -> Masks:
        """The masks of the queries `rows` [Q'] (indices into Q). Only for masks from `causal_mask`."""
        return Masks({kind: mask.rows(rows) if isinstance(mask, CausalRows) else mask[:, :, rows]
                      for kind, mask in self.by_kind.items()})


# Background work (shadow.py) may give the engine to requests between two decoder layers of its own forwards: in its
# thread, `pausing` sets what each layer first calls.
_between_layers = threading.local()


@contextmanager
def pausing(pause: Callable[[], None]) -> Iterator[None]:
    """Within it, this thread calls `pause()` before each decoder layer it runs; the time spent in it is left out of
    `busy_clock`."""
    def timed() -> None:
        started = time.perf_counter()
        pause()
        _between_layers.paused_s = getattr(_between_layers, "paused_s", 0.0) + time.perf_counter() - started

    _between_layers.pause = timed
    try:
        yield
    finally:
        _between_layers.pause = None


def busy_clock() -> float:
    """time.perf_counter less the seconds this thread spent paused (`pausing`): a build's own time, when background
    work let requests through in the middle of it."""
    return time.perf_counter() - getattr(_between_layers, "paused_s", 0.0)


@dataclass
class ModelAdapter:
    model: torch.nn.Module
    transposed_weights: bool = True  # EngineConfig.transposed_weights: float32 linears laid out twice (packing.py)

    def __post_init__(self):
        arch.check_supported(self.model)
        config = self.model.config
        # Our masks are passed to the attention kernel as they are: sdpa's contract, and eager's (soft-capping).
        self.attention = arch.attention_kernel(self.model)
        self.model.set_attn_implementation(self.attention)
        self.model.eval()
        # bf16 on the CPU: every linear weight packed once for oneDNN, not on every call (packing.py).
        self.packed_linears = packing.pack_linears(self.model)
        # float32 on the CPU: a transposed copy for inputs of a few rows, where MKL's path is cheaper (packing.py).
        self.column_linears = packing.column_linears(self.model) if self.transposed_weights else 0
        self.config = config
        self.inner = self.model.model
        self.layers = list(self.inner.layers)
        self.layer_plan = arch.layer_plan(self.model)
        self.num_layers = len(self.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Masks see exactly the window a full prefill sees, so the context is the model's own.
        self.max_context = int(getattr(config, "max_position_embeddings", 2048))
        self.windows = {layer.attention: layer.window for layer in self.layer_plan}  # kind -> window (or None)
        tables = arch.rope_tables(self.inner.rotary_emb)
        self.rope_tables = {layer.rope: tables[layer.rope] for layer in self.layer_plan if layer.rope}  # those used
        self.rope_composes = all(table.composes for table in self.rope_tables.values())
        self.softcap = arch.logit_softcap(config)
        # The model's own RoPE half-rotation (x1, x2 -> -x2, x1): RoPE(x) = x * cos + rotate_half(x) * sin.
        self.rotate_half = sys.modules[type(self.layers[0]).__module__].rotate_half
        params = inspect.signature(type(self.layers[0]).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # A batched decode step's rows attend to their own caches where our kernel runs them (kvcache.RowsCache); on
        # CUDA the padded copy is cheap and one kernel call serves every row.
        self.rows_in_place = self.attention == arch.GQA_SDPA and self.device.type == "cpu"

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.inner.embed_tokens.weight.device

    def new_buffers(self, capacity: int) -> KVBuffers:
        return KVBuffers(self.num_layers, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [S] -> hidden: [1, S, H] (Gemma's embedding module applies its sqrt(H) scale itself)."""
        return self.inner.embed_tokens(token_ids.to(self.device)[None])

    # ---- RoPE ------------------------------------------------------------------------------

    def rope(self, positions: torch.Tensor, like: torch.Tensor,
             table: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [S] -> cos, sin: [1, S, R] in like's dtype, from RoPE table `table` (by default the first
        layer's; see architectures.Layer.rope). R: the rotated channels, the head dim or fewer."""
        table = table or next((layer.rope for layer in self.layer_plan if layer.rope), arch.SHARED)
        return arch.rope(self.inner.rotary_emb, positions.to(self.device), like, table)

    def rope_frame(self, positions: torch.Tensor, layers: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos, sin at `positions` [S] for each of `layers`: [L', 1, S, R] fp32, or [1, 1, S, R] when they
        all share one table. A layer without RoPE gets cos 1, sin 0: its keys stay as they are."""
        chosen = self.layer_plan[layers]
        probe = torch.empty(0, dtype=torch.float32, device=self.device)
        tables = {layer.rope for layer in chosen}
        frames = {table: self.rope(positions, probe, table) for table in tables if table is not None}
        if len(tables) == 1 and None not in tables:
            cos, sin = frames[chosen[0].rope]
            return cos[None], sin[None]
        like = next(iter(frames.values()))[0] if frames else probe.new_empty(1, positions.shape[0], self.head_dim)
        identity = (torch.ones_like(like), torch.zeros_like(like))
        cos, sin = zip(*(frames[layer.rope] if layer.rope else identity for layer in chosen), strict=True)
        return torch.stack(cos), torch.stack(sin)

    def apply_rope(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
                   fused: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate `keys` [..., S, D] by a frame (cos, sin: [..., S, R], broadcast), or back when `inverse`: only the
        first R channels turn (partial rotary), as the models' own apply_rotary_pos_emb does. Written into `out` when
        given. Fused by default (drift.py runs it over every reused token of a request): where channel i pairs with
        i + R/2, two products per half, in the wider of the two dtypes, with no concatenation; `fused=False` rounds
        as the models do."""
        r = cos.shape[-1]
        if fused and self._splits_halves(r):
            half, sign = r // 2, -1 if inverse else 1
            wide = torch.promote_types(keys.dtype, cos.dtype)
            if out is None:
                shape = (*torch.broadcast_shapes(keys.shape[:-1], cos.shape[:-1]), keys.shape[-1])
                out = torch.empty(shape, device=keys.device, dtype=wide)
            if r < keys.shape[-1]:
                out[..., r:] = keys[..., r:]
            # Widened once: an op over mixed dtypes converts its narrow operands on every call, and each half is read
            # twice (a reused 200-token chunk of 30 bf16 layers: 0.48 ms against 0.86). The same numbers either way.
            turning = keys[..., :r].to(wide)
            k1, k2 = turning[..., :half], turning[..., half:]
            if out.dtype == wide:
                torch.addcmul(k1 * cos[..., :half], k2, sin[..., :half], value=-sign, out=out[..., :half])
                torch.addcmul(k2 * cos[..., half:], k1, sin[..., half:], value=sign, out=out[..., half:r])
            else:  # into a narrower cache: turned in the wide dtype, rounded once on the way in
                turned = turning * cos
                turned[..., :half].addcmul_(k2, sin[..., :half], value=-sign)
                turned[..., half:].addcmul_(k1, sin[..., half:], value=sign)
                out[..., :r] = turned
            return out
        turning = keys if r == keys.shape[-1] else keys[..., :r]
        if fused:
            turned = torch.addcmul(turning * cos, self.rotate_half(turning), sin, value=-1 if inverse else 1)
        else:
            turned = turning * cos + self.rotate_half(turning) * (-sin if inverse else sin)
        turned = turned if r == keys.shape[-1] else torch.cat([turned, keys[..., r:]], dim=-1)
        return turned if out is None else out.copy_(turned)

    def check_rope_composes(self) -> None:
        stuck = [t for t in self.rope_tables.values() if not t.composes]
        if stuck:
            raise UnsupportedModelError(
                f"rope_type {stuck[0].rope_type!r} (attention scaling {stuck[0].attention_scaling:g}) does not "
                "compose: stored keys cannot be moved to a new position (rotations compose for rope types "
                f"{', '.join(COMPOSABLE_ROPE)} without scaling); use strategy 'full' or 'prefix' with this model.")

    def rotate_keys(self, keys: torch.Tensor, delta: int, layers: slice = slice(None),
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Move keys of `layers` by `delta` positions. keys: [L', H_kv, S, D] -> same: written into `out` (a view
        of a cache, say) when given, else into a new tensor."""
        if delta == 0:
            return keys if out is None else out.copy_(keys)
        self.check_rope_composes()
        cos, sin = self.rope_frame(torch.tensor([delta]), layers)  # [L' or 1, 1, 1, R], fp32
        out = torch.empty_like(keys) if out is None else out
        r = cos.shape[-1]
        if self._splits_halves(r):
            # RoPE turns channel i with channel i + R/2 here: two fp32 products per half, written in place. Over a
            # 200-token chunk of 30 layers in bf16, 1.0 ms against 2.3 for the matrix below.
            return self.apply_rope(keys, cos, sin, out=out)
        if r < keys.shape[-1]:  # partial rotary: the other channels stay
            out[..., r:] = keys[..., r:]
        # Any other pairing the model's rotate_half makes: RoPE is linear in the key, so rotating the identity's
        # rows gives the matrix that moves any key by delta, [L' or 1, 1, R, R]: one fp32 matmul.
        eye = torch.eye(r, dtype=torch.float32, device=keys.device).expand(*cos.shape[:-2], -1, -1)
        out[..., :r] = torch.matmul(keys[..., :r].float(), self.apply_rope(eye, cos, sin, fused=False))
        return out

    def _splits_halves(self, r: int) -> bool:
        """Whether the model's rotate_half over R channels is (x1, x2) -> (-x2, x1), channel i paired with i + R/2
        (Llama's convention, most models'), rather than neighbouring channels or another pairing."""
        return _pairs_halves(self.rotate_half, r)

    # ---- masks and the forward -------------------------------------------------------------

    def causal_mask(self, positions: torch.Tensor, attend_len: int, dtype: torch.dtype) -> Masks:
        """Each query (at `positions` [Q]) sees the cache up to its own position, and in a sliding layer only the
        last `window` of those, as the model's own masks do: [1, 1, Q, attend_len] per kind of layer.

        Additive float masks (sdpa's CPU kernels run them faster than boolean ones), or on the CPU the mask described
        (attention.py splits it into pieces that need none, or in a sliding layer a mask over the window's edge)."""
        return Masks({kind: self._mask(positions, attend_len, dtype, window) for kind, window in self.windows.items()})

    def _mask(self, positions: torch.Tensor, attend_len: int, dtype: torch.dtype, window: int | None,
              dense: bool = False) -> torch.Tensor | CausalRows:
        cuts_in = window is not None and attend_len > window
        # A single query where a window cuts in (a decode step) keeps its dense row, which a 16-bit decode step
        # runs without the flash kernel (architectures._sdpa_gqa_masked).
        if (not dense and self.attention == arch.GQA_SDPA and self.device.type == "cpu"
                and not (cuts_in and positions.shape[0] == 1)):
            return CausalRows(positions.cpu(), attend_len, window if cuts_in else None)
        positions = positions.to(self.device)[:, None]  # [Q, 1]
        cached = torch.arange(attend_len, device=self.device)[None, :]  # [1, K]
        visible = cached <= positions
        if window is not None:
            visible &= cached > positions - window
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, cache: KVBuffers,
                   layers: range, attend_len: int, mask: Masks | None = None) -> torch.Tensor:
        """Run `hidden` (the tokens at `positions`) through `layers`, writing their K/V into `cache`.

        hidden: [1, Q, H]; positions: [Q] ascending. Each query attends to every cached position up to and
        including its own, within its window in sliding layers (or as `mask`, from `causal_mask`, says); the
        cache must already hold K/V for the other positions.
        """
        # Read the positions on the host (where the caller made them): no device sync per layer.
        q = positions.shape[0]
        first, last = (int(positions[0]), int(positions[-1])) if q else (0, -1)
        contiguous = q == 0 or last - first + 1 == q
        positions = positions.to(self.device)
        if contiguous:
            cache.write_positions, cache.write_start = None, first
        else:
            cache.write_positions = positions
        cache.attend_len = attend_len
        if mask is None:
            # No mask is sdpa's is_causal, or a single query that sees everything: right for a contiguous run
            # ending the cache that is all of it or one token, unless a window cuts into what it attends to.
            # Eager attention (soft-capping) has no causal mode: it always takes a mask.
            plain = (self.attention == arch.GQA_SDPA and contiguous and last == attend_len - 1
                     and (q == attend_len or q == 1))
            mask = Masks({kind: None if plain and (window is None or attend_len <= window)
                          else self._mask(positions, attend_len, hidden.dtype, window)
                          for kind, window in self.windows.items()})
        frames = self._position_embeddings(positions, hidden, [self.layer_plan[i] for i in layers])
        return self._drive(hidden, cache, layers, mask, positions[None], frames)

    def decode_rows(self, hidden: torch.Tensor, positions: torch.Tensor, caches: list[KVBuffers],
                    counts: list[int] | None = None) -> torch.Tensor:
        """A few new tokens for each of B sequences, each at its own position in its own cache (batch 1 each): the
        decoder layers' own forward over all of them at once, each row attending to its own K/V only. Row b's
        first counts[b] tokens (all Q by default) are its own, from positions[b] on; the others pad the row to Q,
        see what its last own token sees and are written to no cache (their outputs mean nothing).

        hidden: [B, Q, H]; positions: [B] long, on the host (where the caller made them) -> hidden: [B, Q, H]."""
        b, q = hidden.shape[:2]
        starts, counts = positions.tolist(), counts or [q] * b
        rows = RowsCache(caches, starts, counts, self.rows_in_place)
        k_max = rows.attend_len
        at = torch.tensor([[start + min(j, n - 1) for j in range(q)]
                           for start, n in zip(starts, counts, strict=True)])  # [B, Q]
        flat = at.flatten().to(self.device)
        # [1, 1, B * Q, K_max] -> [B, 1, Q, K_max]: each row's queries see their own past (and window), no padding.
        mask = Masks({kind: self._mask(flat, k_max, hidden.dtype, window, dense=True).view(b, 1, q, k_max)
                      for kind, window in self.windows.items()})
        # The B * Q positions as one sequence, [1, B * Q, R], split into rows: [B, Q, R] per table.
        frames = {table: (cos.reshape(b, q, -1), sin.reshape(b, q, -1))
                  for table, (cos, sin) in self._position_embeddings(flat, hidden, self.layer_plan).items()}
        return self._drive(hidden, rows, range(self.num_layers), mask, at.to(self.device), frames)

    def _position_embeddings(self, positions: torch.Tensor, like: torch.Tensor,
                             plans: Sequence[arch.Layer]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin [1, S, R] at `positions` [S] for each RoPE table the layers `plans` use."""
        return {table: self.rope(positions, like, table) for table in {plan.rope for plan in plans} if table}

    def _drive(self, hidden: torch.Tensor, cache, layers: range, mask: Masks, position_ids: torch.Tensor,
               position_embeddings: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The decoder layers' own forward over `hidden`, with our cache and each layer's mask and RoPE table."""
        pause = getattr(_between_layers, "pause", None)
        for i in layers:
            if pause is not None:
                pause()
            plan = self.layer_plan[i]
            # A layer without RoPE ignores its position embeddings; it still takes some.
            rope = position_embeddings.get(plan.rope) or next(iter(position_embeddings.values()), None)
            out = self.layers[i](hidden, **{self._cache_kw: cache}, attention_mask=mask.by_kind[plan.attention],
                                 position_ids=position_ids, position_embeddings=rope, use_cache=True)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def project_kv(self, layer: int, hidden: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V layer `layer` writes for its input `hidden` [1, Q, H] at `positions` [Q], without running its
        attention or MLP: [1, H_kv, Q, D] each, the same operations as its attention module."""
        block = self.layers[layer]
        keys, values = arch.project_kv(block.self_attn, block.input_layernorm(hidden), self.head_dim)
        table = self.layer_plan[layer].rope
        if table is None:  # SmolLM3's NoPE layers
            return keys, values
        cos, sin = self.rope(positions, hidden, table)
        # Unfused, as the attention module rotates them: in bf16 too these are the layer's own K bit for bit.
        return self.apply_rope(keys, cos[:, None], sin[:, None], fused=False), values

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [1, S, H] -> logits: [S, V] in fp32 (soft-capped in the model's dtype, as its forward does)."""
        logits = self.model.lm_head(self.inner.norm(hidden))[0]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    @torch.inference_mode()
    def reference_kv(self, token_ids: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own forward over `token_ids` alone at positions start..start+S-1.

        Returns keys, values: [L, H_kv, S, D], straight from transformers' DynamicCache: one made without the
        config, whose layers all keep every position (the config's would keep only a window in sliding layers;
        the masks are the model's own either way)."""
        positions = torch.arange(start, start + token_ids.shape[0], device=self.device)[None]
        out = self.model(input_ids=token_ids.to(self.device)[None], position_ids=positions, use_cache=True,
                         **{self._cache_kw: DynamicCache()})
        # The output's cache is `cache` from transformers 5.2x (`past_key_values` before, now a warning).
        layers = (out.cache if "cache" in out else out.past_key_values).layers
        return torch.stack([layer.keys[0] for layer in layers]), torch.stack([layer.values[0] for layer in layers])

    @torch.inference_mode()
    def reference_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The model's own forward over the whole sequence, no cache of ours: [S, V]. The truth."""
        out = self.model(input_ids=token_ids.to(self.device)[None], use_cache=False)
        return out.logits[0].float()
