"""From a prompt to a plan (which KV comes from where) and an assembled cache.

A prompt is a sequence of segments: fixed text (template, system prompt, question) and ingested
documents. Each segment is tokenized on its own, so a document's tokens in the prompt are exactly
its cached tokens, and cut into chunks. Every chunk is then one of:

- exact:   its prefix key is stored, and everything before it is exact. Reused as it is.
- approx:  a document chunk whose tokens are stored from another context (content key). Its keys
           are re-rotated to their new positions; the repair strategy decides what to recompute.
- compute: nothing usable is stored; computed in the prefill.

`exact` propagates: once an approximate chunk appears, nothing after it can be exact.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import keys as keyring
from .adapter import ModelAdapter
from .drift import DriftMaps, place
from .kvcache import KVBuffers
from .matching import Match, match_document
from .store.base import KVEntry, KVStore
from .store.documents import Document, DocumentIndex

EXACT, APPROX, COMPUTE = "exact", "approx", "compute"


@dataclass
class PlannedChunk:
    start: int  # position of the first token in the prompt
    token_ids: tuple[int, ...]
    is_document: bool
    prefix_key: bytes
    content_key: bytes
    source: str = COMPUTE
    entry: KVEntry | None = None
    # True when this chunk's KV, once computed, equals a full prefill's (all before it is exact).
    exact_context: bool = True

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class Plan:
    token_ids: torch.Tensor  # [N] long
    chunks: list[PlannedChunk] = field(default_factory=list)
    document_tokens: int = 0  # the own tokens of the ingested documents found in the prompt's text
    # The prompt's text: fixed text and the documents used, in order (TokenizedPrompt.segments); what a shadow check
    # lays out again in another order for the order floor (shadow.py)
    segments: list[str | Document] = field(default_factory=list)

    @property
    def document_tokens_reused(self) -> int:
        """Prompt tokens of those documents whose KV comes from the store (before any repair recomputes some)."""
        return sum(len(c.token_ids) for c in self.chunks if c.is_document and c.source != COMPUTE)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def positions(self, source: str) -> torch.Tensor:
        spans = [torch.arange(c.start, c.end) for c in self.chunks if c.source == source]
        return torch.cat(spans) if spans else torch.empty(0, dtype=torch.long)

    def computed_positions(self) -> torch.Tensor:
        """The positions every strategy runs through every layer: those with nothing stored, and the
        last one (its output is the next-token logits). [P] sorted."""
        return torch.unique(torch.cat([self.positions(COMPUTE), torch.tensor([self.num_tokens - 1])]))

    def count(self, source: str) -> int:
        return sum(len(c.token_ids) for c in self.chunks if c.source == source)


@dataclass(frozen=True)
class TokenizedPrompt:
    """A rendered prompt as the model's tokenizer cuts it, with the ingested documents found in it."""

    chunks: list[tuple[tuple[int, ...], bool]]  # (token ids, is_document) in order, as `plan` takes them
    segments: list[str | Document]  # the prompt's text: fixed text and the documents used, in order
    # A document piece cut at a seam: chunk index -> (the stored chunk's tokens, where the piece starts in them)
    sources: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    matches: list[Match] = field(default_factory=list)  # every document found in the text, used or not
    prompt_ids: tuple[int, ...] = ()  # the tokenizer's tokens of the prompt text, which the matches' runs index

    @property
    def document_tokens(self) -> int:
        """The own tokens of the documents found in the prompt's text."""
        return sum(len(m.document.token_ids) for m in self.matches)


# A document is looked for where a prompt token starts, or this many characters into one: the character
# before it that a tokenizer fused with its first word ('>The', 'ĠThe', ':ĊThe').
LEADING_SEAM_CHARS = 2


def tokenize_prompt(prompt: str, index: DocumentIndex, tokenizer, max_chunk_tokens: int,
                    bos_ids: tuple[int, ...] = (), special_ids: frozenset[int] = frozenset()) -> TokenizedPrompt:
    """The prompt's chunks, its token ids exactly those the tokenizer gives for the whole prompt.

    The prompt is tokenized once, whole. A document found in its text is used over the runs of its own tokens
    that the prompt's tokens reproduce, at the same characters (see matching.py): its seam tokens, fused with
    the text around it, are computed as fixed text is, and "cat" inside "concatenation" stays text. So every
    strategy, `full` included, sees the tokens a plain tokenizer call gives, and a stored chunk (or a piece of
    one) is only ever placed over the very tokens it was computed for."""
    enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = tuple(enc["input_ids"]), enc["offset_mapping"]
    # Characters -> token starts. A character split over several byte tokens gives them one span: its first
    # token starts it.
    token_at_start: dict[int, int] = {}
    look_at: set[int] = set()
    for i, (a, b) in enumerate(offsets):
        if b > a:
            token_at_start.setdefault(a, i)
            look_at.update(range(a, min(b, a + 1 + LEADING_SEAM_CHARS)))
    matches: list[Match] = []
    segments: list[str | Document] = []
    cursor = 0
    for span in index.find(prompt, starts=look_at):
        found = match_document(span.document, span.start, ids, token_at_start, tokenizer)
        matches.append(found)
        if not found.runs:
            continue
        if span.start > cursor:
            segments.append(prompt[cursor:span.start])
        segments.append(span.document)
        cursor = span.end
    if cursor < len(prompt):
        segments.append(prompt[cursor:])

    shift = 0
    if ids[:len(bos_ids)] != bos_ids:
        ids, shift = bos_ids + ids, len(bos_ids)
    chunks: list[tuple[tuple[int, ...], bool]] = []
    sources: dict[int, tuple[tuple[int, ...], int]] = {}
    at = 0
    for found in matches:
        doc_ids = found.document.token_ids
        for run in found.runs:
            chunks += _text_chunks(ids[at:run.first + shift], max_chunk_tokens, special_ids)
            lo, hi = run.doc_start, run.doc_start + run.length
            for piece in found.document.chunks:
                a, b = max(piece.start, lo), min(piece.end, hi)
                if a >= b:
                    continue
                if (a, b) != (piece.start, piece.end):  # cut at a seam: found through the chunk it is part of
                    sources[len(chunks)] = (doc_ids[piece.start:piece.end], a - piece.start)
                chunks.append((doc_ids[a:b], True))
            at = run.first + run.length + shift
    chunks += _text_chunks(ids[at:], max_chunk_tokens, special_ids)
    return TokenizedPrompt(chunks, segments, sources, matches, ids[shift:])


def _text_chunks(ids: tuple[int, ...], max_chunk_tokens: int,
                 special_ids: frozenset[int]) -> list[tuple[tuple[int, ...], bool]]:
    """Fixed text cut before every special token (a chat turn's start or end), so that a prompt extended by
    a new turn shares all of its earlier turns' chunks with the prompt before it, and into pieces of at
    most `max_chunk_tokens`."""
    chunks, start = [], 0
    for cut in [j for j, t in enumerate(ids) if j > 0 and t in special_ids] + [len(ids)]:
        chunks += [(ids[j:min(j + max_chunk_tokens, cut)], False) for j in range(start, cut, max_chunk_tokens)]
        start = cut
    return chunks


# doc_context "passage": what a document is encoded after, so that its KV looks like a later document's.
# Written for kvboost-rag: neutral prose with no entity, number or name a question could ask about.
CONTEXT_PASSAGE = ("The notes below were gathered from several sources and arranged for easy reading. Each part "
                   "describes one subject on its own, in plain language, and the parts may be read in any order. "
                   "Some details were checked against older records, while others come from people who knew the "
                   "subject well. Where sources disagreed, the more recent account was kept. Small changes to "
                   "spelling and wording were made so that the parts read alike.")


def ingestion_context(doc_context: str, render, tokenizer, max_chunk_tokens: int, bos_ids: tuple[int, ...],
                      special_ids: frozenset[int]) -> list[tuple[tuple[int, ...], bool]]:
    """The chunks a document is encoded after at ingestion (ChunkingConfig.doc_context), tokenized as a prompt
    holding them would be; `render` is the engine's (chat messages -> text)."""
    if doc_context == "none":
        return []
    marker = "\x00kvboost-doc\x00"
    try:
        rendered = render([{"role": "user", "content": marker}])
        opening = rendered[: rendered.index(marker)]
    except ValueError:
        opening = ""  # no chat template: nothing to encode after, or the passage alone (after BOS)
    if doc_context == "template" and not opening:
        return []
    segments = [opening] if opening else []
    if doc_context == "passage":
        segments += [CONTEXT_PASSAGE, "\n\n"]  # each its own chunk, as a prompt's documents and separators
    # Followed by a word, as a document follows them in a prompt (its text is stripped: no space first).
    return tokenize_context(segments, "Document", tokenizer, max_chunk_tokens, bos_ids, special_ids)


def tokenize_context(texts: list[str], follower: str, tokenizer, max_chunk_tokens: int,
                     bos_ids: tuple[int, ...] = (), special_ids: frozenset[int] = frozenset()
                     ) -> list[tuple[tuple[int, ...], bool]]:
    """Chunks of the texts a document is encoded after at ingestion, each text its own chunks, tokenized as
    one prompt in which `follower` (a document's start) comes next. So the seams are tokenized as a prompt
    tokenizes them: a blank line before a document is two newline tokens there, not the one token it is
    at the end of a text."""
    joined = "".join(texts)
    enc = tokenizer(joined + follower, add_special_tokens=False, return_offsets_mapping=True)
    ends = list(itertools.accumulate(len(text) for text in texts))
    parts: list[list[int]] = [[] for _ in texts]
    for token, (start, _) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        if start >= len(joined):
            break
        parts[bisect.bisect_right(ends, start)].append(token)
    if parts and tuple(parts[0][:len(bos_ids)]) != bos_ids:
        parts[0][:0] = bos_ids
    return [chunk for part in parts for chunk in _text_chunks(tuple(part), max_chunk_tokens, special_ids)]


def segments_text(segments: list[str | Document]) -> str:
    """The prompt text of `segments` (after reordering them, say)."""
    return "".join(seg if isinstance(seg, str) else seg.text for seg in segments)


def plan(chunks: list[tuple[tuple[int, ...], bool]], fingerprint: str, store: KVStore | None,
         use_exact: bool, use_approx: bool,
         sources: dict[int, tuple[tuple[int, ...], int]] | None = None, document_tokens: int = 0,
         segments: Sequence[str | Document] = ()) -> Plan:
    """Where each chunk's KV comes from. `sources` (TokenizedPrompt.sources): a document piece cut at a seam is
    looked up through the whole stored chunk it is part of, and served as that entry's slice."""
    keys = keyring.chain(fingerprint, [tokens for tokens, _ in chunks])
    sources = sources or {}
    planned, position, exact_so_far = [], 0, True
    for i, ((tokens, is_doc), (pkey, ckey)) in enumerate(zip(chunks, keys, strict=True)):
        chunk = PlannedChunk(position, tokens, is_doc, pkey, ckey, exact_context=exact_so_far)
        entry = store.get(pkey) if (store is not None and use_exact and exact_so_far) else None
        if entry is not None and entry.token_ids == tokens and entry.start == position:
            chunk.source, chunk.entry = EXACT, entry
        elif store is not None and use_approx and is_doc:
            entry = _stored_piece(store, fingerprint, tokens, ckey, sources.get(i))
            if entry is not None:
                chunk.source, chunk.entry = APPROX, entry
                exact_so_far = False
        planned.append(chunk)
        position += len(tokens)
    ids = torch.tensor([t for tokens, _ in chunks for t in tokens], dtype=torch.long)
    return Plan(ids, planned, document_tokens, list(segments))


def _stored_piece(store: KVStore, fingerprint: str, tokens: tuple[int, ...], content_key: bytes,
                  source: tuple[tuple[int, ...], int] | None) -> KVEntry | None:
    """The stored KV of a document chunk's `tokens` computed in another context: the entry of those tokens, or
    the slice of the whole chunk's entry (`source`: its tokens, the piece's offset) for a piece cut at a seam."""
    if source is None:
        entry = store.find_content(content_key)
        return entry if entry is not None and entry.token_ids == tokens else None
    whole, offset = source
    entry = store.find_content(keyring.content_key(fingerprint, whole))
    if entry is None or entry.token_ids[offset:offset + len(tokens)] != tokens:
        return None
    return entry.slice(offset, len(tokens))


def assemble(plan: Plan, adapter: ModelAdapter, capacity: int, drift: DriftMaps | None = None) -> KVBuffers:
    """Buffers holding every stored chunk's KV at its place (keys re-rotated where it moved), the reused
    documents' K/V mapped by `drift` when given (see drift.py; exact hits are served as they are)."""
    cache = adapter.new_buffers(capacity)
    reused = 0
    for chunk in plan.chunks:
        if chunk.entry is None:
            continue
        if chunk.source == APPROX and drift is not None:
            place(adapter, cache, chunk.entry, chunk.start, drift, reused)
            reused += 1
        else:  # stored in host memory: moved to the model's device (a no-op on the CPU), then rotated there
            keys, values = cache.span(chunk.start, chunk.end)  # views to write into: [L, H_kv, S, D]
            adapter.rotate_keys(chunk.entry.keys.to(adapter.device, non_blocking=True), chunk.start - chunk.entry.start,
                                out=keys)
            values.copy_(chunk.entry.values.to(adapter.device, non_blocking=True))
    return cache
