"""CacheBlend repair with progressive per-layer selection.

All non-exact tokens run through layers 0..check_layer - 1. From the check layer on, at every layer,
each token still in the set gets that layer's fresh K/V by projection alone (norm, k/v projections,
RoPE), which is compared with its cached K/V; the reused tokens that deviate most (plus every uncached
token) run the whole layer, attending to the fused cache, and stay in the set; the others keep the
fresh K/V just written and their cached K/V in every deeper layer. The set shrinks geometrically, the
first repaired layer holding `taper` times more reused tokens than the last, keeping the tokens whose
KV is still moving.

Why progressive: the check layer's deviation only roughly predicts which tokens are stale deep in the
network; measuring again at each layer (as CacheBlend's paper does) spends the budget on the tokens that
stay wrong. Why the recency weight: the question attends most to the documents just before it, and the
later a document sits the more context its stored KV never saw; deviation is scaled by
((position + 1) / n) ** recency before ranking.

Cost: `recompute_ratio` (RepairConfig.budget: the fidelity level's when not given) is the fraction of reused
tokens run per layer after the check layer, averaged over those layers (1.0 recomputes everything: a full
prefill). A request reports as its recomputed tokens the number of tokens run per layer after the check layer
(uncached ones included), averaged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..adapter import ModelAdapter
from ..assembly import APPROX, COMPUTE, Plan
from ..config import RepairConfig
from ..kvcache import KVBuffers
from .protocol import Prefilled, Request, Strategy, register


@dataclass(frozen=True)
class BlendResult:
    hidden: torch.Tensor  # [1, 1, H], the last token after the last layer
    layer_positions: list[torch.Tensor]  # positions given fresh K/V at each layer after the check layer

    @property
    def recomputed_tokens(self) -> int:
        """Tokens given fresh K/V per layer after the check layer, averaged over those layers."""
        if not self.layer_positions:
            return 0
        return round(sum(p.numel() for p in self.layer_positions) / len(self.layer_positions))


def kv_deviation(fresh: tuple[torch.Tensor, torch.Tensor], cached: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Squared L2 distance per token over heads and channels. K/V: [1, H_kv, Q, D] -> [Q]."""
    dk = (fresh[0].float() - cached[0].float()).pow(2).sum(dim=(0, 1, 3))
    dv = (fresh[1].float() - cached[1].float()).pow(2).sum(dim=(0, 1, 3))
    return dk + dv


def top_deviations(deviation: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` candidate indices (into `deviation`) that deviate most."""
    if count <= 0 or candidates.numel() == 0:
        return candidates[:0]
    return candidates[torch.topk(deviation[candidates], min(count, candidates.numel())).indices]


def layer_fractions(average: float, taper: float, layers: int) -> list[float]:
    """Per-layer fractions r_j = min(1, s * taper ** (-j / (layers - 1))) whose mean is `average`.

    `taper` >= 1 is how many times more tokens the first layer after the check runs than the last;
    1 keeps one set for all layers (the original CacheBlend)."""
    if layers <= 0:
        return []
    if average >= 1.0:
        return [1.0] * layers
    if average <= 0.0:
        return [0.0] * layers
    decay = [taper ** (-j / (layers - 1)) if layers > 1 else 1.0 for j in range(layers)]

    def mean(scale: float) -> float:
        return sum(min(1.0, scale * d) for d in decay) / layers

    low, high = 0.0, 1.0 / decay[-1]  # mean(high) = 1 >= average
    for _ in range(60):  # bisection: the clipped mean is monotonic in the scale
        mid = (low + high) / 2
        low, high = (mid, high) if mean(mid) < average else (low, mid)
    return [min(1.0, high * d) for d in decay]


def cacheblend_prefill(adapter: ModelAdapter, cache: KVBuffers, plan: Plan, config: RepairConfig) -> BlendResult:
    """Prefill with progressive CacheBlend repair, writing the repaired K/V into `cache`.

    Deviation is measured from the K/V as assembled (mapped by drift.py's maps when the engine has them),
    which the unrepaired tokens keep."""
    n, num_layers = plan.num_tokens, adapter.num_layers
    always = plan.computed_positions()  # uncached: run every layer
    budget = config.budget  # recompute_ratio, else the fidelity level's
    if budget <= 0:  # nothing reused is repaired: naive reuse
        hidden = adapter.run_layers(adapter.embed(plan.token_ids[always]), always, cache, range(num_layers), n)
        return BlendResult(hidden[:, -1:], [always])
    reused = plan.positions(APPROX)
    positions = torch.unique(torch.cat([always, reused]))  # sorted; exact hits are never recomputed
    multiple = config.size_multiple if config.size_multiple >= 0 else (16 if adapter.dtype.itemsize == 2 else 0)
    # Uncached text before the first reused document (the template's opening, say) has exact context:
    # the next request finds it stored. Rounding leaves it out, so a request and its repeat choose alike.
    head = [torch.arange(c.start, c.end) for c in plan.chunks if c.source == COMPUTE and c.exact_context]
    head = torch.cat(head) if head else torch.empty(0, dtype=torch.long)
    check = min(max(config.check_layer, 0), num_layers - 1)
    # fractions[j]: of the reused tokens, how many get fresh K/V at layer check + 1 + j.
    fractions = layer_fractions(budget, max(config.taper, 1.0), num_layers - check - 1)
    num_reused = int(torch.isin(positions, always, invert=True).sum())
    weight = ((positions.float() + 1) / n) ** config.recency  # [Q] later tokens count more

    # One mask (per kind of layer) for every non-exact token; the shrinking set takes its rows.
    mask = adapter.causal_mask(positions, n, adapter.dtype)
    hidden = adapter.embed(plan.token_ids[positions])  # [1, Q, H]
    if check > 0:
        hidden = adapter.run_layers(hidden, positions, cache, range(check), n, mask=mask)
    rows = torch.arange(positions.numel())  # into `positions`: the tokens whose input to `layer` we hold
    layer_positions: list[torch.Tensor] = []
    for layer in range(check, num_layers):
        here = positions[rows]
        if layer > check:
            layer_positions.append(here)
        # Every token in the set gets this layer's fresh K/V; only the projections are needed for that.
        keys, values = adapter.project_kv(layer, hidden, here)
        if layer == num_layers - 1:
            keep = torch.tensor([rows.numel() - 1])  # only the last token's output is needed (position n - 1)
        else:
            stale = (cache.keys[layer][:, :, here], cache.values[layer][:, :, here])
            # On the host: the selection below indexes host positions (one copy per layer on a GPU).
            score = kv_deviation((keys, values), stale).cpu() * weight[rows]
            is_reused = torch.isin(here, always, invert=True)
            count, available = math.ceil(fractions[layer - check] * num_reused), int(is_reused.sum())
            if multiple > 0 and count < available:
                # The set (uncached included, the head left out) to the nearest multiple; a layer
                # that keeps every token stays whole, so recompute_ratio=1 is still a full prefill.
                fixed = rows.numel() - available - int(torch.isin(here, head).sum())
                total = max(round((fixed + count) / multiple), 1) * multiple
                count = max(total - fixed, 0)
            keep = torch.arange(rows.numel())
            if count < available:
                picked = top_deviations(score, torch.nonzero(is_reused).flatten(), count)
                keep = torch.sort(torch.cat([torch.nonzero(~is_reused).flatten(), picked])).values
        slots = here.to(cache.all_keys.device)
        cache.keys[layer].index_copy_(2, slots, keys)
        cache.values[layer].index_copy_(2, slots, values)
        # The kept tokens run the whole layer (their output is the next layer's input); the dropped ones
        # keep the fresh K/V just written here and their cached K/V in every deeper layer.
        rows, hidden = rows[keep], hidden[:, keep]
        hidden = adapter.run_layers(hidden, positions[rows], cache, range(layer, layer + 1), n, mask=mask.rows(rows))
    return BlendResult(hidden[:, -1:], layer_positions or [positions])


def blend(request: Request) -> Prefilled:
    result = cacheblend_prefill(request.adapter, request.cache, request.plan, request.repair)
    return Prefilled(result.hidden, result.recomputed_tokens)


CACHEBLEND = register(Strategy("cacheblend", "content hits reused, the tokens whose K/V deviate most recomputed "
                               "layer by layer (the default)", True, True, True, blend, guarded=True))
