"""Benchmark items: the JSONL format, its loader, and the bundled sets.

One JSON object a line:

    {"id": str, "system": str (optional), "documents": [str, ...], "question": str,
     "answers": [str, ...] (optional), "answer_doc": int (optional)}

The prompt is the chat template with `system`, then the documents in order, then the question, in one
user message. `answer_doc` is the index of the document that holds the answer.

The bundled sets (`bundled(name)`): `synthetic_k8` (432 items) and `synthetic_calib` (50), questions about
invented entities among look-alike documents, with exact answers; `tiny` (3 items of 3 short documents);
`pydoc_k8` (60 items of CPython documentation passages, no answers). Their generators are research code,
not part of the package: `research/datasets/` (`shipped.py` rebuilds these files byte for byte).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent

_KEYS = {"id", "system", "documents", "question", "answers", "answer_doc"}


# ---------------------------------------------------------------------------------------------------
# Reading and writing


@dataclass(frozen=True)
class BenchItem:
    id: str
    documents: tuple[str, ...]
    question: str
    system: str | None = None
    answers: tuple[str, ...] = ()
    answer_doc: int | None = None


def load_items(path: str | Path, limit: int | None = None) -> list[BenchItem]:
    """Read and check a JSONL benchmark file; the first `limit` items when given.

    Raises ValueError naming the file, the line and what is wrong with it. Blank lines are skipped.
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    items: list[BenchItem] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                item = _parse_item(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            if item.id in seen:
                raise ValueError(f"{path}:{lineno}: duplicate id {item.id!r} (first on line {seen[item.id]})")
            seen[item.id] = lineno
            items.append(item)
    if not items and limit != 0:
        raise ValueError(f"{path}: no items")
    return items


def in_orders(items: Iterable[BenchItem], orders: int, seed: int = 0) -> list[BenchItem]:
    """Each item asked over its documents in `orders` orders: the file's, then seeded shuffles (fewer when the
    documents have fewer orders), each an item of its own, id "ID@2.0.1". A retriever returns documents in any
    order, and the file's one order per item can be kinder to a reused cache than the rest (docs/load_test.md)."""
    if orders < 1:
        raise ValueError(f"orders must be >= 1, got {orders}")
    rng = random.Random(seed)
    asked = []
    for item in items:
        seen = document_orders(len(item.documents), orders, rng)
        for order in seen:
            answer_doc = None if item.answer_doc is None else order.index(item.answer_doc)
            asked.append(replace(item, id=item.id if order == seen[0] else f"{item.id}@{'.'.join(map(str, order))}",
                                 documents=tuple(item.documents[i] for i in order), answer_doc=answer_doc))
    return asked


def document_orders(n: int, orders: int, rng: random.Random) -> list[tuple[int, ...]]:
    """Up to `orders` distinct orders of n documents drawn from `rng`: the given order first, then shuffles."""
    seen = [tuple(range(n))]
    for _ in range(20 * orders):  # 2 documents have only 2 orders: stop looking for a third
        if len(seen) == orders:
            break
        order = tuple(rng.sample(range(n), n))
        if order not in seen:
            seen.append(order)
    return seen


def _parse_item(line: str) -> BenchItem:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    # Unknown keys are refused: a misspelt "answers" would otherwise silently turn off scoring.
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; allowed: {sorted(_KEYS)}")

    item_id = _text(obj, "id")
    question = _text(obj, "question")
    system = _text(obj, "system") if "system" in obj else None

    docs = obj.get("documents")
    if not isinstance(docs, list):
        raise ValueError(f"'documents' must be a list of strings, got {_kind(docs)}")
    if not docs:
        raise ValueError("'documents' is empty")
    for i, doc in enumerate(docs):
        if not isinstance(doc, str) or not doc.strip():
            raise ValueError(f"documents[{i}] must be a non-empty string, got {_kind(doc)}")

    answers: tuple[str, ...] = ()
    if "answers" in obj:
        raw = obj["answers"]
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"'answers' must be a non-empty list of strings, got {_kind(raw)}")
        for i, a in enumerate(raw):
            if not isinstance(a, str) or not a.strip():
                raise ValueError(f"answers[{i}] must be a non-empty string, got {_kind(a)}")
        answers = tuple(raw)

    answer_doc = obj.get("answer_doc")
    if answer_doc is not None and (
        isinstance(answer_doc, bool) or not isinstance(answer_doc, int) or not 0 <= answer_doc < len(docs)
    ):
        raise ValueError(f"'answer_doc' must be an index into documents (0..{len(docs) - 1}), "
                         f"got {answer_doc!r}")

    return BenchItem(item_id, tuple(docs), question, system, answers, answer_doc)


def _text(obj: dict, key: str) -> str:
    if key not in obj:
        raise ValueError(f"missing '{key}'")
    value = obj[key]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"'{key}' must be a non-empty string, got {_kind(value)}")
    return value


def _kind(value: object) -> str:
    if isinstance(value, str):
        return "an empty string" if not value.strip() else "a string"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    return "null" if value is None else type(value).__name__


def write_items(items: Iterable[dict], path: str | Path) -> None:
    """Write items (dicts in the format above) one JSON object a line, as the bundled files are written."""
    with Path(path).open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------------
# Bundled files


def bundled(name: str) -> Path:
    """Path of a bundled data file, by name: bundled("synthetic_k8")."""
    stem = name.removesuffix(".jsonl")
    path = BENCH_DIR / f"{stem}.jsonl"
    if not path.is_file():
        available = sorted(p.stem for p in BENCH_DIR.glob("*.jsonl"))
        raise ValueError(f"no bundled benchmark file {name!r}; available: {', '.join(available) or 'none'}")
    return path
