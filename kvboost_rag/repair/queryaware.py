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

With `qa_order="relevance_last"` the chosen documents are moved after the other documents before pass
2 (the prompt changes: the answer no longer has later, stale distractors after it, and recomputing the
chosen documents is then all that differs from a full prefill of the reordered prompt, up to the
stale documents before them).
"""

from __future__ import annotations

import math

import torch

from ..adapter import ModelAdapter
from ..assembly import APPROX, Plan
from ..calibration import document_spans, head_doc_scores, question_rows
from ..config import RepairConfig, check_order
from ..kvcache import KVBuffers

AFTER_MODES = ("none", "all", "attn")


def rank_documents(adapter: ModelAdapter, cache: KVBuffers, plan: Plan, spans: list[tuple[int, int]], heads,
                   suffix_tokens: int = 0) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor]:
    """Pass 1: the uncached tokens over the assembled (naive) cache, up to the last retrieval head.

    Returns (each span's score [len(spans)], {layer: the question's attention [H, R, S]}, the
    positions run). Their K/V are left in `cache` for the layers run; pass 2 overwrites them."""
    n = plan.num_tokens
    uncached = plan.computed_positions()
    rows = question_rows(plan, uncached, suffix_tokens)
    last_layer = max(layer for layer, _ in heads)
    _, probes = adapter.run_layers_probed(adapter.embed(plan.token_ids[uncached]), uncached, cache,
                                          range(last_layer + 1), n, {layer for layer, _ in heads}, rows)
    return head_doc_scores(probes, heads, spans), probes, uncached


def top_documents(scores: torch.Tensor, count: int) -> list[int]:
    """Indices of the `count` best-scored spans, in prompt order."""
    return sorted(torch.topk(scores, min(count, scores.numel())).indices.tolist()) if count > 0 else []


def recompute(adapter: ModelAdapter, cache: KVBuffers, plan: Plan, config: RepairConfig,
              spans: list[tuple[int, int]], chosen: list[int], probes: dict[int, torch.Tensor] | None = None,
              heads=()) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 2: the uncached tokens, the chosen spans and what `qa_after` adds, through every layer."""
    n = plan.num_tokens
    picked = [plan.computed_positions()] + [torch.arange(*spans[i]) for i in chosen]
    if chosen:
        first = spans[chosen[0]][0]
        later = [i for i in range(len(spans)) if i not in chosen and spans[i][0] > first]
        if config.qa_after == "all":
            picked += [torch.arange(*spans[i]) for i in later]
        elif config.qa_after == "attn" and later and config.qa_after_ratio > 0 and probes:
            per_token = sum(probes[layer][head].mean(0) for layer, head in heads).cpu()  # [S]
            candidates = torch.cat([torch.arange(*spans[i]) for i in later])
            count = min(math.ceil(config.qa_after_ratio * candidates.numel()), candidates.numel())
            picked.append(candidates[torch.topk(per_token[candidates], count).indices])
    positions = torch.unique(torch.cat(picked))  # sorted
    hidden = adapter.embed(plan.token_ids[positions])
    layers = range(adapter.num_layers)
    if config.qa_damp > 0 and chosen:
        bias = torch.zeros(n)
        for i, (start, end) in enumerate(spans):
            if i not in chosen:
                bias[start:end] = -config.qa_damp
        rows = question_rows(plan, positions)  # the whole tail, template included
        hidden = adapter.run_layers_biased(hidden, positions, cache, layers, n, bias, rows)
    else:
        hidden = adapter.run_layers(hidden, positions, cache, layers, n)
    return hidden[:, -1:], positions


def check_config(config: RepairConfig) -> None:
    if config.qa_after not in AFTER_MODES:
        raise ValueError(f"unknown qa_after {config.qa_after!r}; use one of {', '.join(AFTER_MODES)}")
    check_order(config.qa_order)


def queryaware_prefill(adapter: ModelAdapter, cache: KVBuffers, plan: Plan, config: RepairConfig,
                       heads, suffix_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill with query-aware repair, documents in place. Returns (hidden of the last token
    [1, 1, H], recomputed positions)."""
    check_config(config)
    spans = document_spans(plan, APPROX)
    heads = list(heads.heads[:max(config.qa_heads, 1)])
    chosen, probes = [], None
    if spans and config.qa_docs > 0:
        scores, probes, _ = rank_documents(adapter, cache, plan, spans, heads, suffix_tokens)
        chosen = top_documents(scores, config.qa_docs)
    return recompute(adapter, cache, plan, config, spans, chosen, probes, heads)


def move_last(segments: list, chosen: list[int]) -> list:
    """The prompt's segments (str and Document) with the chosen documents (indices among the
    documents, in order) moved after the last other document, each with the whitespace-only text
    that followed it as its separator, in their own order; everything else stays in place."""
    doc_at = [i for i, seg in enumerate(segments) if not isinstance(seg, str)]
    chosen_at = {doc_at[j] for j in chosen if 0 <= j < len(doc_at)}
    others = [i for i in doc_at if i not in chosen_at]
    if not others:
        return list(segments)
    anchor = others[-1]  # chosen documents after it are already last
    moved = sorted(i for i in chosen_at if i < anchor)
    if not moved:
        return list(segments)
    separators = {i + 1 for i in moved if isinstance(segments[i + 1], str) and not segments[i + 1].strip()}
    carried = []
    for i in moved:
        carried += [segments[i + 1] if i + 1 in separators else "\n\n", segments[i]]
    out = []
    for i, seg in enumerate(segments):
        if i in moved or i in separators:
            continue
        out.append(seg)
        if i == anchor:
            out += carried
    return out
