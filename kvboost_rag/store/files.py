"""Writing any file of the store folder: the primitives the disk tier, the document index and the drift maps share.

The folder holds the disk tier's K/V files and index (store/disk.py), the engine's document index
(`documents-*.jsonl`, see documents.py) and fitted drift maps (`drift-*.safetensors`, see drift.py). All of
them are written with these helpers, so they behave alike: every file gets `StoreConfig.file_mode` (0o600
by default: the store holds the documents' text) whatever the umask, the folder is made with the matching
x bits, and a file is written atomically (temp file in the same directory, fsync, os.replace), so a crash
leaves the old file or the new one, never half of one. A temp file holds its advisory lock until after the
rename, so `prune_dir` (store/folder.py) never removes a write in flight.

A folder that cannot be written (read-only, full, no permission) never fails a request: reads go on,
writes are kept in memory only, one `StoreWriteWarning` per folder says so, and every later write is
tried again, so the store is written again as soon as the folder takes writes (no restart needed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
import uuid
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; prune then tells in-flight temp files by age alone
    fcntl = None

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"
DEFAULT_FILE_MODE = 0o600


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


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The metadata in safetensors bytes' header (u64 header length, then JSON), without their tensors; {} when
    they have none. Raises ValueError when the bytes are not safetensors (truncated, say)."""
    try:
        (header_len,) = struct.unpack_from("<Q", data)
        header = json.loads(bytes(data[8:8 + header_len]))
    except struct.error as e:
        raise ValueError(f"not safetensors ({e})") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


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


class StoreWriteWarning(RuntimeWarning):
    """The store folder cannot be written (read-only, full, no permission): what is new stays in memory."""


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


# A file may vanish between listing and stat (another process prunes or replaces it): None, not an error.
def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def _mtime(path: Path) -> float:
    st = _stat(path)
    return st.st_mtime if st is not None else 0.0
