"""The persistent tier: one safetensors file per entry, checked on every read.

A file is `<prefix_key hex>.safetensors`; its metadata says which format, model fingerprint and
quantization wrote it, and carries an xxh3_128 checksum over the metadata and every tensor byte.
Files are written atomically (temp file in the same directory, fsync, os.replace), so a crash
leaves the old file or the new one, never half of one. A damaged, foreign or unknown-version file
is never served: `get` warns, naming the file, and returns None so the caller recomputes.

A small JSON index maps content keys to prefix keys for `find_content`. It is only a cache of the
files' headers: on open it is reconciled with the directory (files it lacks are read, files gone
are dropped), so a missing, stale or corrupt index costs a scan, never a wrong answer.

The folder also holds the engine's document index (`documents-*.jsonl`, see documents.py) and fitted
drift maps (`drift-*.safetensors`, see drift.py), written with this module's helpers: every file with
`StoreConfig.file_mode` (0o600 by default: the store holds the documents' text), the folder made with
the matching x bits. `verify_dir` and `prune_dir` know every kind of file the folder may hold.

A folder that cannot be written (read-only, full, no permission) never fails a request: reads go on,
writes are kept in memory only, one `StoreWriteWarning` per folder says so, and every later write is
tried again, so the store is written again as soon as the folder takes writes (no restart needed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save

from kvboost_rag.store.base import KVEntry, KVStore
from kvboost_rag.store.quant import QuantizedKV, StoredEntry, decode_entry, encode_entry

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; prune then tells in-flight temp files by age alone
    fcntl = None

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
DEFAULT_FILE_MODE = 0o600
_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}
# What each name in the folder is (see file_kind). Prefix keys are written as lowercase hex by entry_path.
_KINDS = (
    ("entry", re.compile(r"(?:[0-9a-f]{2})+\.safetensors")),
    ("drift", re.compile(r"drift-[0-9a-f]{16}\.safetensors")),  # drift.save, named by the engine
    ("documents", re.compile(r"documents-[0-9a-f]{16}\.jsonl")),  # DocumentIndex, named by the engine
    ("index", re.compile(r"index-[0-9a-f]{16}\.json")),  # DiskStore's own index
)


class StoreIntegrityWarning(UserWarning):
    """A stored KV file was ignored because it is damaged, foreign or of another format version."""


class StoreWriteWarning(RuntimeWarning):
    """The store folder cannot be written (read-only, full, no permission): what is new stays in memory."""


class BadEntryFile(Exception):
    """A KV file that must not be served; `str()` says what is wrong with it."""


# -- writing any file of the folder ------------------------------------------------------------


def check_file_mode(file_mode: int) -> int:
    """`file_mode`, or a ValueError saying what a valid one is."""
    if not isinstance(file_mode, int) or file_mode & ~0o777 or file_mode & 0o600 != 0o600:
        raise ValueError(
            f"StoreConfig.file_mode must be permission bits that let the owner read and write, such as 0o600 "
            f"(owner only), 0o640 (and the group) or 0o644 (everyone); got {file_mode!r}"
        )
    return file_mode


def folder_mode(file_mode: int) -> int:
    """The folder's permissions for files of `file_mode`: whoever may read the files may list the folder."""
    return file_mode | (file_mode & 0o444) >> 2


def make_dir(directory: Path, file_mode: int = DEFAULT_FILE_MODE) -> None:
    """Create `directory` (and its parents) if missing. Only a folder made here gets `folder_mode`: an
    existing one is the user's, and keeps its permissions."""
    directory = Path(directory)
    if directory.is_dir():
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, folder_mode(file_mode))
    except FileExistsError:
        return
    os.chmod(directory, folder_mode(file_mode))  # mkdir's mode is cut by the umask


def write_atomic(path: Path, data: bytes, file_mode: int = DEFAULT_FILE_MODE) -> None:
    """Write `path` atomically, with permissions `file_mode` whatever the umask."""
    path = Path(path)
    # Unique per writer, so concurrent writers of one key never share a temp file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, file_mode)
    try:
        lock_file(fd)  # held until after the rename: prune never removes a temp file still being written
        os.fchmod(fd, file_mode)  # os.open's mode is cut by the umask
        write_all(fd, data)
        os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # on a read-only or vanished folder there is nothing to clean
            tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    _fsync_dir(path.parent)


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a write may take fewer; a full disk then raises ENOSPC)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def lock_file(fd: int, *, block: bool = True) -> bool:
    """Take the exclusive advisory lock of an open file; False when `block` is off and another holds it.
    Where the filesystem has no locks, go on unlocked (prune then tells in-flight temp files by age)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EINVAL: a filesystem without flock
        return True
    return True


def is_locked(path: Path) -> bool:
    """Whether a writer holds `path`'s lock (False where locks are unsupported, or the file is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return not lock_file(fd, block=False)
    finally:
        os.close(fd)  # releases the lock if we took it


_failing: set[str] = set()  # folders whose last write failed, warned about once
_failing_lock = threading.Lock()


def write_failed(directory: Path, error: OSError) -> None:
    """Say once per folder (per outage) that it cannot be written; later failures are only logged."""
    key = os.path.abspath(directory)
    with _failing_lock:
        first = key not in _failing
        _failing.add(key)
    if not first:
        log.info("still cannot write to the store folder %s: %s", directory, error)
        return
    warnings.warn(
        f"kvboost-rag: cannot write to the store folder {directory} ({error}). Answers are not affected: what is "
        "stored there is still read, and new KV and documents are kept in memory only, so the next process "
        "recomputes them. Every later write tries again, so the store is written as soon as the folder takes "
        "writes: free space on its disk or make it writable (or set StoreConfig.disk_dir to another folder). "
        "Further failures are logged, not warned.",
        StoreWriteWarning,
        stacklevel=4,
    )


def write_succeeded(directory: Path) -> None:
    """End an outage: the next failure in this folder warns again."""
    if _failing:  # the common case, no lock
        with _failing_lock:
            _failing.discard(os.path.abspath(directory))


def file_kind(path: Path) -> str:
    """What a name in the store folder is: "entry" (a K/V file), "drift" (fitted drift maps),
    "documents" (the document index), "index" (this tier's index), "temp" (a write in flight or
    interrupted) or "other" (not named like any of ours)."""
    name = Path(path).name
    if name.endswith(TEMP_SUFFIX):
        return "temp"
    for kind, pattern in _KINDS:
        if pattern.fullmatch(name):
            return kind
    return "other"


# -- one file ----------------------------------------------------------------------------------


def entry_path(directory: Path, prefix_key: bytes) -> Path:
    return Path(directory) / f"{prefix_key.hex()}{SUFFIX}"


def write_entry(path: Path, stored: StoredEntry, fingerprint: str, file_mode: int = DEFAULT_FILE_MODE) -> None:
    """Write `stored` to `path` atomically, with permissions `file_mode`."""
    tensors = {"token_ids": torch.tensor(stored.token_ids, dtype=torch.int64)}
    if stored.raw is not None:
        tensors["keys"], tensors["values"] = stored.raw
        key_shape, value_shape = stored.raw[0].shape, stored.raw[1].shape
        group_size = 0
    else:
        tensors.update(stored.quantized.tensors())
        key_shape, value_shape = stored.quantized.key_shape, stored.quantized.value_shape
        group_size = stored.quantized.group_size
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    meta = {
        "format_version": str(FORMAT_VERSION),
        "fingerprint": fingerprint,
        "kv_bits": str(stored.bits),
        "group_size": str(group_size),
        "dtype": str(stored.dtype).removeprefix("torch."),
        "start": str(stored.start),
        "key_shape": json.dumps(list(key_shape)),
        "value_shape": json.dumps(list(value_shape)),
        "prefix_key": stored.prefix_key.hex(),
        "content_key": stored.content_key.hex(),
    }
    meta["checksum"] = _checksum(meta, tensors)
    write_atomic(path, save(tensors, metadata=meta), file_mode)


def read_header(path: Path) -> dict[str, str]:
    """The file's metadata, without reading or checking its tensors. Raises BadEntryFile."""
    with _open(path) as f:
        return _metadata(f)


def read_entry(path: Path, *, fingerprint: str | None = None, prefix_key: bytes | None = None) -> StoredEntry:
    """Read and check a file: format version, fingerprint (when given), prefix key (when given),
    checksum, tensor layout. Raises BadEntryFile on any failure, FileNotFoundError when absent."""
    # One open for metadata and tensors: a concurrent os.replace cannot mix two versions.
    with _open(path) as f:
        meta = _metadata(f)
        if meta.get("format_version") != str(FORMAT_VERSION):
            version = meta.get("format_version")
            raise BadEntryFile(f"format version {version!r}, this kvboost-rag reads {FORMAT_VERSION}")
        if fingerprint is not None and meta.get("fingerprint") != fingerprint:
            raise BadEntryFile(
                f"written for model fingerprint {meta.get('fingerprint')!r}, not {fingerprint!r}"
            )
        if prefix_key is not None and meta.get("prefix_key") != prefix_key.hex():
            raise BadEntryFile(f"holds prefix key {meta.get('prefix_key')}, not the one its name says")
        try:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
        except Exception as e:
            raise BadEntryFile(f"unreadable ({e})") from e
    body = {k: v for k, v in meta.items() if k != "checksum"}
    if meta.get("checksum") != _checksum(body, tensors):
        raise BadEntryFile("checksum mismatch (the file was damaged after it was written)")
    try:
        return _stored_from(meta, tensors)
    except (KeyError, ValueError, TypeError) as e:
        raise BadEntryFile(f"inconsistent contents ({e})") from e


@contextlib.contextmanager
def _open(path: Path):
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error type for every kind of damage
        if not Path(path).exists():
            raise FileNotFoundError(path) from e  # absent or removed meanwhile: a miss, not damage
        raise BadEntryFile(f"unreadable ({e})") from e
    with f:
        yield f


def _metadata(f) -> dict[str, str]:
    meta = f.metadata()
    if not meta:
        raise BadEntryFile("no kvboost-rag metadata")
    return meta


def _stored_from(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> StoredEntry:
    bits = int(meta["kv_bits"])
    common = dict(
        token_ids=tuple(tensors["token_ids"].tolist()),
        start=int(meta["start"]),
        prefix_key=bytes.fromhex(meta["prefix_key"]),
        content_key=bytes.fromhex(meta["content_key"]),
        dtype=_DTYPES[meta["dtype"]],
    )
    key_shape, value_shape = tuple(json.loads(meta["key_shape"])), tuple(json.loads(meta["value_shape"]))
    if bits == 16:
        keys, values = tensors["keys"], tensors["values"]
        if tuple(keys.shape) != key_shape or tuple(values.shape) != value_shape:
            raise ValueError("tensor shapes differ from the recorded ones")
        return StoredEntry(**common, raw=(keys, values))
    q = QuantizedKV.from_tensors(tensors, key_shape, value_shape, bits, int(meta["group_size"]))
    return StoredEntry(**common, quantized=q)


def _checksum(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """xxh3_128 over the metadata and every tensor's name, dtype, shape and bytes, in name order."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
    return h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _warn_bad(path: Path, problem: str) -> None:
    warnings.warn(
        f"kvboost-rag: ignoring stored KV file {path}: {problem}. The chunk will be recomputed and the "
        f"file overwritten; run `kvboost-rag store verify {path.parent}` to check the directory and "
        f"`kvboost-rag store prune {path.parent}` to remove damaged files.",
        StoreIntegrityWarning,
        stacklevel=3,
    )


# -- the whole directory ----------------------------------------------------------------------


@dataclass
class VerifyReport:
    """What `verify_dir` found: every file of the folder, by kind."""

    good: list[Path] = field(default_factory=list)  # intact K/V files (of the fingerprint, when one is given)
    bad: dict[Path, str] = field(default_factory=dict)  # any file that fails its checks -> what is wrong
    foreign: list[Path] = field(default_factory=list)  # intact K/V files of another fingerprint
    fingerprints: dict[str, int] = field(default_factory=dict)  # intact K/V files per fingerprint
    temp_files: list[Path] = field(default_factory=list)  # left by interrupted writes (or in flight)
    drift_maps: list[Path] = field(default_factory=list)  # intact fitted drift maps
    documents: dict[Path, int] = field(default_factory=dict)  # document index -> intact records
    # Document index -> (line, why) of each record the engine would skip; such a file is also in `bad`.
    bad_records: dict[Path, list[tuple[int, str]]] = field(default_factory=dict)
    indexes: list[Path] = field(default_factory=list)  # the disk tier's own index files (readable)
    unknown: list[Path] = field(default_factory=list)  # not kvboost-rag's: never removed

    @property
    def ok(self) -> bool:
        """Every file is intact or of a known kind (temp files are; unknown ones are not)."""
        return not self.bad and not self.unknown


@dataclass
class PruneReport:
    removed: list[tuple[Path, str]]  # file, why
    freed_bytes: int
    kept_files: int  # K/V files
    kept_bytes: int
    dry_run: bool
    compacted: list[tuple[Path, str]] = field(default_factory=list)  # document indexes rewritten, what was dropped


def list_entry_files(directory: Path) -> list[Path]:
    """The K/V files in `directory` (named by their prefix key), sorted."""
    return sorted(p for p in Path(directory).glob(f"*{SUFFIX}") if file_kind(p) == "entry" and p.is_file())


def verify_dir(directory: str | os.PathLike, fingerprint: str | None = None) -> VerifyReport:
    """Check every file in the folder as its kind says: K/V files read in full (checksums included),
    drift maps loaded, document indexes record by record, this tier's index parsed; temp files and
    files that are not kvboost-rag's listed. Without a fingerprint, any intact K/V file is good and
    `fingerprints` says how many each model wrote."""
    # documents.py writes its file with this module's helpers, so it imports this module, not the reverse.
    from kvboost_rag.documents import describe_bad_records, read_records

    directory = Path(directory)
    report = VerifyReport()
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        kind = file_kind(path) if path.is_file() else "other"
        try:
            if kind == "entry":
                _verify_entry(path, fingerprint, report)
            elif kind == "drift":
                _check_drift(path)
                report.drift_maps.append(path)
            elif kind == "documents":
                docs, problems = read_records(path)
                report.documents[path] = len(docs)
                if problems:
                    report.bad_records[path] = problems
                    report.bad[path] = describe_bad_records(problems)
            elif kind == "index":
                _check_index(path)
                report.indexes.append(path)
            elif kind == "temp":
                report.temp_files.append(path)
            elif path.name.endswith(SUFFIX) and path.is_file() and _has_our_metadata(path):
                report.bad[path] = "kvboost-rag metadata, but the file name is not a prefix key: never served"
            else:
                report.unknown.append(path)
        except FileNotFoundError:
            continue  # removed while we looked
        except (BadEntryFile, OSError) as e:
            report.bad[path] = str(e)
    return report


def _verify_entry(path: Path, fingerprint: str | None, report: VerifyReport) -> None:
    try:
        read_entry(path, prefix_key=bytes.fromhex(path.stem))
        owner = read_header(path)["fingerprint"]
    except KeyError as e:
        raise BadEntryFile(f"no {e} in its metadata") from e
    report.fingerprints[owner] = report.fingerprints.get(owner, 0) + 1
    (report.good if fingerprint in (None, owner) else report.foreign).append(path)


def _check_drift(path: Path) -> None:
    """What the engine's drift.load checks without the model (it also checks the shapes against the model)."""
    from kvboost_rag import drift  # drift.save writes with this module's helpers: imported here, not at the top

    with _open(path) as f:
        meta = f.metadata() or {}
        try:
            keys, values = f.get_tensor("keys"), f.get_tensor("values")
        except Exception as e:  # safetensors' own error types: a missing tensor or damaged bytes
            raise BadEntryFile(f"unreadable drift maps ({e})") from e
    if meta.get("version") != str(drift.VERSION):
        raise BadEntryFile(f"drift maps of version {meta.get('version')!r}, this kvboost-rag reads {drift.VERSION}: "
                           "refit them with KVBoost.fit_drift()")
    if meta.get("fingerprint", "")[:16] != path.stem.removeprefix("drift-"):
        raise BadEntryFile(f"drift maps for model fingerprint {meta.get('fingerprint')!r}, not the one its name says")
    if keys.dim() != 5 or keys.shape != values.shape or keys.shape[-2] != keys.shape[-1] + 1:
        raise BadEntryFile(f"drift maps of shape {list(keys.shape)} / {list(values.shape)}, not [P, L, H, D + 1, D]")
    if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
        raise BadEntryFile("drift maps hold NaN or infinite numbers")


def _check_index(path: Path) -> None:
    try:
        doc = json.loads(path.read_bytes())
        if not (isinstance(doc.get("content"), dict) and isinstance(doc.get("others"), list)):
            raise ValueError("no content or others")
    except (ValueError, AttributeError) as e:
        raise BadEntryFile(f"unreadable store index ({e}); the disk tier rebuilds it from the files") from e


def _has_our_metadata(path: Path) -> bool:
    try:
        meta = read_header(path)
    except (BadEntryFile, OSError):
        return False
    return "format_version" in meta and "prefix_key" in meta


def prune_dir(
    directory: str | os.PathLike,
    fingerprint: str | None = None,
    *,
    max_bytes: int | None = None,
    max_age_s: float | None = None,
    remove_foreign: bool = False,
    dry_run: bool = False,
    temp_grace_s: float = 60.0,
) -> PruneReport:
    """Remove bad files and left-over temp files, and drop the bad records of document indexes; then,
    least recently used first (reads bump a file's mtime), K/V files unused for `max_age_s` and as many
    as it takes to fit `max_bytes`. Intact K/V files of another fingerprint are kept unless
    `remove_foreign`. Intact drift maps and document indexes, and files not kvboost-rag's, are never
    removed."""
    from kvboost_rag.documents import drop_bad_records  # see verify_dir

    report = verify_dir(directory, fingerprint)
    now = time.time()
    sizes = {
        p: st.st_size
        for p in [*report.bad, *report.temp_files, *report.good, *report.foreign]
        if (st := _stat(p)) is not None
    }
    # A document index is compacted, not removed: its good records are the documents' tokenization.
    doomed = [(p, f"damaged: {why}") for p, why in report.bad.items() if p not in report.bad_records]
    doomed += [(p, "stale temp file") for p in report.temp_files if _left_over(p, now, temp_grace_s)]
    if remove_foreign:
        doomed += [(p, "written for another model fingerprint") for p in report.foreign]
    kept = [p for p in report.good + ([] if remove_foreign else report.foreign) if p in sizes]
    kept_bytes = sum(sizes[p] for p in kept)
    for path in sorted((p for p in report.good if p in sizes), key=_mtime):
        if max_age_s is not None and now - _mtime(path) > max_age_s:
            why = f"unused for more than {max_age_s:.0f} s"
        elif max_bytes is not None and kept_bytes > max_bytes:
            why = f"over the {max_bytes}-byte target"
        else:
            continue
        doomed.append((path, why))
        kept.remove(path)
        kept_bytes -= sizes[path]
    freed = sum(sizes.get(p, 0) for p, _ in doomed)
    compacted = [(p, f"dropped {len(problems)} bad record(s)") for p, problems in report.bad_records.items()]
    if not dry_run:
        for path, _ in doomed:
            path.unlink(missing_ok=True)
        freed += sum(drop_bad_records(path) for path, _ in compacted)
    return PruneReport(doomed, freed, len(kept), kept_bytes, dry_run, compacted)


def _left_over(path: Path, now: float, grace_s: float) -> bool:
    """A temp file is left over from an interrupted write, not in flight, when no writer holds its lock
    (write_atomic holds it from just after creating the file until after the rename) and it is older than
    `grace_s`, which covers the instant between creation and lock and filesystems without locks. An
    interrupted write is never resumed, so waiting costs only the disk space for a minute."""
    return now - _mtime(path) > grace_s and not is_locked(path)


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def _mtime(path: Path) -> float:
    st = _stat(path)
    return st.st_mtime if st is not None else 0.0


# -- the store ---------------------------------------------------------------------------------


class DiskStore(KVStore):
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

    def get(self, prefix_key: bytes) -> KVEntry | None:
        stored = self.get_stored(prefix_key)
        return None if stored is None else decode_entry(stored)

    def find_content(self, content_key: bytes) -> KVEntry | None:
        stored = self.find_content_stored(content_key)
        return None if stored is None else decode_entry(stored)

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
            if file_kind(path) in ("entry", "drift"):
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
