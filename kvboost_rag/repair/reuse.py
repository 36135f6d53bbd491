"""The strategies that repair nothing: they differ only in what they reuse, and compute the rest.

- full: nothing reused, the whole prompt computed (the truth every other strategy is measured against).
- prefix: classic prefix caching, exact prefix hits only (same tokens after the same tokens).
- naive: exact hits and content hits re-rotated to their new positions, used as they are: the speed
  bound, and the quality floor the repairing strategies lift.
"""

from __future__ import annotations

import torch

from .protocol import Prefilled, Request, Strategy, register, run_every_layer

# A cached prefix shorter than this fraction of the prompt is computed again. The tokens after a cached prefix
# need an explicit mask (each sees the prefix and the fresh tokens before it), and the CPU attention kernels
# run a masked query block over every key, where a plain causal prefill skips the half above the diagonal:
# for a 1k-token prompt on the bundled model, 970 fresh tokens after 30 cached ones took longer than all
# 1000 computed causally. Per token, the linear layers cost about what attention over the whole prompt costs
# (c_l ~ N c_a there), so reusing P of N tokens pays once P/N > ~1/4.
MIN_PREFIX_FRACTION = 0.25


def compute_uncached(request: Request) -> Prefilled:
    return run_every_layer(request, request.plan.computed_positions())


def compute_after_prefix(request: Request) -> Prefilled:
    """prefix: the tokens after the cached prefix; all of them when that prefix is too short to pay."""
    n, positions = request.plan.num_tokens, request.plan.computed_positions()
    if positions.numel() < n and n - positions.numel() < MIN_PREFIX_FRACTION * n:
        positions = torch.arange(n)
    return run_every_layer(request, positions)


FULL = register(Strategy("full", "a full prefill, nothing reused", False, False, False, compute_uncached))
PREFIX = register(Strategy("prefix", "classic prefix caching: exact prefix hits only", True, False, False,
                           compute_after_prefix))
NAIVE = register(Strategy("naive", "every stored chunk reused as it is, nothing repaired", True, True, False,
                          compute_uncached))
