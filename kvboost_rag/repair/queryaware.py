"""QueryAwareRecompute: recompute the documents the question needs, found by retrieval heads.

Pass 1 runs the uncached tokens (template, separators, the question) over the naive cache up to the
last calibrated retrieval head (see `calibration`) and reads the question's attention there: each
reused document's share of it, summed over the heads, ranks the documents. Pass 2 recomputes, through
every layer and against the assembled cache, the uncached tokens plus

- the top `qa_docs` documents (their stale KV is where the answer is read from), and
- per `qa_after`, what of the reused documents after the first chosen one: "none", "all", or "attn"
  (the `qa_after_ratio` fraction of their tokens the question attends to most at the retrieval heads:
  the later distractors that pull the answer away).

Optionally (`qa_damp` > 0) the question's attention logits to the reused documents not chosen are
lowered by `qa_damp` in pass 2, so stale look-alike documents weigh less against the recomputed one.
"""

from __future__ import annotations

import math

import torch

from ..adapter import ModelAdapter
from ..assembly import APPROX, COMPUTE, Plan
from ..calibration import document_spans, head_doc_scores, question_rows
from ..config import RepairConfig
from ..kvcache import KVBuffers

AFTER_MODES = ("none", "all", "attn")


def queryaware_prefill(adapter: ModelAdapter, cache: KVBuffers, plan: Plan, config: RepairConfig,
                       heads) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill with query-aware repair. Returns (hidden of the last token [1, 1, H], recomputed positions)."""
    if config.qa_after not in AFTER_MODES:
        raise ValueError(f"unknown qa_after {config.qa_after!r}; use one of {', '.join(AFTER_MODES)}")
    n = plan.num_tokens
    uncached = torch.unique(torch.cat([plan.positions(COMPUTE), torch.tensor([n - 1])]))
    spans = document_spans(plan, APPROX)
    heads = list(heads.heads[:max(config.qa_heads, 1)])
    chosen: list[int] = []
    extra: list[torch.Tensor] = []
    if spans and config.qa_docs > 0:
        # Pass 1: the question over the naive cache, up to the last retrieval head.
        rows = question_rows(plan, uncached)
        last_layer = max(layer for layer, _ in heads)
        _, probes = adapter.run_layers_probed(adapter.embed(plan.token_ids[uncached]), uncached, cache,
                                              range(last_layer + 1), n, {layer for layer, _ in heads}, rows)
        scores = head_doc_scores(probes, heads, spans)
        chosen = sorted(torch.topk(scores, min(config.qa_docs, len(spans))).indices.tolist())
        first = spans[chosen[0]][0]
        later = [i for i in range(len(spans)) if i not in chosen and spans[i][0] > first]
        if config.qa_after == "all":
            extra += [torch.arange(*spans[i]) for i in later]
        elif config.qa_after == "attn" and later and config.qa_after_ratio > 0:
            per_token = sum(probes[layer][head].mean(0) for layer, head in heads).cpu()  # [S]
            candidates = torch.cat([torch.arange(*spans[i]) for i in later])
            count = min(math.ceil(config.qa_after_ratio * candidates.numel()), candidates.numel())
            extra.append(candidates[torch.topk(per_token[candidates], count).indices])
    picked = [uncached] + [torch.arange(*spans[i]) for i in chosen] + extra
    positions = torch.unique(torch.cat(picked))  # sorted
    hidden = adapter.embed(plan.token_ids[positions])
    layers = range(adapter.num_layers)
    if config.qa_damp > 0 and chosen:
        bias = torch.zeros(n)
        for i, (start, end) in enumerate(spans):
            if i not in chosen:
                bias[start:end] = -config.qa_damp
        rows = question_rows(plan, positions)
        hidden = adapter.run_layers_biased(hidden, positions, cache, layers, n, bias, rows)
    else:
        hidden = adapter.run_layers(hidden, positions, cache, layers, n)
    return hidden[:, -1:], positions
