"""Causal attention over an assembled cache for queries at chosen positions, without a dense mask where the
positions run contiguously.

A reuse path's queries rarely start at position 0: the tokens after a cached prefix, a document encoded after
the ingestion context, every non-exact token of a cacheblend prefill. Each sees the keys up to its own
position. As one dense additive mask [Q, K] the CPU flash kernel computes every query against every key (it
cannot skip the half above the diagonal, as it does for a plain causal prefill) and reads the mask as it goes:
970 queries after 30 cached tokens took longer than all 1000 computed causally. A contiguous run of queries at
start..end - 1 runs unmasked instead: after a short prefix, as a causal prefill of 0..end - 1 whose queries
before `start` are placeholders (the kernel and key blocks of a full prefill); after a
long one, as two pieces, the prefix's keys (every query sees them, no mask) and the run's own keys (a causal
block), merged by their log-sum-exps. Scattered queries (cacheblend's shrinking sets) keep a dense mask, but
many of them are cut into groups by position, each group's earlier keys unmasked: the mask then covers only the
keys between a group's first and last query, and no group reads the keys past its last.

In a sliding layer whose window cuts in (Gemma 3: 512 keys), the queries go in blocks, each over only the keys its
queries see (from the window's start for its first to its last one's own position), under a mask of those: as one
dense mask the kernel computed every query against every key, twice the work of the band at 1k positions and
growing with the prompt. (A run's causal block merged with the window's keys before it was no faster: the CPU
kernel runs a masked block faster per pair than a causal one.)

CPU only (the merge needs `_scaled_dot_product_flash_attention_for_cpu`, the kernel that returns log-sum-exps):
the adapter describes its masks as `CausalRows` on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

# A contiguous run shorter than this joins the scattered queries: a run of a few tokens saves less than its two
# kernel calls cost.
MIN_RUN = 32
# Scattered queries are cut into groups of about this many (at most MAX_GROUPS), each over its own keys: the keys
# before its first query unmasked, a dense mask over the rest. Measured in bf16 (9/3 heads, 64 channels): 1438 of
# 3978 positions 46 -> 33 ms in 5 groups, 1189 of 7987 99 -> 51 ms in 4; below ~500 queries one mask is faster.
GROUP_ROWS, MAX_GROUPS = 256, 8
# Queries in a sliding layer whose window cuts in go in blocks of this many. Measured on a whole prompt (4/1 heads,
# 256 channels, window 512: Gemma 3 270M's, fp32 and bf16 alike) against one dense mask: 824 positions 15.5 -> 11.4
# ms, 1221 35 -> 18, 2000 90 -> 36, 4000 370 -> 67; 64 rows about the same, 256 and more slower.
BAND_ROWS = 128


@dataclass(frozen=True)
class CausalRows:
    """Queries at `positions` [Q] (ascending, on the host), each seeing keys 0 .. its own position (in a sliding
    layer, only the last `window` of them): a causal mask described, for `causal_attention` to split, instead of
    materialized."""

    positions: torch.Tensor  # [Q] long, host
    attend_len: int  # K: the keys handed to attention
    window: int | None = None  # a sliding layer's window, where it cuts in

    def rows(self, rows: torch.Tensor) -> CausalRows:
        return CausalRows(self.positions[rows], self.attend_len, self.window)

    @cached_property
    def pieces(self) -> tuple[list[tuple[int, int, int]], torch.Tensor]:
        """The long runs as (first row, end row, first position), and the other rows [R'] (scattered): worked out
        once for all the layers that take this mask (at 8k positions, a pass over them costs ~1 ms per layer)."""
        positions = self.positions.tolist()
        bounds = runs(positions)
        long = [(a, e, positions[a]) for a, e in bounds if e - a >= MIN_RUN]
        short = torch.tensor([row for a, e in bounds if e - a < MIN_RUN for row in range(a, e)], dtype=torch.long)
        return long, short

    @cached_property
    def short_rows(self) -> CausalRows:
        """The scattered rows of `pieces` as a mask of their own (its dense form then kept across layers)."""
        return self.rows(self.pieces[1])

    def seen_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`dense` over the keys up to the last query's position, [1, 1, Q, last + 1]: built once for all the
        layers that take these rows (at 1k keys, building it cost as much as a fifth of the attention)."""
        masks = self.__dict__.setdefault("_seen_masks", {})  # cached_property's way: frozen, not immutable
        if (dtype, device) not in masks:
            masks[dtype, device] = CausalRows(self.positions, int(self.positions[-1]) + 1).dense(dtype, device)
        return masks[dtype, device]

    def band(self, r0: int, r1: int, groups: int, dtype: torch.dtype, device: torch.device
             ) -> tuple[int, int, torch.Tensor]:
        """Rows r0 .. r1 - 1 of a sliding layer's mask: the keys low .. end - 1 they see (from the window's start
        for the first to the last one's own position), and the mask over those, additive, the `groups` query heads
        that share a K/V head folded in as rows (attention._fold): [1, 1, groups * (r1 - r0), end - low]. Built once
        for all the layers that take it."""
        masks = self.__dict__.setdefault("_bands", {})  # cached_property's way: frozen, not immutable
        if (r0, r1, groups, dtype, device) not in masks:
            positions = self.positions[r0:r1]
            low, end = max(int(positions[0]) - self.window + 1, 0), int(positions[-1]) + 1
            rows = CausalRows(positions - low, end - low, self.window).dense(dtype, device)
            masks[r0, r1, groups, dtype, device] = low, end, rows.expand(1, groups, r1 - r0, -1).reshape(
                1, 1, -1, end - low)
        return masks[r0, r1, groups, dtype, device]

    def dense(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The same mask as an additive [1, 1, Q, K] tensor."""
        keys, positions = torch.arange(self.attend_len, device=device)[None], self.positions.to(device)[:, None]
        visible = keys <= positions
        if self.window is not None:
            visible &= keys > positions - self.window
        return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)[
            None, None]


def runs(positions: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive positions, as (first row, end row) into `positions` (ascending)."""
    bounds, start = [], 0
    for row in range(1, len(positions) + 1):
        if row == len(positions) or positions[row] != positions[row - 1] + 1:
            bounds.append((start, row))
            start = row
    return bounds


def _flash(query, key, value, causal: bool, scale: float | None, mask: torch.Tensor | None = None):
    """The CPU flash kernel: (out [B, H, R, D], log-sum-exp [B, H, R] fp32). Heads must match."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                          attn_mask=mask, scale=scale)
    return out, lse.reshape(out.shape[:-1])


def _fold(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, R, D] -> [B, H_kv, g * R, D]: the g query heads sharing a K/V head as more rows of it (how
    repeat_kv pairs them: head h reads K/V head h // g), so an unmasked block needs no copy of the K/V."""
    b, heads, rows, dim = query.shape
    return query.reshape(b, kv_heads, heads // kv_heads * rows, dim)


def _run(query, key, value, start: int, scale: float | None) -> torch.Tensor:
    """Queries [B, H, R, D] at start .. start + R - 1 over keys 0 .. start + R - 1: [B, H, R, D]."""
    b, heads, rows, dim = query.shape
    end = start + rows
    if start <= 2 * rows:
        # A short prefix: the causal prefill of 0 .. end - 1 with placeholder queries before `start` (their output
        # dropped). Its extra work, start**2 / 2 per head, is below the prefix block's start * R, and no merge.
        padded = query.new_zeros(b, heads, end, dim)
        padded[:, :, start:] = query
        out = F.scaled_dot_product_attention(padded, key[:, :, :end], value[:, :, :end], is_causal=True, scale=scale,
                                             enable_gqa=heads != key.shape[1])
        return out[:, :, start:]
    # A long prefix: its keys unmasked, then the run's own keys causally, the two merged by their log-sum-exps.
    groups = heads // key.shape[1]
    own_keys, own_values = key[:, :, start:end], value[:, :, start:end]
    if groups > 1:  # is_causal pairs query i with keys 0..i of the block, heads matched
        own_keys, own_values = own_keys.repeat_interleave(groups, 1), own_values.repeat_interleave(groups, 1)
    own, own_lse = _flash(query, own_keys, own_values, True, scale)
    return _merge(query, key, value, start, own, own_lse, scale)


def _windowed(query, key, value, mask: CausalRows, scale: float | None) -> torch.Tensor:
    """Queries [B, H, Q, D] at `mask.positions` [Q], each over the last `mask.window` keys up to its own position:
    [B, H, Q, D]. In blocks of BAND_ROWS queries, each one kernel call over the keys from the window's start for
    its first query to its last query's own position, under a mask of those keys only (`CausalRows.band`)."""
    b, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    out = query.new_empty(b, heads, rows, dim)
    for r0 in range(0, rows, BAND_ROWS):
        r1 = min(r0 + BAND_ROWS, rows)
        low, end, seen = mask.band(r0, r1, heads // kv_heads, query.dtype, query.device)
        band, _ = _flash(_fold(query[:, :, r0:r1], kv_heads), key[:, :, low:end], value[:, :, low:end], False, scale,
                         seen)
        out[:, :, r0:r1] = band.reshape(b, heads, r1 - r0, dim)
    return out


def _merge(query, key, value, start: int, own: torch.Tensor, own_lse: torch.Tensor,
           scale: float | None) -> torch.Tensor:
    """`own` [B, H, R, D] (log-sum-exp `own_lse` [B, H, R]: the queries over keys from `start` on) merged with the
    same queries' attention over keys 0 .. start - 1, which they all see: the softmax over both."""
    b, heads, rows, dim = query.shape
    before, before_lse = _flash(_fold(query, key.shape[1]), key[:, :, :start], value[:, :, :start], False, scale)
    share = torch.sigmoid(before_lse.reshape(b, heads, rows) - own_lse)  # the earlier keys' part of the mass
    return torch.lerp(own, before.reshape(b, heads, rows, dim), share[..., None].to(own.dtype))


def _scattered(query, key, value, mask: CausalRows, scale: float | None) -> torch.Tensor:
    """Queries [B, H, R, D] at scattered `mask.positions` [R] (ascending, host), each over keys 0 .. its own
    position: [B, H, R, D]."""
    positions = mask.positions
    b, heads, rows, dim = query.shape
    kv_heads, gqa = key.shape[1], heads != key.shape[1]
    pieces = min(max(rows // GROUP_ROWS, 1), MAX_GROUPS)
    if pieces == 1:
        seen = int(positions[-1]) + 1
        return F.scaled_dot_product_attention(query, key[:, :, :seen], value[:, :, :seen], scale=scale, enable_gqa=gqa,
                                              attn_mask=mask.seen_mask(query.dtype, query.device))
    out = query.new_empty(b, heads, rows, dim)
    bounds = [round(i * rows / pieces) for i in range(pieces + 1)]
    for r0, r1 in zip(bounds, bounds[1:], strict=False):
        first, last, count = int(positions[r0]), int(positions[r1 - 1]), r1 - r0
        part = query[:, :, r0:r1]
        # The group's own keys under a dense mask, query heads folded onto their K/V head (the mask repeated per head).
        mask = CausalRows(positions[r0:r1] - first, last - first + 1).dense(query.dtype, query.device)
        mask = mask.expand(1, heads // kv_heads, count, -1).reshape(1, 1, heads // kv_heads * count, -1)
        own, own_lse = _flash(_fold(part, kv_heads), key[:, :, first:last + 1], value[:, :, first:last + 1], False,
                              scale, mask)
        own, own_lse = own.reshape(b, heads, count, dim), own_lse.reshape(b, heads, count)
        out[:, :, r0:r1] = own if first == 0 else _merge(part, key, value, first, own, own_lse, scale)
    return out


def one_query_per_row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None) -> torch.Tensor:
    """A decode step's attention as fp32 matmuls and one softmax, without the flash kernel.

    In bf16 the CPU flash kernel sets up blocks for a run of queries, which for one query costs several times its
    arithmetic: over 1k keys 0.69 ms against 0.21 here, over 8k 6.0 against 2.6 (docs/method.md, "Packed weights
    and a decode step's attention").
    From ~30 queries on the two cost the same. fp32 throughout, as the kernel accumulates: the same error from an
    fp64 reference (tests/unit/test_attention.py).

    query: [B, H, 1, D]; key, value: [B, H_kv, K, D]; mask: additive, broadcast to [B, 1, 1, K], or None
    -> [B, 1, H, D], as the attention modules take their output back."""
    b, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    # The g query heads that share a K/V head are g rows against it (repeat_kv's pairing: head h reads h // g).
    folded = query.reshape(b, kv_heads, heads // kv_heads, dim).float()
    scores = torch.matmul(folded, key.float().transpose(-1, -2))  # [B, H_kv, g, K]
    scores *= dim ** -0.5 if scale is None else scale
    if mask is not None:
        scores += mask.reshape(mask.shape[0], 1, 1, -1)
    out = torch.matmul(torch.softmax(scores, dim=-1), value.float())  # [B, H_kv, g, D]
    return out.to(query.dtype).reshape(b, 1, heads, dim)


@dataclass(frozen=True)
class PerRow:
    """A batched decode step's keys (or values) as each row's own cache holds them, [1, H_kv, K_b, D] for row b,
    in place of one tensor padded to the longest row (kvcache.RowsCache): the padded copy of every row's cache, in
    every layer, cost 18 of a 4-stream step's ~137 ms (SmolLM2, ~1.2k tokens each, float32)."""

    rows: tuple[torch.Tensor, ...]


def rows_attention(query: torch.Tensor, keys: PerRow, values: PerRow, mask: torch.Tensor | None,
                   scale: float | None) -> torch.Tensor:
    """Each row's queries over its own keys, one kernel call a row. query: [B, H, Q, D]; mask: additive [B, 1, Q,
    K_max], K_max at least every row's K_b, or None -> [B, Q, H, D], as the attention modules take it back."""
    b, heads, q, dim = query.shape
    out = query.new_empty(b, q, heads, dim)
    for row, (key, value) in enumerate(zip(keys.rows, values.rows, strict=True)):
        seen = None if mask is None else mask[row:row + 1, :, :, :key.shape[2]]
        if q == 1 and query.dtype in (torch.bfloat16, torch.float16):  # as a lone 16-bit decode step runs it
            out[row] = one_query_per_row(query[row:row + 1], key, value, seen, scale)[0]
        else:
            out[row] = F.scaled_dot_product_attention(query[row:row + 1], key, value, attn_mask=seen, scale=scale,
                                                      enable_gqa=heads != key.shape[1])[0].transpose(0, 1)
    return out


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: CausalRows,
                     scale: float | None) -> torch.Tensor:
    """query: [B, H, Q, D] at mask.positions; key, value: [B, H_kv, K, D] -> [B, Q, H, D], as the attention
    modules take their output back."""
    if mask.window is not None:
        return _windowed(query, key, value, mask, scale).transpose(1, 2).contiguous()
    long, short = mask.pieces
    b, heads, q, dim = query.shape
    if not long:
        return _scattered(query, key, value, mask, scale).transpose(1, 2).contiguous()
    out = query.new_empty(b, q, heads, dim)
    for a, e, start in long:
        keys_seen = start + e - a
        out[:, a:e] = _run(query[:, :, a:e], key[:, :, :keys_seen], value[:, :, :keys_seen], start,
                           scale).transpose(1, 2)
    if short.numel():
        out[:, short] = _scattered(query[:, :, short], key, value, mask.short_rows, scale).transpose(1, 2)
    return out
