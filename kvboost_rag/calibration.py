"""Retrieval heads: the attention heads whose question-to-document attention names the document the
question needs, found per model on our own generated tuning split and cached on disk.

A calibration item is a RAG prompt of k documents, one of which holds the answer (`answer_doc`). Its
documents are reused as stored (the naive cache, exactly what a request has before repair), the
question runs through every layer, and at each head the question's attention mass on each document
is read. A head scores the fraction of items where its most-attended document is the answer's; the
best `max_heads` heads are kept. Results live in `models.cache_dir()/calibration/`, one JSON file per
engine fingerprint (model, weights, dtype, tokenizer, encoding), so a model is calibrated once.
"""

from __future__ import annotations

import collections
import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import models
from .assembly import Plan, assemble
from .documents import DocumentIndex

CALIB_DATA = Path(__file__).resolve().parent / "bench" / "synthetic_calib.jsonl"
VERSION = 2


@dataclass(frozen=True)
class RetrievalHeads:
    heads: tuple[tuple[int, int], ...]  # (layer, query head), best first
    accuracy: tuple[float, ...]  # per head, on the tuning split
    items: int

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.heads})


def document_spans(plan: Plan, source: str | None = None) -> list[tuple[int, int]]:
    """[start, end) of every document in the prompt (adjacent document chunks joined), in order.

    With `source`, only documents all of whose chunks have that source."""
    spans: list[tuple[int, int, bool]] = []
    for chunk in plan.chunks:
        if not chunk.is_document:
            continue
        ok = source is None or chunk.source == source
        if spans and spans[-1][1] == chunk.start:
            start, _, prev_ok = spans[-1]
            spans[-1] = (start, chunk.end, prev_ok and ok)
        else:
            spans.append((chunk.start, chunk.end, ok))
    return [(s, e) for s, e, ok in spans if ok]


def question_rows(plan: Plan, positions: torch.Tensor, suffix_tokens: int = 0) -> torch.Tensor:
    """Indices into `positions` of the question: the tokens after the last document, less the
    template's closing `suffix_tokens` (all of them if that would leave none)."""
    docs = document_spans(plan)
    last = docs[-1][1] if docs else 0
    rows = torch.nonzero(positions >= last).flatten()
    return rows[:-suffix_tokens] if 0 < suffix_tokens < rows.numel() else rows


def template_suffix_tokens(engine) -> int:
    """How many tokens the chat template puts after a user message's content (0 without a template)."""
    marker = "\x00kvboost-q\x00"
    try:
        rendered = engine.render([{"role": "user", "content": marker}])
    except ValueError:
        return 0
    tail = rendered[rendered.index(marker) + len(marker):]
    return len(engine.tokenizer(tail, add_special_tokens=False)["input_ids"]) if tail else 0


def span_scores(probs: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """How strongly the question points at each span: every query row's attention share of each
    span (its mass over the spans' total), the max over rows. probs: [H, R, S] -> [H, len(spans)].

    The max, not the mean: the rows that look up a document are few (the entity's name), the rest
    of the question attends locally."""
    mass = torch.stack([probs[:, :, s:e].sum(-1) for s, e in spans], dim=-1)  # [H, R, D]
    share = mass / mass.sum(-1, keepdim=True).clamp_min(1e-9)
    return share.max(dim=1).values


@torch.inference_mode()
def naive_pass(engine, prompt, layers: range, probe_layers) -> tuple[Plan, dict[int, torch.Tensor], list]:
    """The question's attention over the naive cache: (plan, {layer: [H, R, S]}, document spans)."""
    p = engine.plan(prompt, "naive")
    n = p.num_tokens
    cache = assemble(p, engine.adapter, n)
    uncached = p.computed_positions()
    rows = question_rows(p, uncached, template_suffix_tokens(engine))
    _, probes = engine.adapter.run_layers_probed(engine.adapter.embed(p.token_ids[uncached]), uncached, cache,
                                                 layers, n, set(probe_layers), rows)
    return p, probes, document_spans(p)


@torch.inference_mode()
def calibrate(engine, items, max_heads: int = 8) -> RetrievalHeads:
    """Score every head on `items` (BenchItems with answer_doc); keep the best `max_heads`.

    Uses a private in-memory store, so the engine's store and document index are left untouched."""
    from .bench.run import render_prompt
    from .config import StoreConfig
    from .store import make_store

    sibling = copy.copy(engine)
    sibling.counters = collections.Counter()  # the engine's own counters count its requests only
    adapter = engine.adapter
    hits = torch.zeros(adapter.num_layers, adapter.num_heads)
    margin = torch.zeros(adapter.num_layers, adapter.num_heads)
    used = 0
    for item in items:
        if item.answer_doc is None:
            continue
        # A fresh store per item: only this item's documents are ever held.
        sibling.store, sibling.documents = make_store(StoreConfig(), engine.fingerprint), DocumentIndex(None)
        sibling.ingest(list(item.documents), progress=False)
        _, probes, spans = naive_pass(sibling, render_prompt(item), range(adapter.num_layers),
                                      range(adapter.num_layers))
        if len(spans) != len(item.documents):
            continue
        for layer, probs in probes.items():
            share = span_scores(probs, spans)  # [H, D]
            hits[layer] += (share.argmax(-1) == item.answer_doc).float()
            margin[layer] += share[:, item.answer_doc]
        used += 1
    if used == 0:
        raise ValueError("calibration needs items with answer_doc and one stored span per document")
    score = hits / used + 1e-3 * margin / used  # accuracy, ties broken by the answer's attention share
    order = torch.argsort(score.flatten(), descending=True)[:max_heads]
    heads = tuple((int(i) // adapter.num_heads, int(i) % adapter.num_heads) for i in order)
    accuracy = tuple(float(hits[layer, head] / used) for layer, head in heads)
    return RetrievalHeads(heads, accuracy, used)


def calibration_path(fingerprint: str) -> Path:
    return models.cache_dir() / "calibration" / f"retrieval-heads-v{VERSION}-{fingerprint[:32]}.json"


_MEMO: dict[str, RetrievalHeads] = {}


def retrieval_heads(engine, *, items: int = 24, max_heads: int = 8, data: Path = CALIB_DATA) -> RetrievalHeads:
    """The engine's retrieval heads: memoized, else read from disk, else calibrated now and saved."""
    key = engine.fingerprint
    if key in _MEMO and len(_MEMO[key].heads) >= max_heads and _MEMO[key].items >= items:
        return _MEMO[key]
    path = calibration_path(key)
    if path.exists():
        saved = json.loads(path.read_text())
        # A saved calibration counts when it is this engine's and used at least as many items.
        if saved.get("fingerprint") == key and len(saved["heads"]) >= max_heads and saved["items"] >= items:
            found = RetrievalHeads(tuple(tuple(h) for h in saved["heads"]), tuple(saved["accuracy"]), saved["items"])
            _MEMO[key] = found
            return found
    from .bench.data import load_items

    found = calibrate(engine, load_items(data, limit=items), max_heads=max(max_heads, 16))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"fingerprint": key, "model": engine.model_id, "heads": found.heads,
                               "accuracy": found.accuracy, "items": found.items, "data": str(data)}, indent=1))
    tmp.replace(path)
    _MEMO[key] = found
    return found


def head_doc_scores(probes: dict[int, torch.Tensor], heads: Sequence[tuple[int, int]],
                    spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Each span's `span_scores`, summed over the given heads: [len(spans)]."""
    total = torch.zeros(len(spans))
    for layer, head in heads:
        total += span_scores(probes[layer][head:head + 1], spans)[0].cpu()
    return total
