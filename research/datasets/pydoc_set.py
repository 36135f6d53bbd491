"""The bundled real-text set's generator: passages of CPython's documentation.

Real prose cut from CPython's docs (`pydoc_data.topics`, shipped with Python), eight passages an item,
each from a different topic and section, and a question about one of them; for comparing output
distributions against a full prefill. No answers. Items are in the bench's JSONL format
(`kvboost_rag.bench.data`); `research/datasets/shipped.py` rebuilds the bundled
`kvboost_rag/bench/pydoc_k8.jsonl` from it.

Every item is drawn from its own seeded RNG, so the first m items of a set of n are the same items as a
set of m. The set depends on the text of the running Python's docs: the bundled file was cut from
CPython 3.11.7.

    .venv/bin/python research/datasets/pydoc_set.py --n 60 --out out/pydoc.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvboost_rag.bench.data import write_items

PYDOC_SYSTEM = "Answer the question using only the documents."


@dataclass(frozen=True)
class Passage:
    topic: str  # key in pydoc_data.topics.topics
    heading: str  # the section the passage is cut from
    text: str  # the heading, a blank line, then the paragraphs


_UNDERLINE = re.compile(r"([*=\-~^])\1+")
_PIECES = re.compile(r"\w+|[^\w\s]")  # words and symbols: a rough, tokenizer-free token count
_STATEMENT = re.compile(r'The "([^"]+)" statement')
_CLAUSE = re.compile(r'"([^"]+)" clause')
_GENERIC_QUESTIONS = (
    'Based on the documents, explain briefly what the documentation says about "{h}".',
    'Using the documents, summarise in two or three sentences the section "{h}".',
    'According to the documents, what are the main points of the section "{h}"?',
)


def pydoc_items(n: int, k_docs: int = 8, words_per_doc: int = 150, seed: int = 0) -> list[dict]:
    """`n` items of `k_docs` passages of CPython's docs, each from a different topic and section."""
    _check_sizes(n, k_docs, words_per_doc)
    passages = pydoc_passages(words_per_doc)
    # Targets are taken in a seeded order, so no passage is asked about twice until all have been.
    order = list(range(len(passages)))
    random.Random(f"pydoc:{seed}:order").shuffle(order)
    return [_pydoc_item(i, passages, passages[order[i % len(order)]], k_docs, seed) for i in range(n)]


def _pydoc_item(i: int, passages: Sequence[Passage], target: Passage, k: int, seed: int) -> dict:
    rng = random.Random(f"pydoc:{seed}:{i}")
    # Different topics and different sections: several topics repeat one section ("with" and
    # "compound" both hold 'The "with" statement'), and the question must point at one passage.
    topics, headings = {target.topic}, {target.heading.casefold()}
    chosen = []
    for p in rng.sample(passages, len(passages)):
        if len(chosen) == k - 1:
            break
        if p.topic in topics or p.heading.casefold() in headings:
            continue
        chosen.append(p)
        topics.add(p.topic)
        headings.add(p.heading.casefold())
    if len(chosen) < k - 1:
        raise ValueError(f"k_docs={k} is more than the {len(chosen) + 1} distinct topics available")
    pos = _answer_position(seed, i, k)
    chosen.insert(pos, target)
    return {
        "id": f"pydoc{seed}-{i:04d}-{target.topic}",
        "system": PYDOC_SYSTEM,
        "documents": [p.text for p in chosen],
        "question": _pydoc_question(rng, target.heading),
        "answer_doc": pos,
    }


def _pydoc_question(rng: random.Random, heading: str) -> str:
    m = _STATEMENT.fullmatch(heading)
    if m:
        return f"Based on the documents, explain briefly what the `{m.group(1)}` statement does."
    m = _CLAUSE.fullmatch(heading)
    if m:
        return f"Based on the documents, explain briefly what the `{m.group(1)}` clause does."
    return rng.choice(_GENERIC_QUESTIONS).format(h=heading.replace('"', "`"))


@functools.lru_cache(maxsize=4)
def pydoc_passages(words_per_doc: int = 150) -> tuple[Passage, ...]:
    """Every topic cut into passages of about `words_per_doc` words, one section each, no duplicates."""
    from pydoc_data.topics import topics

    passages, seen = [], set()
    for topic in sorted(topics):
        for heading, paragraphs in _sections(topics[topic]):
            for body in _split_section(heading, paragraphs, words_per_doc):
                text = heading + "\n\n" + "\n\n".join(body)
                # Symbol-dense passages (format examples, literal grammars) cost far more tokens than
                # their word count suggests; leaving them out keeps documents near the intended size.
                if len(_PIECES.findall(text)) > 2.5 * words_per_doc:
                    continue
                if text not in seen:
                    seen.add(text)
                    passages.append(Passage(topic, heading, text))
    return tuple(passages)


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading, paragraphs) for each section of a topic; tables and footnotes left out."""
    text = text.split("-[ Footnotes ]-")[0]  # notes cut off from the text they annotate
    lines = [line.rstrip() for line in text.splitlines()]
    sections: list[tuple[str, list[str]]] = []
    block: list[str] = []

    def close_block() -> None:
        if block and sections and not _is_table(block):
            sections[-1][1].append("\n".join(block))
        block.clear()

    underline_at = -1
    for i, line in enumerate(lines):
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if line.strip() and _UNDERLINE.fullmatch(nxt) and len(nxt) == len(line.strip()):
            close_block()
            sections.append((line.strip(), []))
            underline_at = i + 1
        elif i == underline_at:
            continue
        elif not line.strip():
            close_block()
        else:
            block.append(line)
    close_block()
    return sections


def _is_table(block: list[str]) -> bool:
    # Grid tables cost several tokens a word; they would blow the token size a word count implies.
    return sum(line.lstrip().startswith(("+", "|")) for line in block) > len(block) / 2


def _split_section(heading: str, paragraphs: list[str], words: int) -> list[list[str]]:
    """Paragraphs grouped into passages near `words` long; a section too short for one is dropped."""
    pieces = [p for para in paragraphs for p in _split_long(para, words)]
    total = _count_words(heading) + sum(_count_words(p) for p in pieces)
    if total < words / 2:
        return []
    parts = max(1, round(total / words))
    size = total / parts
    groups: list[list[str]] = [[]]
    filled = _count_words(heading)
    for piece in pieces:
        w = _count_words(piece)
        if groups[-1] and len(groups) < parts and filled + w / 2 > size:
            groups.append([])
            filled = _count_words(heading)
        groups[-1].append(piece)
        filled += w
    return [g for g in groups if _count_words(heading) + sum(_count_words(p) for p in g) >= words / 2]


def _split_long(paragraph: str, words: int) -> list[str]:
    # A long code block or list has no blank lines to cut at; cut it between lines instead.
    if _count_words(paragraph) <= 1.5 * words:
        return [paragraph]
    pieces, current, count = [], [], 0
    for line in paragraph.splitlines():
        if current and count + _count_words(line) > words:
            pieces.append("\n".join(current))
            current, count = [], 0
        current.append(line)
        count += _count_words(line)
    if current:
        pieces.append("\n".join(current))
    return pieces



def _answer_position(seed: int, i: int, k: int) -> int:
    # As in the synthetic set: each run of k consecutive items puts the answer once in every position.
    positions = list(range(k))
    random.Random(f"pydoc:{seed}:positions:{i // k}").shuffle(positions)
    return positions[i % k]


def _count_words(text: str) -> int:
    return len(text.split())


def _check_sizes(n: int, k_docs: int, words_per_doc: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if k_docs < 1:
        raise ValueError(f"k_docs must be >= 1, got {k_docs}")
    if words_per_doc < 1:
        raise ValueError(f"words_per_doc must be >= 1, got {words_per_doc}")


# ---------------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100, help="number of items")
    parser.add_argument("--k", type=int, default=8, help="documents per item")
    parser.add_argument("--words", type=int, default=150, help="about this many words per document")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="output file (default: stdout)")
    args = parser.parse_args(argv)

    items = pydoc_items(args.n, args.k, args.words, args.seed)
    if args.out is None:
        for item in items:
            sys.stdout.write(json.dumps(item, ensure_ascii=False) + "\n")
    else:
        write_items(items, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
