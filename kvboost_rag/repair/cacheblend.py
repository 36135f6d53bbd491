"""CacheBlendRecompute: recompute the reused tokens whose KV deviates most from the truth.

All non-exact tokens run through layers 0..check_layer. At the check layer each reused token's
fresh K/V is compared with its cached K/V; the `recompute_ratio` fraction that deviates most
(plus every uncached token) continues through the remaining layers, attending to the fused cache,
and overwrites its K/V in place. The other reused tokens keep their cached K/V from the check
layer on, so the cost after the check layers scales with the selected fraction.
"""

from __future__ import annotations

import math

import torch

from ..adapter import ModelAdapter
from ..assembly import APPROX, COMPUTE, Plan
from ..config import RepairConfig
from ..kvcache import KVBuffers

SELECT_MODES = ("deviation", "random")


def kv_deviation(fresh: tuple[torch.Tensor, torch.Tensor], cached: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Squared L2 distance per token over heads and channels. K/V: [1, H_kv, Q, D] -> [Q]."""
    dk = (fresh[0].float() - cached[0].float()).pow(2).sum(dim=(0, 1, 3))
    dv = (fresh[1].float() - cached[1].float()).pow(2).sum(dim=(0, 1, 3))
    return dk + dv


def choose(deviation: torch.Tensor, candidates: torch.Tensor, count: int, mode: str, seed: int) -> torch.Tensor:
    """Indices (into `deviation`) of `count` of the candidate indices, by the given rule."""
    if count <= 0 or candidates.numel() == 0:
        return candidates[:0]
    count = min(count, candidates.numel())
    if mode == "deviation":
        return candidates[torch.topk(deviation[candidates], count).indices]
    if mode == "random":
        gen = torch.Generator().manual_seed(seed)
        return candidates[torch.randperm(candidates.numel(), generator=gen)[:count]]
    raise ValueError(f"unknown select mode {mode!r}; use one of {', '.join(SELECT_MODES)}")


def cacheblend_prefill(adapter: ModelAdapter, cache: KVBuffers, plan: Plan,
                       config: RepairConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill with CacheBlend repair. Returns (hidden of the last token [1, 1, H], recomputed positions)."""
    n = plan.num_tokens
    uncached = torch.unique(torch.cat([plan.positions(COMPUTE), torch.tensor([n - 1])]))
    reused = plan.positions(APPROX)
    first = torch.unique(torch.cat([uncached, reused]))  # sorted; exact hits are never recomputed
    check = min(max(config.check_layer, 0), adapter.num_layers - 1)

    cache.capture_layer = check
    try:
        hidden = adapter.run_layers(adapter.embed(plan.token_ids[first]), first, cache, range(check + 1), n)
        cached = cache.captured
    finally:
        cache.capture_layer, cache.captured = None, None
    fresh = (cache.keys[check][:, :, first], cache.values[check][:, :, first])
    deviation = kv_deviation(fresh, cached)  # [Q]

    is_reused = torch.isin(first, uncached, invert=True)
    count = math.ceil(config.recompute_ratio * int(is_reused.sum()))
    picked = choose(deviation, torch.nonzero(is_reused).flatten(), count, config.select, config.seed)
    keep = torch.sort(torch.cat([torch.nonzero(~is_reused).flatten(), picked])).values
    positions = first[keep]
    hidden = adapter.run_layers(hidden[:, keep], positions, cache, range(check + 1, adapter.num_layers), n)
    return hidden[:, -1:], positions
