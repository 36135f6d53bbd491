"""selective: recompute the boundary region of every reused chunk.

A chunk encoded without its prompt's text before it (alone, or after the ingestion context) lacks that
context, and when encoded alone it starts as if it began the text: its first tokens carry a false
attention sink. Recomputing the first `boundary_tokens` of each reused chunk (and every uncached token),
attending to the whole assembled cache, repairs that region; the rest of each chunk is reused as it is.
"""

from __future__ import annotations

import torch

from ..assembly import APPROX, COMPUTE, Plan
from .protocol import Prefilled, Request, Strategy, register, run_every_layer


def selective_positions(plan: Plan, boundary_tokens: int) -> torch.Tensor:
    """Sorted positions to run through all layers: uncached tokens, chunk heads, the last token."""
    chosen = [plan.positions(COMPUTE), torch.tensor([plan.num_tokens - 1])]
    for chunk in plan.chunks:
        if chunk.source == APPROX and boundary_tokens > 0:
            chosen.append(torch.arange(chunk.start, min(chunk.end, chunk.start + boundary_tokens)))
    return torch.unique(torch.cat(chosen))  # sorted


def selective_prefill(request: Request) -> Prefilled:
    return run_every_layer(request, selective_positions(request.plan, request.repair.boundary_tokens))


SELECTIVE = register(Strategy("selective", "each reused chunk's first boundary_tokens recomputed", True, True,
                              False, selective_prefill))
