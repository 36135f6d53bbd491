"""The persistent tier: one safetensors file per entry, checked on every read.

A file is `<prefix_key hex>.safetensors`; its metadata says which format, model fingerprint and
quantization wrote it, and carries an xxh3_128 checksum over the metadata and every tensor byte.
Files are written atomically (store/files.py: temp file in the same directory, fsync, os.replace), so a
crash leaves the old file or the new one, never half of one. A damaged, foreign or unknown-version file
is never served: `get` warns, naming the file, and returns None so the caller recomputes.

A small JSON index maps content keys to prefix keys for `find_content`. It is only a cache of the
files' headers: on open it is reconciled with the directory (files it lacks are read, files gone
are dropped), so a missing, stale or corrupt index costs a scan, never a wrong answer.

The K/V file format is store/entries.py. The folder also holds the document index and drift maps:
`verify_dir` and `prune_dir`, which know every kind of file it may hold, are in store/folder.py; the write
helpers all its files share, and why a folder that cannot be written never fails a request, in
store/files.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
from pathlib import Path

import xxhash

from kvboost_rag.config import check_file_mode
from kvboost_rag.store.base import KVEntry
from kvboost_rag.store.entries import (
    FORMAT_VERSION,
    SUFFIX,
    BadEntryFile,
    StoreIntegrityWarning,
    _warn_bad,
    entry_path,
    read_entry,
    read_header,
    write_entry,
)
from kvboost_rag.store.files import (
    DEFAULT_FILE_MODE,
    _mtime,
    make_dir,
    write_atomic,
    write_failed,
    write_succeeded,
)
from kvboost_rag.store.folder import PruneReport, VerifyReport, file_kind, list_entry_files, prune_dir, verify_dir
from kvboost_rag.store.quant import StoredEntry, StoredFormStore, encode_entry

__all__ = ["DiskStore", "StoreIntegrityWarning", "entry_path"]


class DiskStore(StoredFormStore):
    """Entries as files under `directory`, served only to the model with this `fingerprint`.

    Entries are written at `kv_bits` / `group_size`; a file written at other settings is still
    served, at its own precision (files describe themselves). Files get permissions `file_mode`.

    A folder that cannot be made or written does not fail construction, close or the index: it is
    warned about once (`write_failed`) and retried at the next write. `put` itself raises the OSError,
    which TieredStore turns into the same warning.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        fingerprint: str,
        *,
        kv_bits: int = 16,
        group_size: int = 64,
        index_flush_every: int = 16,
        file_mode: int = DEFAULT_FILE_MODE,
    ) -> None:
        self.directory = Path(directory)
        self.file_mode = check_file_mode(file_mode)
        try:
            make_dir(self.directory, file_mode)
        except OSError as e:  # e.g. under a read-only parent: nothing to read, writes retry it
            write_failed(self.directory, e)
        self.fingerprint = fingerprint
        self.kv_bits = kv_bits
        self.group_size = group_size
        self.index_flush_every = max(1, index_flush_every)
        self.index_path = self.directory / f"index-{xxhash.xxh3_64_hexdigest(fingerprint.encode())}.json"
        self._lock = threading.Lock()
        self._content_of: dict[str, str] = {}  # prefix hex -> content hex, files of our fingerprint
        self._by_content: dict[str, set[str]] = {}  # content hex -> prefix hexes
        self._others: set[str] = set()  # files known not to be ours (foreign or unreadable)
        # Files found bad on read: not `contains`, so the caller recomputes and put() overwrites them.
        self._bad: set[str] = set()
        self._unflushed = 0
        self._counts = dict(hits=0, misses=0, bad=0, writes=0)
        self._sync_index()

    # -- KVStore -----------------------------------------------------------------------------

    def contains(self, prefix_key: bytes) -> bool:
        """A file is there and has not failed a read (files are checked in full only by get)."""
        with self._lock:
            if prefix_key.hex() in self._bad:
                return False
        return entry_path(self.directory, prefix_key).is_file()

    def put(self, entry: KVEntry, *, pin: bool = False) -> None:
        # pin means nothing here: files are only removed by remove() and prune().
        self.put_stored(encode_entry(entry, self.kv_bits, self.group_size))

    def remove(self, prefix_key: bytes) -> None:
        entry_path(self.directory, prefix_key).unlink(missing_ok=True)
        with self._lock:
            self._forget(prefix_key.hex())

    def close(self) -> None:
        self.flush()

    # -- stored form -------------------------------------------------------------------------

    def put_stored(self, stored: StoredEntry) -> None:
        make_dir(self.directory, self.file_mode)  # a no-op unless it could not be made before
        write_entry(entry_path(self.directory, stored.prefix_key), stored, self.fingerprint, self.file_mode)
        write_succeeded(self.directory)
        with self._lock:
            self._counts["writes"] += 1
            self._bad.discard(stored.prefix_key.hex())
            self._remember(stored.prefix_key.hex(), stored.content_key.hex())

    def get_stored(self, prefix_key: bytes) -> StoredEntry | None:
        path = entry_path(self.directory, prefix_key)
        try:
            stored = read_entry(path, fingerprint=self.fingerprint, prefix_key=prefix_key)
        except FileNotFoundError:
            with self._lock:
                self._counts["misses"] += 1
                self._forget(prefix_key.hex())
            return None
        except BadEntryFile as e:
            with self._lock:
                self._counts["bad"] += 1
                first = prefix_key.hex() not in self._bad
                self._bad.add(prefix_key.hex())
            if first:  # once per file, not on every request that trips over it
                _warn_bad(path, str(e))
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # mtime = last use, so prune by age or size drops the least recently used
        with self._lock:
            self._counts["hits"] += 1
            self._bad.discard(prefix_key.hex())  # repaired meanwhile, e.g. by another process
            self._remember(prefix_key.hex(), stored.content_key.hex())  # may come from another process
        return stored

    def find_content_stored(self, content_key: bytes) -> StoredEntry | None:
        with self._lock:
            candidates = list(self._by_content.get(content_key.hex(), ()))
        # Any context will do; the most recently used (mtime is bumped on reads) comes first.
        candidates.sort(key=lambda p: _mtime(self.directory / f"{p}{SUFFIX}"), reverse=True)
        for prefix_hex in candidates:
            stored = self.get_stored(bytes.fromhex(prefix_hex))
            if stored is not None and stored.content_key == content_key:
                return stored
        return None

    # -- maintenance ---------------------------------------------------------------------------

    def verify(self) -> VerifyReport:
        """Check every file in the directory against this store's fingerprint; see `verify_dir`."""
        return verify_dir(self.directory, self.fingerprint)

    def prune(
        self,
        *,
        max_bytes: int | None = None,
        max_age_s: float | None = None,
        remove_foreign: bool = False,
        dry_run: bool = False,
    ) -> PruneReport:
        """Remove bad files, and more to meet the limits; see `prune_dir`. The index follows."""
        report = prune_dir(
            self.directory,
            self.fingerprint,
            max_bytes=max_bytes,
            max_age_s=max_age_s,
            remove_foreign=remove_foreign,
            dry_run=dry_run,
        )
        if dry_run:
            return report
        with self._lock:
            for path, _ in report.removed:
                self._forget(path.stem)
            self._write_index()
        return report

    def flush(self) -> None:
        """Write the index now (it is otherwise written every `index_flush_every` changes)."""
        with self._lock:
            self._write_index()

    def stats(self) -> dict:
        with self._lock:
            return dict(entries=len(self._content_of), other_files=len(self._others), **self._counts)

    # -- the index (helpers called with the lock held, except _sync_index) ----------------------

    def _remember(self, prefix_hex: str, content_hex: str) -> None:
        if self._content_of.get(prefix_hex) == content_hex:
            return
        self._forget(prefix_hex)
        self._content_of[prefix_hex] = content_hex
        self._by_content.setdefault(content_hex, set()).add(prefix_hex)
        self._changed()

    def _forget(self, prefix_hex: str) -> None:
        self._bad.discard(prefix_hex)
        changed = prefix_hex in self._others
        self._others.discard(prefix_hex)
        content_hex = self._content_of.pop(prefix_hex, None)
        if content_hex is not None:
            changed = True
            group = self._by_content[content_hex]
            group.discard(prefix_hex)
            if not group:
                del self._by_content[content_hex]
        if changed:
            self._changed()

    def _changed(self) -> None:
        self._unflushed += 1
        if self._unflushed >= self.index_flush_every:
            self._write_index()

    def _write_index(self) -> None:
        """Write the index; if the folder cannot take it, warn once and leave it due, so the next change,
        flush or close tries again (it is only a cache: a stale one costs a scan on the next open)."""
        content = {c: sorted(ps) for c, ps in sorted(self._by_content.items())}
        doc = dict(
            format_version=FORMAT_VERSION,
            fingerprint=self.fingerprint,
            content=content,
            others=sorted(self._others),
        )
        try:
            write_atomic(self.index_path, json.dumps(doc, indent=0).encode(), self.file_mode)
        except OSError as e:
            write_failed(self.directory, e)
            return
        write_succeeded(self.directory)
        self._unflushed = 0

    def _sync_index(self) -> None:
        """Load the index and reconcile it with the files actually present."""
        on_disk = {p.stem for p in list_entry_files(self.directory)}
        self._warn_misnamed()
        content_of, others, loaded = self._load_index()
        content_of = {p: c for p, c in content_of.items() if p in on_disk}
        others &= on_disk
        for prefix_hex in sorted(on_disk - content_of.keys() - others):
            try:
                meta = read_header(self.directory / f"{prefix_hex}{SUFFIX}")
                ours = (
                    meta.get("format_version") == str(FORMAT_VERSION)
                    and meta.get("fingerprint") == self.fingerprint
                    and meta.get("prefix_key") == prefix_hex
                    and "content_key" in meta
                )
            except (BadEntryFile, FileNotFoundError):
                ours = False
            if ours:
                content_of[prefix_hex] = meta["content_key"]
            else:
                others.add(prefix_hex)
        with self._lock:
            for prefix_hex, content_hex in content_of.items():
                self._content_of[prefix_hex] = content_hex
                self._by_content.setdefault(content_hex, set()).add(prefix_hex)
            self._others = others
            if loaded != (content_of, others):
                self._write_index()

    def _load_index(self) -> tuple[dict[str, str], set[str], tuple | None]:
        """(prefix -> content, others, what was read) from the index file; empty when absent or bad."""
        if not self.index_path.exists():
            return {}, set(), None
        try:
            doc = json.loads(self.index_path.read_text())
            if doc["format_version"] != FORMAT_VERSION or doc["fingerprint"] != self.fingerprint:
                raise ValueError("written for other settings")
            content_of = {p: c for c, ps in doc["content"].items() for p in ps}
            others = set(doc["others"])
            if not all(isinstance(x, str) for x in [*content_of, *content_of.values(), *others]):
                raise ValueError("entries are not strings")
        except Exception as e:  # any damage: the files are the truth, rebuild from them
            warnings.warn(
                f"kvboost-rag: store index {self.index_path} is unreadable ({e}); rebuilding it from the "
                "files (nothing is lost)",
                StoreIntegrityWarning,
                stacklevel=3,
            )
            return {}, set(), None
        return dict(content_of), set(others), (content_of, others)

    def _warn_misnamed(self) -> None:
        """A file of ours under a name that is no prefix key is never served (only prefix-key names are
        read): say so once, rather than fail every request that finds it by its content key."""
        for path in sorted(self.directory.glob(f"*{SUFFIX}")) if self.directory.is_dir() else []:
            if file_kind(path) != "other":  # a kind of ours, checked by `store verify`
                continue
            try:
                meta = read_header(path)
            except (BadEntryFile, OSError):
                continue  # not ours to judge: `store verify` lists it
            if meta.get("fingerprint") == self.fingerprint and "prefix_key" in meta:
                warnings.warn(
                    f"kvboost-rag: ignoring {path}: it holds this model's KV but its name is not a prefix key, so "
                    f"it is never served (the chunk is recomputed). Run `kvboost-rag store prune {self.directory}` "
                    "to remove it.",
                    StoreIntegrityWarning,
                    stacklevel=4,
                )
