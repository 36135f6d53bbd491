"""The strategies that repair nothing: they differ only in what they reuse, and compute the rest.

- full: nothing reused, the whole prompt computed (the truth every other strategy is measured against).
- prefix: classic prefix caching, exact prefix hits only (same tokens after the same tokens).
- naive: exact hits and content hits re-rotated to their new positions, used as they are: the speed
  bound, and the quality floor the repairing strategies lift.
"""

from __future__ import annotations

from .protocol import Prefilled, Request, Strategy, register, run_every_layer


def compute_uncached(request: Request) -> Prefilled:
    """The tokens no stored chunk holds; after a cached prefix they run as attention.py's causal pieces (the
    prefix's keys unmasked, their own causally), so any cached prefix saves its compute."""
    return run_every_layer(request, request.plan.computed_positions())


FULL = register(Strategy("full", "a full prefill, nothing reused", False, False, False, compute_uncached))
PREFIX = register(Strategy("prefix", "classic prefix caching: exact prefix hits only", True, False, False,
                           compute_uncached))
NAIVE = register(Strategy("naive", "every stored chunk reused as it is, nothing repaired", True, True, False,
                          compute_uncached))
