"""The repair protocol: what a strategy reuses from the store, and how it prefills the cache assembled
from it. One module per strategy registers a `Strategy` here; the engine plans, assembles and calls
`strategy.prefill`, and knows no strategy by name.

A new strategy is a module with a prefill function and one `register(Strategy(...))` call, imported by
`repair/__init__.py`; its name is then accepted everywhere a strategy is (engine, CLI, bench, both
integrations, the server).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..adapter import ModelAdapter
from ..assembly import Plan
from ..config import RepairConfig
from ..kvcache import KVBuffers


@dataclass(frozen=True)
class Request:
    """What a strategy's prefill gets: the prompt's plan, its cache as assembled (reused K/V placed, the
    rest empty), the repair settings of this request."""

    adapter: ModelAdapter
    plan: Plan
    cache: KVBuffers  # capacity >= plan.num_tokens
    repair: RepairConfig


@dataclass(frozen=True)
class Prefilled:
    """A strategy's result: the cache holds every prompt position's K/V, ready to decode from."""

    hidden: torch.Tensor  # [1, 1, H] the last prompt token's output
    # Prompt tokens run through every layer (a strategy whose set shrinks layer by layer reports the mean).
    recomputed_tokens: int


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str  # one line, for --help and error messages
    reuse_exact: bool  # exact prefix hits (same tokens after the same prefix) are reused
    reuse_content: bool  # content hits (same tokens stored in another context) are re-rotated and reused
    maps_drift: bool  # content hits are assembled through the engine's drift maps (when it has some)
    prefill: Callable[[Request], Prefilled]
    # The fidelity guard (fidelity.py) watches its answers: the product strategies. The baselines (naive,
    # selective) run bare, as the methods they are; exact strategies have nothing to guard.
    guarded: bool = False


_REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    if strategy.name in _REGISTRY:
        raise ValueError(f"a strategy named {strategy.name!r} is registered already")
    _REGISTRY[strategy.name] = strategy
    return strategy


def get(name: str) -> Strategy:
    """The registered strategy, or a ValueError listing the known ones."""
    strategy = _REGISTRY.get(name) if isinstance(name, str) else None
    if strategy is None:
        raise ValueError(f"unknown strategy {name!r}; use one of {', '.join(_REGISTRY)}")
    return strategy


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def run_every_layer(request: Request, positions: torch.Tensor) -> Prefilled:
    """Run the tokens at `positions` [Q] through every layer against the assembled cache: the prefill of
    a strategy that repairs nothing beyond the tokens it computes."""
    adapter, p = request.adapter, request.plan
    hidden = adapter.run_layers(adapter.embed(p.token_ids[positions]), positions, request.cache,
                                range(adapter.num_layers), p.num_tokens)
    return Prefilled(hidden[:, -1:], int(positions.numel()))
