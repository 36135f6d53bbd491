"""DiskStore (files checked on every read), TieredStore and the `store` CLI."""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

from kvboost_rag.cli import store as store_cli
from kvboost_rag.config import StoreConfig
from kvboost_rag.store.disk import DiskStore, StoreIntegrityWarning, entry_path
from kvboost_rag.store.folder import prune_dir, verify_dir
from kvboost_rag.store.memory import MemoryStore
from kvboost_rag.store.quant import decode_entry, encode_entry
from kvboost_rag.store.tiered import TieredStore, make_store

FP = "model-A"
REPO = Path(__file__).resolve().parents[2]


def _expected(entry, bits, group=16):
    """What any tier must return for `entry`: its stored form, decoded (quantization is deterministic)."""
    return decode_entry(encode_entry(entry, bits, group))


def _assert_same(got, want):
    assert got is not None
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert got.keys.dtype == want.keys.dtype
    assert (got.token_ids, got.start, got.prefix_key, got.content_key) == (
        want.token_ids,
        want.start,
        want.prefix_key,
        want.content_key,
    )


def _read_bad(store, prefix_key, match):
    with pytest.warns(StoreIntegrityWarning, match=match) as record:
        assert store.get(prefix_key) is None
    message = str(record[0].message)
    assert entry_path(store.directory, prefix_key).name in message and "prune" in message


def _rewrite_metadata(path, **changes):
    """Re-save a file with edited metadata and its old checksum (what a foreign writer might leave)."""
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(path), metadata={**meta, **changes})


# -- round trips and restarts ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_round_trip_and_file_layout(tmp_path, store_make_entry, bits):
    store = DiskStore(tmp_path, FP, kv_bits=bits, group_size=16)
    entry = store_make_entry(1, dtype=torch.bfloat16, start=11)
    store.put(entry)
    _assert_same(store.get(entry.prefix_key), _expected(entry, bits))
    path = tmp_path / f"{entry.prefix_key.hex()}.safetensors"
    assert store.contains(entry.prefix_key) and path.is_file()
    assert not list(tmp_path.glob(".*.tmp"))  # the temp file was renamed, not left behind
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the store holds documents: owner only by default
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["fingerprint"] == FP and meta["kv_bits"] == str(bits) and meta["start"] == "11"
    assert meta["content_key"] == entry.content_key.hex() and len(meta["checksum"]) == 32
    assert store.get(b"\1" * 16) is None


def test_restart_in_a_new_instance(tmp_path, store_make_entry):
    entries = [store_make_entry(i, content=i % 2) for i in range(4)]
    first = DiskStore(tmp_path, FP, kv_bits=8, group_size=16)
    for e in entries:
        first.put(e)
    first.remove(entries[3].prefix_key)
    first.close()
    index = json.loads(first.index_path.read_text())
    assert sorted(index["content"][entries[0].content_key.hex()]) == sorted(
        [entries[0].prefix_key.hex(), entries[2].prefix_key.hex()]
    )
    second = DiskStore(tmp_path, FP, kv_bits=8, group_size=16)
    for e in entries[:3]:
        _assert_same(second.get(e.prefix_key), _expected(e, 8))
    assert second.get(entries[3].prefix_key) is None
    assert second.find_content(entries[1].content_key).prefix_key == entries[1].prefix_key


def test_restart_in_another_process(tmp_path, store_make_entry):
    # The writer never closes its store, so the index is incomplete: the reader must scan the files.
    code = f"""
import sys
sys.path[:0] = [{str(REPO)!r}, {str(Path(__file__).parent)!r}]
import torch
from conftest import _make_entry
from kvboost_rag.store.disk import DiskStore
store = DiskStore({str(tmp_path)!r}, {FP!r}, kv_bits=4, group_size=16)
for i in range(3):
    store.put(_make_entry(i, dtype=torch.bfloat16))
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    store = DiskStore(tmp_path, FP, kv_bits=4, group_size=16)
    for i in range(3):
        entry = store_make_entry(i, dtype=torch.bfloat16)
        _assert_same(store.get(entry.prefix_key), _expected(entry, 4))
        _assert_same(store.find_content(entry.content_key), _expected(entry, 4))


# -- faults: each is detected, warned about, and answered with None (or recovered) -----------------


@pytest.fixture
def store_disk_with_entry(tmp_path, store_make_entry):
    store = DiskStore(tmp_path, FP, kv_bits=4, group_size=16)
    entry = store_make_entry(1)
    store.put(entry)
    return store, entry, entry_path(tmp_path, entry.prefix_key)


def test_truncated_file(store_disk_with_entry):
    store, entry, path = store_disk_with_entry
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _read_bad(store, entry.prefix_key, "unreadable")
    # No longer `contains`, so an engine that checks before computing recomputes and puts it back ...
    assert not store.contains(entry.prefix_key)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ... and a second read of the same bad file does not warn again
        assert store.get(entry.prefix_key) is None
    store.put(entry)  # healed
    assert store.contains(entry.prefix_key)
    _assert_same(store.get(entry.prefix_key), _expected(entry, 4))


def test_flipped_tensor_bytes(store_disk_with_entry):
    store, entry, path = store_disk_with_entry
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    data[-41] ^= 0x01
    path.write_bytes(bytes(data))
    _read_bad(store, entry.prefix_key, "checksum")


def test_edited_metadata(store_disk_with_entry):
    store, entry, path = store_disk_with_entry
    data = path.read_bytes()
    assert data.count(b'"start":"0"') == 1
    path.write_bytes(data.replace(b'"start":"0"', b'"start":"9"'))  # same length: still parses
    _read_bad(store, entry.prefix_key, "checksum")


def test_file_from_another_fingerprint(tmp_path, store_make_entry):
    entry = store_make_entry(1)
    other = DiskStore(tmp_path / "other", "model-B", kv_bits=4, group_size=16)
    other.put(entry)
    mine = DiskStore(tmp_path / "mine", FP, kv_bits=4, group_size=16)
    shutil.copy(entry_path(other.directory, entry.prefix_key), entry_path(mine.directory, entry.prefix_key))
    _read_bad(mine, entry.prefix_key, "fingerprint 'model-B'")


def test_file_under_another_entrys_name(store_disk_with_entry, store_make_entry):
    store, entry, path = store_disk_with_entry
    victim = store_make_entry(2)
    shutil.copy(path, entry_path(store.directory, victim.prefix_key))
    _read_bad(store, victim.prefix_key, "prefix key")


def test_other_format_version(store_disk_with_entry):
    store, entry, path = store_disk_with_entry
    _rewrite_metadata(path, format_version="2")
    _read_bad(store, entry.prefix_key, "format version")


def test_deleted_index_is_rebuilt(tmp_path, store_make_entry):
    entries = [store_make_entry(i) for i in range(3)]
    store = DiskStore(tmp_path, FP)
    for e in entries:
        store.put(e)
    store.close()
    store.index_path.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing index is not worth a warning
        reopened = DiskStore(tmp_path, FP)
    assert reopened.index_path.exists()
    for e in entries:
        _assert_same(reopened.find_content(e.content_key), e)


def test_corrupt_index_warns_and_is_rebuilt(tmp_path, store_make_entry):
    entry = store_make_entry(1)
    store = DiskStore(tmp_path, FP)
    store.put(entry)
    store.close()
    store.index_path.write_text('{"format_version": 1, "content": [')
    with pytest.warns(StoreIntegrityWarning, match="rebuilding"):
        reopened = DiskStore(tmp_path, FP)
    _assert_same(reopened.find_content(entry.content_key), entry)
    assert json.loads(reopened.index_path.read_text())["content"]


def test_stale_index_and_a_bad_candidate(tmp_path, store_make_entry):
    a, b, c = (store_make_entry(i, content=5) for i in range(3))  # one text, three contexts
    store = DiskStore(tmp_path, FP, index_flush_every=1)
    for e in (a, b, c):
        store.put(e)
    os.utime(entry_path(tmp_path, c.prefix_key), (1e9, 1e9))  # c: the least recently used, tried last
    entry_path(tmp_path, a.prefix_key).unlink()  # gone behind the index's back
    entry_path(tmp_path, b.prefix_key).write_bytes(b"garbage")
    with pytest.warns(StoreIntegrityWarning, match="unreadable"):
        _assert_same(store.find_content(a.content_key), c)  # skips the missing and the bad one
    reopened = DiskStore(tmp_path, FP)  # a's entry is dropped; b stays indexed, its damage found on read
    assert reopened.stats()["entries"] == 2


def test_threads_share_a_directory(tmp_path, store_make_entry):
    entries = [store_make_entry(i, content=i % 3) for i in range(6)]
    expected = {e.prefix_key: _expected(e, 8) for e in entries}
    stores = [DiskStore(tmp_path, FP, kv_bits=8, group_size=16) for _ in range(2)]
    errors = []

    def worker(k):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", StoreIntegrityWarning)
                for step in range(12):
                    e = entries[(k + step) % len(entries)]
                    store = stores[step % 2]
                    store.put(e)
                    got = store.get(entries[(k * step) % len(entries)].prefix_key)
                    if got is not None:
                        _assert_same(got, expected[got.prefix_key])
                    found = store.find_content(e.content_key)
                    assert found is not None and found.content_key == e.content_key
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert verify_dir(tmp_path, FP).ok and len(verify_dir(tmp_path, FP).good) == len(entries)


# -- verify and prune ---------------------------------------------------------------------------


@pytest.fixture
def store_messy_dir(tmp_path, store_make_entry):
    """Three good files (oldest first), one truncated, one foreign, one stale temp file."""
    store = DiskStore(tmp_path, FP, kv_bits=8, group_size=16)
    good = [store_make_entry(i) for i in range(3)]
    for age, e in zip((300, 200, 100), good, strict=True):
        store.put(e)
        os.utime(entry_path(tmp_path, e.prefix_key), (1e9 - age, 1e9 - age))
    bad = store_make_entry(10)
    store.put(bad)
    path = entry_path(tmp_path, bad.prefix_key)
    path.write_bytes(path.read_bytes()[:100])
    DiskStore(tmp_path, "model-B").put(store_make_entry(20))
    temp = tmp_path / ".x.safetensors.123.tmp"
    temp.write_bytes(b"partial")
    os.utime(temp, (1e9, 1e9))
    return store, good, bad


def test_verify_reports_good_bad_and_foreign(store_messy_dir):
    store, good, bad = store_messy_dir
    report = store.verify()
    assert sorted(report.good) == sorted(entry_path(store.directory, e.prefix_key) for e in good)
    assert list(report.bad) == [entry_path(store.directory, bad.prefix_key)] and not report.ok
    assert len(report.foreign) == 1 and report.fingerprints == {FP: 3, "model-B": 1}
    assert len(report.temp_files) == 1
    anyone = verify_dir(store.directory)  # no fingerprint: every intact file is good
    assert len(anyone.good) == 4 and not anyone.foreign


def test_prune_removes_bad_then_lru_to_fit(store_messy_dir):
    store, good, bad = store_messy_dir
    sizes = [entry_path(store.directory, e.prefix_key).stat().st_size for e in good]
    foreign_size = verify_dir(store.directory).fingerprints and sum(
        p.stat().st_size for p in store.verify().foreign
    )
    dry = prune_dir(store.directory, FP, max_bytes=sizes[2] + foreign_size, dry_run=True)
    assert len(dry.removed) == 4 and entry_path(store.directory, bad.prefix_key).exists()
    report = store.prune(max_bytes=sizes[2] + foreign_size)  # room for the newest good file only
    removed = {p.name: why for p, why in report.removed}
    assert removed[entry_path(store.directory, bad.prefix_key).name].startswith("damaged")
    assert removed[".x.safetensors.123.tmp"] == "stale temp file"
    assert {entry_path(store.directory, e.prefix_key).name for e in good[:2]} <= removed.keys()
    assert store.contains(good[2].prefix_key) and report.kept_files == 2  # the newest, and the foreign one
    assert store.verify().ok and store.find_content(good[0].content_key) is None
    report = prune_dir(store.directory, FP, remove_foreign=True)
    assert [why for _, why in report.removed] == ["written for another model fingerprint"]


def test_prune_by_age(store_messy_dir):
    store, good, _ = store_messy_dir
    store.get(good[0].prefix_key)  # a read makes it recent again
    report = prune_dir(store.directory, FP, max_age_s=3600)
    gone = {p.name for p, why in report.removed if why.startswith("unused")}
    assert gone == {entry_path(store.directory, e.prefix_key).name for e in good[1:]}


# -- the tiered store ---------------------------------------------------------------------------


def test_tiered_write_through_eviction_and_promotion(tmp_path, store_make_entry):
    a, b = store_make_entry(1), store_make_entry(2)
    size = encode_entry(a, 4, 16).nbytes
    store = TieredStore(MemoryStore(size, kv_bits=4, group_size=16), DiskStore(tmp_path, FP, kv_bits=4))
    store.put(a)
    store.put(b)  # evicts a from memory; it is on disk already
    assert not store.memory.contains(a.prefix_key) and store.disk.contains(a.prefix_key)
    _assert_same(store.get(a.prefix_key), _expected(a, 4))  # from disk, bit-identical, not re-quantized
    assert store.memory.contains(a.prefix_key)  # promoted
    _assert_same(store.find_content(b.content_key), _expected(b, 4))  # b was evicted by the promotion
    assert store.stats()["disk"]["hits"] == 2 and store.nbytes <= size
    store.remove(a.prefix_key)
    assert not store.contains(a.prefix_key)
    with pytest.raises(ValueError, match="pin"):
        store.put(store_make_entry(3, S=100), pin=True)
    assert not store.disk.contains(store_make_entry(3, S=100).prefix_key)  # nothing written on failure


def test_tiered_survives_a_failing_disk(tmp_path, store_make_entry, monkeypatch):
    store = TieredStore(MemoryStore(), DiskStore(tmp_path, FP))

    def full(_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.disk, "put_stored", full)
    with pytest.warns(RuntimeWarning, match="No space left"):
        store.put(store_make_entry(1))
    store.put(store_make_entry(2))  # logged, not warned again
    assert len(store.memory) == 2


def test_make_store(tmp_path, store_make_entry):
    store = make_store(
        StoreConfig(memory_budget_bytes=10**6, disk_dir=tmp_path, kv_bits=8, group_size=16), FP
    )
    entry = store_make_entry(1)
    store.put(entry)
    assert isinstance(store, TieredStore) and store.disk.contains(entry.prefix_key)
    assert make_store(StoreConfig(), FP).disk is None
    with pytest.raises(ValueError, match="kv_bits"):
        make_store(StoreConfig(kv_bits=3), FP)


# -- the CLI ------------------------------------------------------------------------------------


def _cli(*argv):
    parser = argparse.ArgumentParser(prog="kvboost-rag")
    store_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_stats_verify_prune(store_messy_dir, capsys):
    store, good, bad = store_messy_dir
    d = str(store.directory)
    assert _cli("store", "stats", d, "--json") == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["files"] == 5 and stats["unreadable"] == 1 and stats["fingerprints"][FP]["files"] == 3
    assert stats["fingerprints"][FP]["tokens"] == 3 * 37
    assert _cli("store", "verify", d) == 1
    out = capsys.readouterr().out
    assert "3 good, 1 bad" not in out and "4 good, 1 bad" in out and "model-B" in out  # no fingerprint given
    assert _cli("store", "verify", d, "--fingerprint", FP) == 1
    out = capsys.readouterr().out
    assert "3 good, 1 bad, 1 foreign" in out and "2 store indexes, 1 temp files, 0 unknown files" in out
    assert "TEMP .x.safetensors.123.tmp" in out
    assert _cli("store", "prune", d, "--dry-run") == 0
    assert "would remove" in capsys.readouterr().out and entry_path(store.directory, bad.prefix_key).exists()
    assert _cli("store", "prune", d, "--max-bytes", "1G") == 0
    capsys.readouterr()
    assert _cli("store", "verify", d) == 0
    assert _cli("store", "prune", d, "--remove-foreign") == 2  # needs --fingerprint
    assert _cli("store", "stats", str(store.directory / "nope")) == 2


def test_cli_parse_size():
    assert store_cli.parse_size("500M") == 500 * 1024**2
    assert store_cli.parse_size("2GiB") == 2 * 1024**3
    assert store_cli.parse_size("1234") == 1234
    with pytest.raises(argparse.ArgumentTypeError):
        store_cli.parse_size("lots")
