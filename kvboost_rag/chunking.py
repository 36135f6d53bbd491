"""Split a document into chunks of at most `max_chunk_tokens` at natural boundaries.

The document is tokenized once, as a whole, and chunks are ranges of those token ids. So the
tokens of a cached document are exactly the tokens it has inside any prompt: no re-tokenization
at a chunk boundary can change them. Cut points are preferred in this order: paragraph start,
sentence start, word start, anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Boundary strength of a cut *before* a token, judged from the text that precedes the token.
_PARAGRAPH, _SENTENCE, _WORD, _ANY = 3, 2, 1, 0
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s*$")


@dataclass(frozen=True)
class Chunk:
    start: int  # token index inside the document
    end: int


def boundary_strengths(text: str, offsets: list[tuple[int, int]]) -> list[int]:
    """Strength of cutting before each token, from the character offsets of the tokens."""
    strengths = []
    for start, _ in offsets:
        head, starts_with_space = text[max(0, start - 16):start], text[start:start + 1].isspace()
        if head.endswith("\n\n"):
            strengths.append(_PARAGRAPH)
        elif _SENTENCE_END.search(head) and (starts_with_space or head[-1:].isspace()):
            strengths.append(_SENTENCE)
        elif starts_with_space or head[-1:].isspace():
            strengths.append(_WORD)
        else:
            strengths.append(_ANY)
    return strengths


def split_tokens(strengths: list[int], max_chunk_tokens: int) -> list[Chunk]:
    """Greedy: each chunk ends at the strongest boundary within reach, the latest of those."""
    if max_chunk_tokens < 1:
        raise ValueError("max_chunk_tokens must be at least 1")
    n, chunks, start = len(strengths), [], 0
    while n - start > max_chunk_tokens:
        window = range(start + 1, start + max_chunk_tokens + 1)  # candidate cut positions
        best = max(window, key=lambda i: (strengths[i] if i < n else _PARAGRAPH, i))
        chunks.append(Chunk(start, best))
        start = best
    chunks.append(Chunk(start, n))
    return chunks


def chunk_document(text: str, tokenizer, max_chunk_tokens: int) -> tuple[list[int], list[Chunk]]:
    """Token ids of the whole document and its chunks (token ranges)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    return ids, split_tokens(boundary_strengths(text, offsets), max_chunk_tokens)
