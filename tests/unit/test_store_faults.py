"""Faults injected into a store folder (issue 23): each is caught, warned about once, and never fails a request.

The document index is checksummed per record (edited token ids, a non-UTF-8 byte, a torn last line, records of
the previous format); a read-only or full folder degrades to memory with one warning and is written again once
it takes writes; drift maps, document indexes and temp files are known to verify/prune/stats; misnamed files
are skipped; files get StoreConfig.file_mode. Tests run as root, where chmod does not stop writes: read-only and
full folders are simulated at the system-call level, and for real on a tmpfs where one can be mounted.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import stat
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvboost_rag import EngineConfig, StoreConfig, drift
from kvboost_rag.chunking import Chunk
from kvboost_rag.cli import store as store_cli
from kvboost_rag.store.disk import DiskStore, StoreIntegrityWarning, entry_path
from kvboost_rag.store.documents import Document, DocumentIndex, encode_record
from kvboost_rag.store.files import StoreWriteWarning, write_atomic
from kvboost_rag.store.folder import list_entry_files, prune_dir, verify_dir
from kvboost_rag.store.memory import MemoryStore
from kvboost_rag.store.tiered import TieredStore, make_store

FP = "model-A"
DOCS_FP = "0123456789abcdef0123456789abcdef"  # an engine's fingerprint is hex; names use its first 16 characters
REPO = Path(__file__).resolve().parents[2]


def _cli(*argv):
    parser = argparse.ArgumentParser(prog="kvboost-rag")
    store_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _doc(i: int, text: str | None = None) -> Document:
    text = text or f"Document number {i}, long enough to be anchored by its first characters."
    return Document(f"{i:032x}", text, tuple(range(100 * i, 100 * i + 8)), (Chunk(0, 5), Chunk(5, 8)))


def _index_path(folder: Path) -> Path:
    return folder / f"documents-{DOCS_FP[:16]}.jsonl"


def _written_index(folder: Path, count: int = 3) -> Path:
    index = DocumentIndex(_index_path(folder))
    for i in range(count):
        index.add(_doc(i))
    return _index_path(folder)


def _reopen(path: Path, match: str) -> DocumentIndex:
    with pytest.warns(StoreIntegrityWarning, match=match) as record:
        index = DocumentIndex(path)
    assert len(record) == 1 and str(path) in str(record[0].message) and "ingest them again" in str(record[0].message)
    return index


def _store_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, StoreWriteWarning)]


# -- system-call faults, scoped to one folder -----------------------------------------------------


def _under(path, folder: Path) -> bool:
    try:
        return Path(os.fsdecode(path)).resolve().is_relative_to(folder.resolve())
    except (TypeError, ValueError):
        return False


def _fd_under(fd: int, folder: Path) -> bool:
    try:
        return _under(os.readlink(f"/proc/self/fd/{fd}"), folder)
    except OSError:
        return False


def _read_only(monkeypatch, folder: Path) -> None:
    """Every call that would change `folder` fails as on a read-only filesystem (reads still work)."""
    real_open = os.open
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def fake_open(path, flags, *args, **kwargs):
        if flags & writing and _under(path, folder):
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    for name in ("mkdir", "unlink", "replace", "utime", "chmod"):
        real = getattr(os, name)

        def fake(path, *args, _real=real, **kwargs):
            if _under(path, folder):
                refuse(path)
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, fake)


def _full_disk(monkeypatch, folder: Path) -> None:
    """Writes to files in `folder` stop with ENOSPC after half their bytes, as on a disk that fills up."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell which file a write goes to")
    real_write = os.write

    def fake_write(fd, data):
        if _fd_under(fd, folder):
            if len(data) > 1:
                return real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", fake_write)


@pytest.fixture
def tmpfs(tmp_path):
    """A fresh tmpfs of 4 MiB (a real filesystem that fills up and can be remounted read-only)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); the system-call tests cover the same paths")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the system-call tests cover the same paths")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def _remount(mount: Path, how: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{how}", str(mount)], check=True, capture_output=True, timeout=30)


# -- item 2: the document index is checksummed per record ------------------------------------------


def test_index_round_trip_and_records_carry_a_checksum(tmp_path):
    path = _written_index(tmp_path)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 3 and all(len(json.loads(line)["checksum"]) == 32 for line in lines)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reopened = DocumentIndex(path)
    assert [reopened.get(_doc(i).text) for i in range(3)] == [_doc(i) for i in range(3)]


@pytest.mark.parametrize("field", ["doc_id", "text", "token_ids", "chunks"])
def test_an_edited_field_fails_the_records_checksum(tmp_path, field):
    path = _written_index(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[1])
    record[field] = {"doc_id": "f" * 32, "text": record["text"] + "!", "token_ids": [7] * 8,
                     "chunks": [[0, 8]]}[field]
    lines[1] = (json.dumps(record) + "\n").encode()
    path.write_bytes(b"".join(lines))
    index = _reopen(path, "line 2: checksum mismatch")
    assert len(index) == 2 and index.get(_doc(1).text) is None


def test_swapped_token_ids_are_never_served_and_verify_reports_them(make_tiny_engine, docs, rag_prompt, tmp_path):
    """The sweep's case: one document's token ids replaced with another's, its text left alone."""
    config = EngineConfig(store=StoreConfig(disk_dir=tmp_path))
    first = make_tiny_engine(config)
    first.ingest(docs)
    first.close()
    path = next(tmp_path.glob("documents-*.jsonl"))
    lines = path.read_bytes().splitlines(keepends=True)
    victim, donor = json.loads(lines[0]), json.loads(lines[1])
    victim["token_ids"] = donor["token_ids"]
    lines[0] = (json.dumps(victim) + "\n").encode()
    path.write_bytes(b"".join(lines))

    assert _cli("store", "verify", str(tmp_path)) == 1
    with pytest.warns(StoreIntegrityWarning, match="line 1: checksum mismatch"):
        second = make_tiny_engine(config)
    assert second.documents.get(docs[0]) is None  # skipped, so never fed to the model as docs[1]'s tokens
    second.ingest(docs)  # tokenized again; its stored KV is intact and reused
    assert second.counters["documents_stored"] == len(docs) and second.counters["documents_computed"] == 0
    assert second.documents.get(docs[0]).token_ids == first.documents.get(docs[0]).token_ids
    prompt = rag_prompt(docs, "Who founded the company?")
    assert torch.equal(second.prefill(prompt, "full", write_back=False).logits,
                       first.prefill(prompt, "full", write_back=False).logits)
    second.close()
    report = prune_dir(tmp_path)  # drops the bad line; the re-ingested record stays
    assert report.compacted == [(path, "dropped 1 bad record(s)")] and path.exists()
    assert _cli("store", "verify", str(tmp_path)) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreIntegrityWarning)
        assert make_tiny_engine(config).documents.get(docs[0]) is not None


def test_a_non_utf8_byte_costs_one_record_not_the_store(tmp_path):
    path = _written_index(tmp_path)
    data = bytearray(path.read_bytes())
    second_line = data.index(b"\n") + 1
    data[data.index(b"number 1") + 2] = 0xFF
    path.write_bytes(bytes(data))
    index = _reopen(path, "line 2: not UTF-8")
    assert len(index) == 2 and index.get(_doc(0).text) and index.get(_doc(2).text)
    report = verify_dir(tmp_path)
    at = data.index(b"\xff") - second_line
    assert report.bad_records == {path: [(2, f"not UTF-8 (byte {at})")]} and report.documents == {path: 2}


def test_after_a_torn_last_line_the_next_record_starts_on_its_own_line(tmp_path):
    path = _written_index(tmp_path, count=2)
    path.write_bytes(path.read_bytes()[:-20])  # the writer of line 2 was killed mid-write
    index = _reopen(path, "line 2: torn last line")
    index.add(_doc(5))
    reopened = _reopen(path, "line 2: not a JSON record")  # the torn line is still there, until prune drops it
    assert reopened.get(_doc(5).text) == _doc(5) and reopened.get(_doc(0).text) == _doc(0)
    assert prune_dir(tmp_path).compacted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(DocumentIndex(path)) == 2


def test_records_of_the_previous_format_are_unverified_and_skipped(tmp_path):
    path = _index_path(tmp_path)
    doc = _doc(1)
    old = {"doc_id": doc.doc_id, "text": doc.text, "token_ids": list(doc.token_ids), "chunks": [[0, 5], [5, 8]]}
    path.write_text(json.dumps(old) + "\n")
    index = _reopen(path, "line 1: no checksum \\(written by an older kvboost-rag\\)")
    assert len(index) == 0
    index.add(doc)
    assert path.read_bytes().endswith(encode_record(doc))


def test_a_lone_surrogate_in_a_text_round_trips(tmp_path):
    doc = _doc(3, text="A document with a lone surrogate \udc80 inside it, long enough to anchor.")
    DocumentIndex(_index_path(tmp_path)).add(doc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DocumentIndex(_index_path(tmp_path)).get(doc.text) == doc


# -- item 4: drift maps and document indexes are known kinds, never pruned -------------------------


def _maps(prompts: int = 3) -> drift.DriftMaps:
    g = torch.Generator().manual_seed(0)
    return drift.DriftMaps(torch.randn(2, 3, 2, 17, 16, generator=g), torch.randn(2, 3, 2, 17, 16, generator=g),
                           prompts)


@pytest.fixture
def store_folder(tmp_path, store_make_entry):
    """K/V files, a document index and drift maps, as an engine leaves them."""
    store = DiskStore(tmp_path, FP, kv_bits=8, group_size=16)
    for i in range(3):
        store.put(store_make_entry(i))
    store.close()
    _written_index(tmp_path)
    drift_path = tmp_path / f"drift-{DOCS_FP[:16]}.safetensors"
    write_atomic(drift_path, drift.to_bytes(_maps(), DOCS_FP))
    return store, drift_path


def test_verify_stats_and_prune_know_drift_maps_and_document_indexes(store_folder, capsys):
    store, drift_path = store_folder
    folder = store.directory
    report = verify_dir(folder)
    assert report.ok and report.drift_maps == [drift_path] and report.documents == {_index_path(folder): 3}
    assert len(report.good) == 3 and report.indexes == [store.index_path] and not report.unknown
    assert _cli("store", "verify", str(folder)) == 0
    out = capsys.readouterr().out
    assert "3 good, 0 bad" in out and "1 document indexes (3 intact records, 0 bad), 1 intact drift maps" in out
    assert _cli("store", "stats", str(folder), "--json") == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["unreadable"] == 0 and stats["files"] == 3
    assert (stats["drift_maps"], stats["document_indexes"], stats["documents"], stats["other_files"]) == (1, 1, 3, 0)
    assert _cli("store", "prune", str(folder), "--max-bytes", "0") == 0  # every K/V file goes, nothing else
    assert drift_path.exists() and _index_path(folder).exists() and not list_entry_files(folder)
    assert len(DocumentIndex(_index_path(folder))) == 3


def test_a_damaged_or_old_drift_map_is_bad(store_folder):
    _, drift_path = store_folder
    with safe_open(str(drift_path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(drift_path), metadata={**meta, "version": "1"})
    assert "refit" in verify_dir(drift_path.parent).bad[drift_path]
    save_file({"keys": torch.full((2, 3, 2, 17, 16), float("nan")), "values": tensors["values"]}, str(drift_path),
              metadata=meta)
    assert "NaN" in verify_dir(drift_path.parent).bad[drift_path]
    drift_path.write_bytes(drift_path.read_bytes()[:200])
    assert "unreadable" in verify_dir(drift_path.parent).bad[drift_path]
    prune_dir(drift_path.parent)
    assert not drift_path.exists()  # damaged: of no use to any engine


def test_verify_reports_every_kind_and_fails_only_on_bad_or_unknown(store_folder, capsys):
    store, _ = store_folder
    folder = store.directory
    (folder / "notes.txt").write_text("mine")
    (folder / "weights.safetensors").write_bytes(b"not ours")
    (folder / ".x.safetensors.1.abcd.tmp").write_bytes(b"partial")
    assert _cli("store", "verify", str(folder)) == 1
    out = capsys.readouterr().out
    assert "UNKNOWN notes.txt" in out and "UNKNOWN weights.safetensors" in out
    assert "TEMP .x.safetensors.1.abcd.tmp" in out
    assert "1 temp files, 2 unknown files" in out
    assert _cli("store", "prune", str(folder)) == 0
    assert (folder / "notes.txt").exists() and (folder / "weights.safetensors").exists()  # never removed
    (folder / "notes.txt").unlink()
    (folder / "weights.safetensors").unlink()
    assert _cli("store", "verify", str(folder)) == 0  # a temp file alone is known: no failure


# -- item 5: a read-only or full folder degrades to memory, with one warning ----------------------


def test_read_only_folder_with_the_index_missing(make_tiny_engine, docs, rag_prompt, tmp_path, monkeypatch):
    config = EngineConfig(store=StoreConfig(disk_dir=tmp_path))
    first = make_tiny_engine(config)
    first.ingest(docs[:2])
    first.close()
    next(tmp_path.glob("index-*.json")).unlink()
    with monkeypatch.context() as patch, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _read_only(patch, tmp_path)
        engine = make_tiny_engine(config)  # the index cannot be rewritten: not a failure
        engine.ingest(docs)
        assert engine.counters["documents_stored"] == 2 and engine.counters["documents_computed"] == 2
        engine.generate(rag_prompt(docs, "Who founded the company?"), max_new_tokens=2)
        engine.close()  # what `kvboost-rag ask` does after printing its answer
    (message,) = _store_warnings(record)
    assert str(tmp_path) in message and "Read-only file system" in message and "make it writable" in message
    # Writable again: the next write goes through, the documents held back with it.
    engine.ingest(["A document ingested once the folder was writable again, long enough to be anchored."])
    engine.close()
    reopened = make_tiny_engine(config)
    assert all(reopened.documents.get(d) is not None for d in docs) and len(reopened.documents) == len(docs) + 1
    assert next(tmp_path.glob("index-*.json")).exists()


def test_a_folder_that_cannot_be_made_degrades_and_is_made_later(tmp_path, store_make_entry, monkeypatch):
    folder = tmp_path / "store"
    entry = store_make_entry(1)
    with monkeypatch.context() as patch, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _read_only(patch, tmp_path)
        store = make_store(StoreConfig(disk_dir=folder), FP)
        store.put(entry)  # kept in memory
        store.close()
        DocumentIndex(folder / "documents-0123456789abcdef.jsonl").add(_doc(1))
    assert len(_store_warnings(record)) == 1 and store.get(entry.prefix_key) is not None
    store.put(store_make_entry(2))
    assert folder.is_dir() and store.disk.contains(store_make_entry(2).prefix_key)


def test_full_disk_mid_ingest_leaves_no_torn_line(make_tiny_engine, docs, rag_prompt, tmp_path, monkeypatch):
    config = EngineConfig(store=StoreConfig(disk_dir=tmp_path))
    first = make_tiny_engine(config)
    first.ingest(docs[:1])
    with monkeypatch.context() as patch, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _full_disk(patch, tmp_path)
        first.ingest(docs[1:])  # every write is cut short half way
        first.generate(rag_prompt(docs, "Who founded the company?"), max_new_tokens=2)
        first.close()
    (message,) = _store_warnings(record)
    assert "No space left on device" in message and str(tmp_path) in message
    index_file = next(tmp_path.glob("documents-*.jsonl"))
    assert index_file.read_bytes().endswith(b"\n") and index_file.read_bytes().count(b"\n") == 1  # rolled back
    assert not list(tmp_path.glob("*.tmp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreIntegrityWarning)
        second = make_tiny_engine(config)  # the next process opens it
    second.ingest(docs)
    assert second.counters["documents_computed"] == len(docs) - 1
    assert len(make_tiny_engine(config).documents) == len(docs)


def test_real_full_tmpfs_then_space_again(make_tiny_engine, docs, rag_prompt, tmpfs):
    config = EngineConfig(store=StoreConfig(disk_dir=tmpfs / "store"))
    filler = tmpfs / "filler"
    with open(filler, "wb") as f, pytest.raises(OSError, match="No space left"):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine = make_tiny_engine(config)
        engine.ingest(docs)
        engine.generate(rag_prompt(docs, "Who founded the company?"), max_new_tokens=2)
        engine.close()
    (message,) = _store_warnings(record)
    assert "No space left on device" in message
    filler.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreIntegrityWarning)
        again = make_tiny_engine(config)
    again.ingest(docs)
    again.close()
    assert verify_dir(tmpfs / "store").ok and len(make_tiny_engine(config).documents) == len(docs)


def test_real_read_only_remount_then_writable_again(make_tiny_engine, docs, rag_prompt, tmpfs):
    config = EngineConfig(store=StoreConfig(disk_dir=tmpfs / "store"))
    first = make_tiny_engine(config)
    first.ingest(docs[:2])
    first.close()
    next((tmpfs / "store").glob("index-*.json")).unlink()
    _remount(tmpfs, "ro")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            engine = make_tiny_engine(config)
            engine.ingest(docs)
            engine.generate(rag_prompt(docs, "Who founded the company?"), max_new_tokens=2)
            engine.close()
        (message,) = _store_warnings(record)
        assert "Read-only file system" in message
    finally:
        _remount(tmpfs, "rw")
    engine.ingest(["A document ingested once the folder was writable again, long enough to be anchored."])
    engine.close()
    assert len(make_tiny_engine(config).documents) == len(docs) + 1


# -- item 6: a misnamed file of ours is skipped, not a crash -------------------------------------


def test_a_file_of_ours_under_a_non_hex_name_is_skipped(tmp_path, store_make_entry):
    entry = store_make_entry(1)
    store = DiskStore(tmp_path, FP)
    store.put(entry)
    store.close()
    path = entry_path(tmp_path, entry.prefix_key)
    misnamed = tmp_path / f"zz{path.stem[2:]}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(misnamed), metadata={**meta, "prefix_key": misnamed.stem})
    path.unlink()
    store.index_path.unlink()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        reopened = DiskStore(tmp_path, FP)
        assert reopened.find_content(entry.content_key) is None  # was: ValueError from bytes.fromhex
    (message,) = [str(w.message) for w in record if issubclass(w.category, StoreIntegrityWarning)]
    assert str(misnamed) in message and "its name is not a prefix key" in message and "prune" in message
    assert "not a prefix key" in verify_dir(tmp_path).bad[misnamed]
    prune_dir(tmp_path)
    assert not misnamed.exists()


# -- item 7: temp files --------------------------------------------------------------------------


def test_temp_files_are_listed_and_only_left_over_ones_pruned(tmp_path, capsys):
    left_over, fresh, held = (tmp_path / f".a.safetensors.{n}.0000.tmp" for n in (1, 2, 3))
    for path in (left_over, fresh, held):
        path.write_bytes(b"partial")
    os.utime(left_over, (1e9, 1e9))
    os.utime(held, (1e9, 1e9))
    fd = os.open(held, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a writer still at it (write_atomic holds this lock until the rename)
    try:
        assert _cli("store", "verify", str(tmp_path)) == 0
        assert capsys.readouterr().out.count("TEMP ") == 3
        assert _cli("store", "stats", str(tmp_path), "--json") == 0
        assert json.loads(capsys.readouterr().out)["temp_files"] == 3
        report = prune_dir(tmp_path)
        assert report.removed == [(left_over, "stale temp file")]
        assert fresh.exists() and held.exists()
    finally:
        os.close(fd)
    assert prune_dir(tmp_path).removed == [(held, "stale temp file")]  # released: left over now


def test_prune_never_removes_the_temp_file_of_a_write_in_flight(tmp_path, monkeypatch):
    target = tmp_path / "index-0123456789abcdef.json"
    in_fsync, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd):
        in_fsync.set()
        release.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    writer = threading.Thread(target=write_atomic, args=(target, b"{}"))
    writer.start()
    try:
        assert in_fsync.wait(30)
        (temp,) = tmp_path.glob("*.tmp")
        assert prune_dir(tmp_path, temp_grace_s=0).removed == [] and temp.exists()
    finally:
        release.set()
        writer.join(30)
    assert target.read_bytes() == b"{}" and not list(tmp_path.glob("*.tmp"))


def test_a_killed_writers_temp_file_is_pruned(tmp_path):
    code = f"""
import os, signal, sys
sys.path[:0] = [{str(REPO)!r}]
from kvboost_rag.store import files
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # killed after writing, before the rename
files.write_atomic(files.Path({str(tmp_path)!r}) / "index-0123456789abcdef.json", b"{{}}")
"""
    done = subprocess.run([sys.executable, "-c", code], timeout=120)
    assert done.returncode == -9
    (temp,) = tmp_path.glob("*.tmp")
    assert verify_dir(tmp_path).temp_files == [temp]
    assert prune_dir(tmp_path, temp_grace_s=0).removed == [(temp, "stale temp file")] and not temp.exists()


# -- item 10: file permissions -------------------------------------------------------------------


@pytest.fixture
def open_umask():
    old = os.umask(0)  # the mode must be set explicitly, not left to the umask
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("file_mode, folder_mode", [(0o600, 0o700), (0o640, 0o750)])
def test_every_file_gets_the_configured_mode(tmp_path, store_make_entry, open_umask, file_mode, folder_mode):
    folder = tmp_path / "store"
    store = make_store(StoreConfig(disk_dir=folder, file_mode=file_mode), FP)
    store.put(store_make_entry(1))
    store.close()
    DocumentIndex(_index_path(folder), file_mode=file_mode).add(_doc(1))
    write_atomic(folder / f"drift-{DOCS_FP[:16]}.safetensors", drift.to_bytes(_maps(), DOCS_FP), file_mode)
    assert _mode(folder) == folder_mode
    files = list(folder.iterdir())
    assert len(files) == 4 and {p.name: _mode(p) for p in files} == {p.name: file_mode for p in files}


def test_defaults_are_owner_only(make_tiny_engine, docs, tmp_path, open_umask):
    engine = make_tiny_engine(EngineConfig(store=StoreConfig(disk_dir=tmp_path / "store")))
    engine.ingest(docs[:1])
    engine.close()
    engine.set_drift(_maps())  # the engine's own call
    assert _mode(tmp_path / "store") == 0o700
    assert {_mode(p) for p in (tmp_path / "store").iterdir()} == {0o600}


@pytest.mark.parametrize("bad", [0o400, 0o1777, 0o060])
def test_a_file_mode_that_locks_the_owner_out_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="owner read and write"):
        DiskStore(tmp_path, FP, file_mode=bad)
    with pytest.raises(ValueError, match="owner read and write"):
        DocumentIndex(tmp_path / "d.jsonl", file_mode=bad)


def test_tiered_store_warns_once_across_kv_and_index_writes(tmp_path, store_make_entry, monkeypatch):
    store = TieredStore(MemoryStore(), DiskStore(tmp_path, FP))
    with monkeypatch.context() as patch, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _read_only(patch, tmp_path)
        for i in range(3):
            store.put(store_make_entry(i))
        store.close()
    assert len(_store_warnings(record)) == 1 and len(store.memory) == 3
    store.put(store_make_entry(9))  # writable again
    assert store.disk.contains(store_make_entry(9).prefix_key)


def test_ask_on_a_read_only_store_answers_and_exits_0(make_tiny_engine, docs, tmpfs, monkeypatch, capsys):
    """The CLI as a user runs it: the store went read-only since it was filled; `ask` still answers, warns
    once, and exits 0 (it used to print its answer, then fail in close() with a traceback and exit 1)."""
    from kvboost_rag.cli import main as cli_main
    from kvboost_rag.engine import KVBoost

    monkeypatch.setattr(KVBoost, "from_pretrained", classmethod(lambda cls, *a, config=None: make_tiny_engine(config)))
    paths = []
    for i, text in enumerate(docs):
        paths.append(tmpfs / f"doc{i}.txt")
        paths[-1].write_text(text)
    store = tmpfs / "store"
    argv = ["ask", "Who founded the company?", "--docs", *map(str, paths), "--store", str(store),
            "--max-new-tokens", "2"]
    assert cli_main(argv) == 0
    _remount(tmpfs, "ro")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            # Another ingestion context: another fingerprint, so its index does not exist and cannot be made.
            assert cli_main(argv[:3] + [*map(str, paths), "--store", str(store), "--max-new-tokens", "2",
                                        "--doc-context", "none"]) == 0
        assert len(_store_warnings(record)) == 1
    finally:
        _remount(tmpfs, "rw")
    assert "[cacheblend]" in capsys.readouterr().out
