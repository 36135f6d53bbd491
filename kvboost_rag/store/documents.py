"""Ingested documents, and finding them inside a rendered prompt by exact text span.

Frameworks (LangChain stuff chains, LlamaIndex synthesizers) hand us one flat prompt string. Each
ingested document is found in it by its exact text, so its cached KV can be used wherever the
retriever put it. Lookup is by the document's first `ANCHOR` characters: one dict probe per prompt
character, then a full comparison, so it costs microseconds per kilobyte of prompt whatever the
size of the corpus.

Persisted, the index is one JSON line per document, each with an xxh3_128 checksum over all its fields:
the token ids are what every strategy, `full` included, feeds the model for that text, so a record that
fails its checksum (edited, damaged, torn, not UTF-8, or from before checksums) is skipped with one
warning per file, and the document is tokenized again when next ingested. Appends hold the file's lock
(so `store prune` can compact it without losing one), start on a fresh line after a torn last line, and
roll back a write cut short. An unwritable folder keeps new records in memory, warned about once, and
writes them with the next one that succeeds.

With a Redis tier the same records are shared through Redis as well (`shared`, see redis_documents.py): read
in full when the index is made, and before each prompt's lookup whatever other processes added since.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..chunking import Chunk
from ..config import check_file_mode
from .entries import StoreIntegrityWarning
from .files import (
    DEFAULT_FILE_MODE,
    lock_file,
    make_dir,
    write_all,
    write_atomic,
    write_failed,
    write_succeeded,
)

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
    """Thread-safe registry of ingested documents; persisted as checksummed JSON lines when given a file
    (written with permissions `file_mode`), and shared with other processes when given `shared` (a
    redis_documents.RedisDocuments: `hold(docs)`, `pull() -> new docs`, `push(doc)`, `flush()`)."""

    def __init__(self, path: Path | None = None, file_mode: int = DEFAULT_FILE_MODE, shared=None):
        self._by_text: dict[str, Document] = {}
        self._by_anchor: dict[str, list[Document]] = {}
        self._short: list[Document] = []
        self._lock = threading.Lock()
        self._path = None if path is None else Path(path)
        self._file_mode = check_file_mode(file_mode)
        self._unwritten: list[bytes] = []  # records the folder did not take yet; written with the next add
        if self._path is not None:
            self._load(self._path)
        self._shared = shared
        if shared is not None:
            shared.hold(list(self._by_text.values()))  # the file's documents, shared where Redis lacks them
            self._merge(shared.pull())

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
                self._unwritten.append(encode_record(doc))
                self._write_unwritten()
        if self._shared is not None:
            self._shared.push(doc)

    def flush(self) -> None:
        """Write the records an unwritable folder (or an unreachable Redis) did not take yet (each add tries
        too); call before exit."""
        with self._lock:
            if self._unwritten:
                self._write_unwritten()
        if self._shared is not None:
            self._shared.flush()

    def _merge(self, docs: list[Document]) -> None:
        """Other processes' documents, each under its text unless this index has that text already."""
        if docs:
            with self._lock:
                for doc in docs:
                    if doc.text not in self._by_text:
                        self._insert(doc)

    def _write_unwritten(self) -> None:
        try:
            append_lines(self._path, b"".join(self._unwritten), self._file_mode)
        except OSError as e:  # read-only or full: the documents are served from memory meanwhile
            write_failed(self._path.parent, e)
            return
        write_succeeded(self._path.parent)
        self._unwritten.clear()

    def _insert(self, doc: Document) -> None:
        self._by_text[doc.text] = doc
        if len(doc.text) >= ANCHOR:
            self._by_anchor.setdefault(doc.text[:ANCHOR], []).append(doc)
        else:
            self._short.append(doc)

    def _load(self, path: Path) -> None:
        try:
            docs, problems = read_records(path)
        except FileNotFoundError:
            return
        except OSError as e:
            warnings.warn(f"kvboost-rag: cannot read the document index {path} ({e}); going on without it: its "
                          "documents are tokenized again when ingested (their stored KV is still reused). Make "
                          "the file readable to keep it.", StoreIntegrityWarning, stacklevel=3)
            return
        for doc in docs:
            if doc.text not in self._by_text:
                self._insert(doc)
        if problems:
            warnings.warn(f"kvboost-rag: document index {path}: {describe_bad_records(problems)}. Those documents "
                          "are tokenized again when next ingested: ingest them again (their stored KV is reused "
                          f"where intact); `kvboost-rag store prune {path.parent}` drops the bad lines.",
                          StoreIntegrityWarning, stacklevel=3)

    def find(self, prompt: str, starts: Iterable[int] | None = None) -> list[Span]:
        """Non-overlapping spans of ingested documents in `prompt`, left to right, longest first, starting at one of
        `starts` (character offsets; the prompt's token starts, where a document can be used) or anywhere. Shared
        through Redis, the documents other processes added since the last lookup are read first (one round trip
        when there are none)."""
        if self._shared is not None:
            self._merge(self._shared.pull())
        candidates: list[Span] = []
        anchors = self._by_anchor
        allowed = None if starts is None else set(starts)
        last = len(prompt) - ANCHOR
        # Any order: the candidates are sorted below.
        for i in range(last + 1) if allowed is None else (i for i in allowed if i <= last):
            docs = anchors.get(prompt[i:i + ANCHOR])
            if docs:
                for doc in docs:
                    if prompt.startswith(doc.text, i):
                        candidates.append(Span(i, i + len(doc.text), doc))
        for doc in self._short:
            start = prompt.find(doc.text)
            while start != -1:
                if allowed is None or start in allowed:
                    candidates.append(Span(start, start + len(doc.text), doc))
                start = prompt.find(doc.text, start + 1)
        candidates.sort(key=lambda s: (s.start, -(s.end - s.start)))
        spans, reach = [], 0
        for span in candidates:
            if span.start >= reach:
                spans.append(span)
                reach = span.end
        return spans


# -- the file ------------------------------------------------------------------------------------

NO_CHECKSUM = "no checksum (written by an older kvboost-rag): ingest the document again"


def encode_record(doc: Document) -> bytes:
    """One line of the index file: the document's fields and their checksum, in ASCII JSON."""
    body = {"doc_id": doc.doc_id, "text": doc.text, "token_ids": list(doc.token_ids),
            "chunks": [[c.start, c.end] for c in doc.chunks]}
    return (json.dumps({**body, "checksum": _checksum(body)}) + "\n").encode("ascii")


def decode_record(line: bytes) -> Document:
    """The document of one line, or a ValueError saying why it cannot be trusted."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {e.start})") from None
    except ValueError:
        raise ValueError("not a JSON record (cut short or edited)") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON record (edited)")
    checksum = record.pop("checksum", None)
    if checksum is None:
        raise ValueError(NO_CHECKSUM)
    if checksum != _checksum(record):
        raise ValueError("checksum mismatch (edited or damaged)")
    try:
        return Document(record["doc_id"], record["text"], tuple(record["token_ids"]),
                        tuple(Chunk(a, b) for a, b in record["chunks"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed fields ({e!r})") from None


def describe_bad_records(problems: list[tuple[int, str]], shown: int = 5) -> str:
    """'line 3: checksum mismatch; ...' for the first `shown` bad records of a document index."""
    text = "; ".join(f"line {line}: {why}" for line, why in problems[:shown])
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return f"{len(problems)} bad record(s), which the engine skips ({text}{more})"


def read_records(path: Path) -> tuple[list[Document], list[tuple[int, str]]]:
    """The documents of an index file that pass their checks, and (line, why) for each that does not.
    Read as bytes and decoded line by line, so one bad byte costs one record, not the file."""
    docs, problems = [], []
    lines = Path(path).read_bytes().split(b"\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            docs.append(decode_record(line))
        except ValueError as e:
            torn = lineno == len(lines)  # no newline after it: its write was cut short
            problems.append((lineno, f"torn last line, {e}" if torn else str(e)))
    return docs, problems


def append_lines(path: Path, data: bytes, file_mode: int = DEFAULT_FILE_MODE) -> None:
    """Append whole lines to `path` under its lock. After a torn last line, a newline first, so the new
    record is not glued onto it; a write cut short (a full disk) is rolled back, so it leaves none."""
    with _locked(path, file_mode) as fd:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        try:
            write_all(fd, data)
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):  # truncating frees space, so it works on a full disk
                os.ftruncate(fd, size)
            raise


def drop_bad_records(path: Path) -> int:
    """Rewrite an index file without the records `read_records` rejects, keeping its permissions; the bytes
    freed. Done under the file's lock, so a concurrent append waits and then writes to the new file."""
    with _locked(path, DEFAULT_FILE_MODE) as fd:
        data = Path(path).read_bytes()
        kept = []
        for line in data.split(b"\n"):
            with contextlib.suppress(ValueError):
                decode_record(line)
                kept.append(line + b"\n")
        write_atomic(path, b"".join(kept), stat.S_IMODE(os.fstat(fd).st_mode))
    return len(data) - sum(map(len, kept))


@contextlib.contextmanager
def _locked(path: Path, file_mode: int):
    """A read-write append descriptor of `path` (made with `file_mode` if missing), holding its lock, and
    still the file at `path`: one that drop_bad_records replaced while we waited is opened again."""
    make_dir(path.parent, file_mode)
    while True:
        fd = _open_append(path, file_mode)
        try:
            lock_file(fd)
            held, current = os.fstat(fd), _stat(path)
            if current is not None and (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _open_append(path: Path, file_mode: int) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL, file_mode)
    except FileExistsError:  # an existing file keeps the permissions it has
        return os.open(path, os.O_RDWR | os.O_APPEND)
    try:
        os.fchmod(fd, file_mode)  # os.open's mode is cut by the umask
    except BaseException:
        os.close(fd)
        raise
    return fd


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _checksum(body: dict) -> str:
    # Sorted ASCII JSON: the same bytes for the same record in any process and any Python version.
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True).encode("ascii"))
