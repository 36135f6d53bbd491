"""Where an ingested document's own tokens lie in a prompt's tokens, seams tolerated (issue 39).

A prompt is tokenized whole, so every strategy sees exactly the tokenizer's tokens. A document found in the
prompt's text is then used over the runs of its own tokens that the prompt's tokens reproduce. At its edges
they often differ: byte-level BPE (Llama 3, Qwen, SmolLM3) fuses a closing '.' with the blank line after it
('.ĊĊ') and an opening word with the character before it ('>The', 'ĠThe'); Gemma fuses '.' with a closing tag
('.</'); SentencePiece (Llama 2, Mistral, Phi-3) gives a document tokenized alone a leading '▁' it has not in a
prompt. Those seam tokens are computed, as fixed text is; the rest keep their stored KV.

A document token is matched only where the prompt has a token with the same id starting at the same character
of the document's text, and a run extends only over equal ids: what is placed over a prompt token is always KV
computed for that very token, at that place in the same document.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from .store.documents import Document

# A run shorter than this between two mismatches is computed: a handful of tokens is not worth a stored piece.
MIN_RUN = 4


@dataclass(frozen=True)
class Run:
    """Prompt tokens [first, first + length) are the document's tokens [doc_start, doc_start + length)."""

    first: int
    doc_start: int
    length: int


@dataclass(frozen=True)
class Match:
    """A document found in the prompt's text at character `char_start`, and the runs of its tokens used there."""

    document: Document
    char_start: int
    runs: tuple[Run, ...]

    @property
    def reused(self) -> int:
        return sum(run.length for run in self.runs)

    @property
    def lost(self) -> int:
        """The document's tokens not used here (seam tokens, or all of them when nothing matched)."""
        return len(self.document.token_ids) - self.reused


def match_document(document: Document, char_start: int, ids: tuple[int, ...], token_at_start: Mapping[int, int],
                   tokenizer) -> Match:
    """The runs of `document`'s tokens that the prompt's tokens `ids` reproduce, its text starting at prompt
    character `char_start`; `token_at_start` maps a character to the prompt token that starts there."""
    doc_ids, n = document.token_ids, len(document.token_ids)
    first = token_at_start.get(char_start)
    if first is not None and ids[first:first + n] == doc_ids:  # no seam: the common case, one comparison
        return Match(document, char_start, (Run(first, 0, n),))
    starts = token_starts(tokenizer, document.text)
    runs, k = [], 0
    while k < n:
        j = token_at_start.get(char_start + starts[k])
        if j is None or ids[j] != doc_ids[k]:
            k += 1
            continue
        length = _common_length(ids, j, doc_ids, k)
        if length >= MIN_RUN or length == n:
            runs.append(Run(j, k, length))
        k += length
    return Match(document, char_start, tuple(runs))


def _common_length(ids: tuple[int, ...], j: int, doc_ids: tuple[int, ...], k: int) -> int:
    """How many tokens from ids[j] on equal doc_ids[k:]: the whole rest, or all but a trailing seam, by one
    tuple comparison each; token by token only past an inner mismatch (which the tokenizers above never make)."""
    rest = len(doc_ids) - k
    for length in (rest, rest - 1):
        if length > 0 and ids[j:j + length] == doc_ids[k:k + length]:
            return length
    length = 1
    while length < rest and j + length < len(ids) and ids[j + length] == doc_ids[k + length]:
        length += 1
    return length


@functools.lru_cache(maxsize=4096)
def token_starts(tokenizer, text: str) -> tuple[int, ...]:
    """The character at which each of `text`'s own tokens starts; only a document with a seam needs them,
    once per process (documents are stored with their token ids, not their offsets)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return tuple(start for start, _ in enc["offset_mapping"])


def seam_text(match: Match, ids: tuple[int, ...], tokenizer, width: int = 2) -> str:
    """The prompt's tokens against the document's own at its first lost edge, for a warning:
    "prompt ['Ġhall', '.ĊĊ'] / document ['Ġhall', '.']"."""
    doc_ids = match.document.token_ids
    if not match.runs:
        return f"document starts {tokenizer.convert_ids_to_tokens(list(doc_ids[:width]))}, no run of its tokens found"
    head, tail = match.runs[0], match.runs[-1]
    if head.doc_start > 0:  # a leading seam
        prompt_side = ids[max(0, head.first - width):head.first + 1]
        doc_side = doc_ids[:head.doc_start + 1]
    else:
        end, doc_end = tail.first + tail.length, tail.doc_start + tail.length
        prompt_side, doc_side = ids[end - 1:end + width], doc_ids[doc_end - 1:doc_end + width]
    return (f"prompt {tokenizer.convert_ids_to_tokens(list(prompt_side))} / "
            f"document {tokenizer.convert_ids_to_tokens(list(doc_side))}")


def warn_lost(matches: list[Match], ids: tuple[int, ...], tokenizer, warned: set[str]) -> None:
    """Once per document (its id kept in `warned`): it was found in a prompt's text, but more of its tokens than
    one seam token at each edge could not be reused there (the request's figures count every lost token).
    `ids`: the prompt's own tokens, which the matches' runs index."""
    for found in matches:
        if found.lost <= 2 or found.document.doc_id in warned:
            continue
        warned.add(found.document.doc_id)
        doc = found.document
        warnings.warn(f"kvboost-rag: document {doc.doc_id[:12]} ({doc.text[:40]!r}...) is in the prompt, but "
                      f"{found.lost} of its {len(doc.token_ids)} tokens could not be reused: the prompt's tokens there "
                      f"are not its own ({seam_text(found, ids, tokenizer)}). Those tokens are computed: the answer is "
                      "unchanged, its first token later.", stacklevel=5)
