"""Encoding documents for the store: each one after the ingestion context, several side by side per forward.

A document's stored K/V are what it gets after the ingestion context (ChunkingConfig.doc_context), so that they
look like a later document's in a prompt. The context is the same for every document: its K/V are computed once
per engine and every document's tokens attend to them (a third of an ingestion's compute saved). Documents are
encoded in batches, one row each, right-padded to the longest of the batch: bf16 matmuls on this kind of CPU
run several times faster on a few thousand rows than on one document's few hundred, and fp32 ones gain too.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator

import torch

from . import keys as keyring
from .adapter import ModelAdapter
from .kvcache import KVBuffers
from .store.documents import Document

# A document's token ids after the context [N], and read(start, end) -> their K/V [L, H_kv, end - start, D] each.
Encoded = tuple[torch.Tensor, Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]]


def batches(docs: list[Document], budget: int) -> Iterator[list[Document]]:
    """`docs` in order, in runs whose padded size (documents x the longest one's tokens) stays within `budget`
    tokens (EngineConfig.ingest_batch_tokens); a document longer than the budget goes alone."""
    batch: list[Document] = []
    longest = 0
    for doc in docs:
        if batch and max(longest, len(doc.token_ids)) * (len(batch) + 1) > budget:
            yield batch
            batch, longest = [], 0
        batch.append(doc)
        longest = max(longest, len(doc.token_ids))
    if batch:
        yield batch


def chunk_keys(fingerprint: str, context: list[tuple[tuple[int, ...], bool]],
               doc: Document) -> list[tuple[tuple[int, int], tuple[bytes, bytes]]]:
    """(token span in the encoded sequence, (prefix key, content key)) of the context's chunks, then the
    document's."""
    keys = keyring.chain(fingerprint, [tokens for tokens, _ in context] + doc.chunk_tokens())
    offset = sum(len(tokens) for tokens, _ in context)
    ends = list(itertools.accumulate(len(tokens) for tokens, _ in context))
    spans = list(zip([0, *ends], ends, strict=False)) + [(offset + c.start, offset + c.end) for c in doc.chunks]
    return list(zip(spans, keys, strict=True))


@torch.inference_mode()
def encode_context(adapter: ModelAdapter, context_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The context's K/V from position 0: [L, H_kv, C, D] each."""
    c = len(context_ids)
    cache = adapter.new_buffers(c)
    adapter.run_layers(adapter.embed(torch.tensor(context_ids)), torch.arange(c), cache, range(adapter.num_layers), c)
    return cache.read(0, c)


@torch.inference_mode()
def encode_after_context(adapter: ModelAdapter, docs: list[Document], context_ids: list[int],
                         context_kv: tuple[torch.Tensor, torch.Tensor] | None) -> list[Encoded]:
    """Each of `docs` after the context whose K/V are `context_kv` (from encode_context; None: no context), all
    in one forward: a row each at the same positions, right-padded, so that causality hides the padding from every
    real token."""
    if not docs:
        return []
    offset, longest = len(context_ids), max(len(doc.token_ids) for doc in docs)
    n = offset + longest
    cache = KVBuffers(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, n, adapter.dtype, adapter.device,
                      batch=len(docs))
    padded = torch.zeros(len(docs), longest, dtype=torch.long)  # [B, S]
    for row, doc in enumerate(docs):
        padded[row, :len(doc.token_ids)] = torch.tensor(doc.token_ids)
    if offset:
        cache.write(0, *context_kv)
    hidden = adapter.embed(padded.flatten()).view(len(docs), longest, -1)  # [B, S, H]
    adapter.run_layers(hidden, torch.arange(offset, n), cache, range(adapter.num_layers), n)
    return [(torch.tensor(context_ids + list(doc.token_ids), dtype=torch.long), functools.partial(cache.read, row=row))
            for row, doc in enumerate(docs)]
