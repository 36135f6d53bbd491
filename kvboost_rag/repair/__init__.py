"""Boundary repair: which reused tokens to recompute so the prompt's KV stays near a full prefill's.

Each strategy is a module that registers itself with `protocol.register`; importing this package
registers the built-in ones, in the order they are listed everywhere (cheapest repair last but one).
"""

from . import reuse, selective, cacheblend  # noqa: F401, I001 - registers the strategies, in this order
from .protocol import Prefilled, Request, Strategy, names, register
from .protocol import get as get_strategy

__all__ = ["Prefilled", "Request", "Strategy", "get_strategy", "names", "register"]
