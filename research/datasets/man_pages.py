"""A held-out multi-document QA set of real text the model can read: the system's own manual pages.

Why another set of real text: on every set here the bundled model answers few questions right under a full prefill
(0.09-0.42), so "items lost against full minus items won" has little to lose; a rule on accuracy is tested only where
the model answers. Manual pages are short, regular and written by many hands (help2man's option lists, hand-written
roff, BSD-style pages): the kind of reference text a RAG application over internal docs retrieves. Questions are
lookups a small model can make: which option of a command does what a page says (answered with the long option),
the long form of a short option, which command a page's NAME line describes (answered with the command), who wrote a
command (its AUTHOR section).

Documents are pages of sections 1 and 8 (gcloud's ~16k generated pages left out) as `man` renders them in ASCII at
76 columns (no headers or footers, dedented), cut at a line end to 80-320 tokens: the NAME line, the synopsis and the
start of the description and options, with the AUTHOR section at the end of half the pages and of every asked page
of an author question. Items have 4 to 8 pages: in half, pages of the same source (the .TH line's
fourth field: "GNU coreutils 9.1", "util-linux 2.38.1", ...) so they look alike; in the rest, drawn at random. The
answer occurs (case-insensitively) in its own page and in no other page of the item, and no other option or command
name of the item contains it, so containment scoring credits neither a distractor nor a longer option.

The pages are what this machine has installed (Debian 12's man-db), so the file is the set; the test checks its
rules. Nothing may be tuned, fitted or calibrated on it.

    .venv/bin/python research/datasets/man_pages.py --out research/data/man_pages.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from package_pages import item_row, write_set  # noqa: E402  (a sibling script, not a package)

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "research" / "data" / "man_pages.jsonl"
MAN = Path("/usr/share/man")
N_ITEMS = 64
SEED = 2861
CANDIDATES = 900  # pages rendered (rendering all ~18k takes half an hour)
MIN_DOCS, MAX_DOCS = 4, 8
DOC_TOKENS = (80, 320)
USER_TOKENS = (600, 1900)  # the user message; the chat template and system text add ~40
QTYPES = ("option", "long", "reverse", "author")
SYSTEMS = (
    "You are given manual pages. Answer with the exact option, command or name from them.",
    "Use only the manual pages below. Reply with the answer alone.",
    "Answer briefly from the documentation provided.",
    None,
)
# An option line as man renders it (dedented): "-n, --number", "--help", "-o, --output=FILE", then its text on the
# same line after two or more spaces, or on the next, indented.
OPTION = re.compile(r"^(?:(-[A-Za-z0-9]),\s+)?(--[a-z][a-z0-9-]+)(?:[= ]\S+)?(?:\s{2,}(\S.*))?$")
NAME = r"[A-Z][\w.'-]+(?:\s+[A-Z][\w.'-]+){1,3}"  # a person's name: two to four capitalized words


@dataclass(frozen=True)
class Option:
    short: str | None
    long: str
    text: str  # the first line of its description


@dataclass(frozen=True)
class Page:
    command: str
    source: str  # the .TH line's fourth field: which package wrote it
    summary: str  # the NAME line after the dash
    lines: tuple[str, ...]  # the rendered page, dedented, without its AUTHOR section
    author: tuple[str, ...]  # the AUTHOR section's lines, heading included; () if none
    options: tuple[Option, ...]

    def fact(self, qtype: str, rng: random.Random) -> tuple[str, str] | None:
        """(answer, what the question needs: an option's text, a short option, a summary, nothing) or None."""
        usable = [o for o in self.options if len(o.long) >= 6 and 12 <= len(o.text) <= 90 and o.long not in
                  ("--help", "--version") and sum(o.long in p.long for p in self.options) == 1]
        if qtype == "option" and usable:
            o = rng.choice(usable)
            return o.long, o.text.rstrip(".")
        if qtype == "long" and (shorts := [o for o in usable if o.short]):
            o = rng.choice(shorts)
            return o.long, o.short
        if qtype == "reverse" and len(self.command) >= 4 and 20 <= len(self.summary) <= 100 \
                and self.command.casefold() not in self.summary.casefold():
            return self.command, self.summary
        if qtype == "author" and self.author:
            text = " ".join(" ".join(self.author[1:]).split())
            m = re.search(rf"(?:[Ww]ritten|[Cc]reated|[Dd]eveloped|[Mm]aintained)\s+by\s+({NAME})", text) \
                or re.match(rf"({NAME})\s*[<(,]", text)
            if m and 5 <= len(m.group(1)) <= 40:
                return m.group(1).rstrip("."), ""
        return None


def render(path: Path) -> str | None:
    env = {**os.environ, "MANWIDTH": "76", "LC_ALL": "C.UTF-8"}
    try:
        out = subprocess.run(["man", "--nh", "--nj", "-E", "ascii", "-P", "cat", "-l", str(path)], env=env,
                             capture_output=True, timeout=20).stdout
        return subprocess.run(["col", "-bx"], input=out, capture_output=True, timeout=20).stdout.decode("utf-8")
    except (subprocess.TimeoutExpired, UnicodeDecodeError):
        return None


def source_of(path: Path) -> str:
    """The .TH line's fourth field (the package), "" if none."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(".TH"):
                fields = re.findall(r'"[^"]*"|\S+', line)
                return fields[4].strip('"') if len(fields) > 4 else ""
    return ""


def parse(path: Path, text: str) -> Page | None:
    lines = text.rstrip().split("\n")[1:-1]  # the header and footer lines name the page, not its text
    lines = [(ln[7:] if ln.startswith(" " * 7) else ln).rstrip() for ln in lines]
    while lines and not lines[0].strip():
        lines.pop(0)
    if not lines or lines[0] != "NAME" or len(lines) < 3:
        return None
    name = " ".join(lines[1].split())
    if " - " not in name:
        return None
    command, summary = (s.strip() for s in name.split(" - ", 1))
    if "," in command or " " in command:
        return None
    heads = [i for i, ln in enumerate(lines) if ln and not ln[0].isspace() and ln.isupper()]
    author_at = next((i for i in heads if lines[i] in ("AUTHOR", "AUTHORS")), None)
    author: tuple[str, ...] = ()
    if author_at is not None:
        end = next((i for i in heads if i > author_at), len(lines))
        author = tuple(lines[author_at:end])
        lines = lines[:author_at] + lines[end:]
    options = []
    for i, ln in enumerate(lines):
        m = OPTION.match(ln)
        if not m:
            continue
        body = m.group(3) or (lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith(" ") else "")
        if body:
            options.append(Option(m.group(1), m.group(2), body))
    return Page(command, source_of(path), summary, tuple(lines), author, tuple(options))


def pages(rng: random.Random) -> list[Page]:
    # gcloud's ~16k generated pages would be most of a draw: one source, one template
    paths = sorted(p for section in ("man1", "man8") for p in (MAN / section).glob("*.gz")
                   if not p.name.startswith("gcloud"))
    found, seen = [], set()
    for path in rng.sample(paths, min(CANDIDATES, len(paths))):
        text = render(path)
        page = parse(path, text) if text else None
        if page and page.command not in seen and len(page.lines) >= 12:
            seen.add(page.command)
            found.append(page)
    return sorted(found, key=lambda p: p.command)


def cut(page: Page, tokens: int, with_author: bool, count: Callable[[str], int]) -> str | None:
    """The page at about `tokens` tokens, cut at a line end; the AUTHOR section kept at its end where asked."""
    tail = "\n\n" + "\n".join(ln.rstrip() for ln in page.author) if with_author and page.author else ""
    best = None
    for n in range(3, len(page.lines) + 1):
        text = ("\n".join(page.lines[:n]).rstrip() + tail).rstrip()
        size = count(text)
        if size > min(tokens, DOC_TOKENS[1]):
            break
        if size >= DOC_TOKENS[0] and page.lines[n - 1].strip():
            best = text
    return best


QUESTIONS = {
    "option": ('Which option of {command} does this: "{need}"?',
               'Which option of {command} is described as: "{need}"?'),
    "long": ("What is the long form of the {need} option of {command}?", "{command} {need} is short for which option?"),
    "reverse": ('Which command is described as "{need}"?', 'Name the command whose manual page says: "{need}"'),
    "author": ("Who wrote {command}, according to its manual page?", "Which person wrote the {command} program?"),
}


def make_item(i: int, all_pages: list[Page], count: Callable[[str], int], seed: int) -> dict:
    rng = random.Random(f"man_pages:{seed}:{i}")
    qtype, alike = QTYPES[i % len(QTYPES)], (i // len(QTYPES)) % 2 == 0
    by_source: dict[str, list[Page]] = {}
    for p in all_pages:
        by_source.setdefault(p.source, []).append(p)
    for _ in range(2000):
        target = rng.choice(all_pages)
        fact = target.fact(qtype, rng)
        if fact is None:
            continue
        answer, need = fact
        k = rng.randint(MIN_DOCS, MAX_DOCS)
        others = [p for p in all_pages if p.command != target.command]
        near = [p for p in by_source.get(target.source, []) if p.command != target.command] if target.source else []
        if alike:
            if len(near) < k - 1:
                continue
            chosen = rng.sample(near, k - 1)
        else:
            chosen = rng.sample(others, k - 1)
        group = chosen + [target]
        rng.shuffle(group)
        total = rng.randint(max(USER_TOKENS[0] + 40, 100 * k), min(USER_TOKENS[1] - 60, 280 * k))
        weights = [rng.uniform(0.4, 1.6) for _ in group]
        docs = [cut(p, round(total * w / sum(weights)), qtype == "author" and p is target or rng.random() < 0.5, count)
                for p, w in zip(group, weights, strict=True)]
        if any(d is None for d in docs):
            continue
        pos = group.index(target)
        if answer.casefold() not in docs[pos].casefold() or (need and need.casefold() not in docs[pos].casefold()):
            continue
        if qtype in ("option", "long") and not re.search(rf"^\s*(-\w, )?{re.escape(answer)}\b", docs[pos], re.M):
            continue  # the option's own line, not only a mention in the synopsis
        if any(answer.casefold() in d.casefold() for j, d in enumerate(docs) if j != pos):
            continue
        names = [o.long for p in group for o in p.options if o.long != answer] + [p.command for p in group]
        if any(answer.casefold() in n.casefold() for n in names if n != answer):
            continue
        question = rng.choice(QUESTIONS[qtype]).format(command=target.command, need=need)
        user = "\n\n".join(docs) + f"\n\nQuestion: {question}"
        if not USER_TOKENS[0] <= count(user) <= USER_TOKENS[1]:
            continue
        return item_row(f"mp{seed}-{i:03d}-{qtype}-{'alike' if alike else 'mixed'}", SYSTEMS[i % len(SYSTEMS)], docs,
                        question, answer, pos)
    raise RuntimeError(f"could not draw item {i}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--items", type=int, default=N_ITEMS)
    ap.add_argument("--seed", type=int, default=SEED,
                    help="another seed draws a new sample (%(default)s: the shipped set)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "research" / "datasets"))
    from fidelity_holdout import bundled_counter, summarize

    count, all_pages = bundled_counter(), pages(random.Random(f"man_pages:{args.seed}"))
    print(f"{len(all_pages)} manual pages, {len({p.source for p in all_pages})} sources", file=sys.stderr)
    write_set(args.out, [make_item(i, all_pages, count, args.seed) for i in range(args.items)])
    print(summarize(args.out))


if __name__ == "__main__":
    main()
