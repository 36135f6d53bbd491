"""Ingested documents, and finding them inside a rendered prompt by exact text span.

Frameworks (LangChain stuff chains, LlamaIndex synthesizers) hand us one flat prompt string. Each
ingested document is found in it by its exact text, so its cached KV can be used wherever the
retriever put it. Lookup is by the document's first `ANCHOR` characters: one dict probe per prompt
character, then a full comparison, so it costs microseconds per kilobyte of prompt whatever the
size of the corpus.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .chunking import Chunk

ANCHOR = 32


@dataclass(frozen=True)
class Document:
    doc_id: str  # hex content key of the whole document's tokens
    text: str
    token_ids: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    def chunk_tokens(self) -> list[tuple[int, ...]]:
        return [self.token_ids[c.start:c.end] for c in self.chunks]


@dataclass(frozen=True)
class Span:
    start: int  # character offsets in the prompt
    end: int
    document: Document


class DocumentIndex:
    """Thread-safe registry of ingested documents; persisted as JSON lines when given a file."""

    def __init__(self, path: Path | None = None):
        self._by_text: dict[str, Document] = {}
        self._by_anchor: dict[str, list[Document]] = {}
        self._short: list[Document] = []
        self._lock = threading.Lock()
        self._path = path
        if path is not None and path.exists():
            self._load(path)

    def __len__(self) -> int:
        return len(self._by_text)

    def texts(self) -> list[str]:
        """Every indexed document's text, in the order they were added."""
        return list(self._by_text)

    def get(self, text: str) -> Document | None:
        return self._by_text.get(text)

    def add(self, doc: Document) -> None:
        with self._lock:
            if doc.text in self._by_text:
                return
            self._insert(doc)
            if self._path is not None:
                record = {"doc_id": doc.doc_id, "text": doc.text, "token_ids": list(doc.token_ids),
                          "chunks": [[c.start, c.end] for c in doc.chunks]}
                self._path.parent.mkdir(parents=True, exist_ok=True)
                with open(self._path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    os.fsync(f.fileno())

    def _insert(self, doc: Document) -> None:
        self._by_text[doc.text] = doc
        if len(doc.text) >= ANCHOR:
            self._by_anchor.setdefault(doc.text[:ANCHOR], []).append(doc)
        else:
            self._short.append(doc)

    def _load(self, path: Path) -> None:
        import warnings

        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    r = json.loads(line)
                    doc = Document(r["doc_id"], r["text"], tuple(r["token_ids"]),
                                   tuple(Chunk(a, b) for a, b in r["chunks"]))
                except (ValueError, KeyError, TypeError):
                    # A torn last line from a killed writer: that document is simply re-ingested.
                    warnings.warn(f"{path}:{lineno}: unreadable document record skipped", stacklevel=2)
                    continue
                self._insert(doc)

    def find(self, prompt: str) -> list[Span]:
        """Non-overlapping spans of ingested documents in `prompt`, left to right, longest first."""
        candidates: list[Span] = []
        anchors = self._by_anchor
        for i in range(len(prompt) - ANCHOR + 1):
            docs = anchors.get(prompt[i:i + ANCHOR])
            if docs:
                for doc in docs:
                    if prompt.startswith(doc.text, i):
                        candidates.append(Span(i, i + len(doc.text), doc))
        for doc in self._short:
            start = prompt.find(doc.text)
            while start != -1:
                candidates.append(Span(start, start + len(doc.text), doc))
                start = prompt.find(doc.text, start + 1)
        candidates.sort(key=lambda s: (s.start, -(s.end - s.start)))
        spans, reach = [], 0
        for span in candidates:
            if span.start >= reach:
                spans.append(span)
                reach = span.end
        return spans
