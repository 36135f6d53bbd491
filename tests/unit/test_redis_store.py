"""RedisStore (the shared tier) against a real redis-server: round trips, sharing between stores, engines and
processes, values that must not be served, and a server that goes away; the document index shared through it
(RedisDocuments): what a fresh engine finds without ingesting, records that must not be used, eviction, an
outage; and the corpus's calibration shared through it (drift maps, fidelity predictor)."""

from __future__ import annotations

import ast
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import redis
import safetensors.torch
import torch
from test_fidelity import corpus

from kvboost_rag import EngineConfig, StoreConfig, drift, fidelity
from kvboost_rag import calibrate as calibration
from kvboost_rag.assembly import APPROX, EXACT
from kvboost_rag.chunking import Chunk
from kvboost_rag.config import ConfigError
from kvboost_rag.drift import DriftMaps
from kvboost_rag.keys import content_key
from kvboost_rag.store.documents import Document, DocumentIndex, encode_record
from kvboost_rag.store.entries import StoreIntegrityWarning, entry_bytes
from kvboost_rag.store.files import safetensors_metadata, write_atomic
from kvboost_rag.store.memory import MemoryStore
from kvboost_rag.store.quant import StoredEntry, encode_entry
from kvboost_rag.store.redis import RedisStore, StoreUnavailableWarning
from kvboost_rag.store.redis_documents import RedisDocuments
from kvboost_rag.store.tiered import TieredStore, make_index, make_store

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
FP = "0123456789abcdef" + "a" * 16  # an engine's fingerprint is hex; keys use its first 16 characters
FOREIGN_FP = "0123456789abcdef" + "b" * 16  # another model whose keys share the namespace
REPO = Path(__file__).resolve().parents[2]


# -- a redis-server of our own ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(folder: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A redis-server on 127.0.0.1 that persists nothing, and its URL, once it answers PING."""
    if not Path(REDIS_SERVER).is_file():
        pytest.skip(f"redis-server is not installed ({REDIS_SERVER} missing), so the Redis tier is not tested")
    for _ in range(3):  # a free port may be taken before the server binds it: try another
        chosen = port or _free_port()
        proc = subprocess.Popen(
            [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(chosen), "--save", "", "--appendonly", "no",
             "--dir", str(folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{chosen}/0"
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                client.close()
                return proc, url
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        _stop(proc)
    raise RuntimeError(f"could not start {REDIS_SERVER}")


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    proc, url = _start_server(tmp_path_factory.mktemp("redis"))
    yield url
    _stop(proc)


@pytest.fixture
def redis_url(redis_server):
    """The shared server's URL, emptied before each test."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server


@pytest.fixture
def raw(redis_url):
    """A plain client: what a redis-cli user (or another program) can do to the values."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _expected(entry, bits, group=16):
    """What any tier must return for `entry`: its stored form, decoded (what MemoryStore returns)."""
    memory = MemoryStore(kv_bits=bits, group_size=group)
    memory.put(entry)
    return memory.get(entry.prefix_key)


def _assert_same(got, want):
    assert got is not None
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert got.keys.dtype == want.keys.dtype
    assert (got.token_ids, got.start, got.prefix_key, got.content_key) == (
        want.token_ids, want.start, want.prefix_key, want.content_key)


# -- round trips and sharing ------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_round_trip_equals_memory(redis_url, raw, store_make_entry, bits):
    store = RedisStore(redis_url, FP, kv_bits=bits, group_size=16)
    entry = store_make_entry(1, dtype=torch.bfloat16, start=11)
    assert not store.contains(entry.prefix_key) and store.get(entry.prefix_key) is None
    store.put(entry)
    assert store.contains(entry.prefix_key)
    _assert_same(store.get(entry.prefix_key), _expected(entry, bits))
    _assert_same(store.find_content(entry.content_key), _expected(entry, bits))
    # The layout other tools see: the entry under its prefix key, a pointer under its content key.
    assert raw.exists(f"kvboost:{FP[:16]}:p:{entry.prefix_key.hex()}")
    assert raw.get(f"kvboost:{FP[:16]}:c:{entry.content_key.hex()}") == entry.prefix_key.hex().encode()
    assert store.stats()["hits"] == 2 and store.stats()["writes"] == 1


def test_find_content_and_a_missing_target(redis_url, raw, store_make_entry):
    store = RedisStore(redis_url, FP, kv_bits=8, group_size=16)
    first, second = store_make_entry(1, content=7), store_make_entry(2, content=7)  # same tokens' key, two contexts
    store.put(first)
    store.put(second)
    found = store.find_content(first.content_key)
    assert found.content_key == first.content_key and found.prefix_key == second.prefix_key  # the last put
    assert store.find_content(store_make_entry(3).content_key) is None
    # Evicted by maxmemory (or removed): the pointer leads nowhere, which is a miss, not an error; it is dropped.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raw.delete(store.entry_key(second.prefix_key))
        assert store.find_content(first.content_key) is None
    assert not raw.exists(store.pointer_key(first.content_key))
    assert store.contains(first.prefix_key)  # the other context is still there, by its prefix key
    store.remove(first.prefix_key)
    assert not store.contains(first.prefix_key) and store.get(first.prefix_key) is None


def test_two_stores_share_entries(redis_url, store_make_entry):
    writer = RedisStore(redis_url, FP, kv_bits=4, group_size=16)
    reader = RedisStore(redis_url, FP, kv_bits=16)  # written at 4 bits: served at 4 bits, as stored
    entries = [store_make_entry(i) for i in range(3)]
    for entry in entries:
        writer.put(entry)
    for entry in entries:
        assert reader.contains(entry.prefix_key)
        _assert_same(reader.get(entry.prefix_key), _expected(entry, 4))
        _assert_same(reader.find_content(entry.content_key), _expected(entry, 4))
    assert RedisStore(redis_url, "f" * 32).contains(entries[0].prefix_key) is False  # another model's namespace


def test_another_process_writes_and_this_one_reads(redis_url, store_make_entry):
    code = f"""
import sys
sys.path[:0] = [{str(REPO)!r}, {str(Path(__file__).parent)!r}]
import torch
from conftest import _make_entry
from kvboost_rag.store.redis import RedisStore
store = RedisStore({redis_url!r}, {FP!r}, kv_bits=4, group_size=16)
for i in range(3):
    store.put(_make_entry(i, dtype=torch.bfloat16))
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    store = RedisStore(redis_url, FP, kv_bits=4, group_size=16)
    for i in range(3):
        entry = store_make_entry(i, dtype=torch.bfloat16)
        _assert_same(store.get(entry.prefix_key), _expected(entry, 4))
        _assert_same(store.find_content(entry.content_key), _expected(entry, 4))


def test_threads_share_one_store(redis_url, store_make_entry):
    store = RedisStore(redis_url, FP, kv_bits=8, group_size=16)
    entries = [store_make_entry(i, S=9) for i in range(24)]
    errors = []

    def work(part):
        try:
            for entry in part:
                store.put(entry)
                _assert_same(store.get(entry.prefix_key), _expected(entry, 8))
                assert store.find_content(entry.content_key) is not None
        except Exception as e:  # reported below: an assertion in a thread would be lost
            errors.append(e)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads = [threading.Thread(target=work, args=(entries[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and store.stats()["writes"] == 24


# -- values that must not be served ------------------------------------------------------------------


def test_a_foreign_fingerprint_is_never_served(redis_url, raw, store_make_entry):
    entry = store_make_entry(1)
    RedisStore(redis_url, FOREIGN_FP).put(entry)  # same namespace, another model: only the value's header tells
    store = RedisStore(redis_url, FP)
    with pytest.warns(StoreIntegrityWarning, match="fingerprint") as record:
        assert store.get(entry.prefix_key) is None
    assert store.entry_key(entry.prefix_key) in str(record[0].message)
    assert not raw.exists(store.entry_key(entry.prefix_key)) and not store.contains(entry.prefix_key)
    assert store.find_content(entry.content_key) is None  # its pointer now leads nowhere
    store.put(entry)
    _assert_same(store.get(entry.prefix_key), _expected(entry, 16))


def _truncate(value, raw, key):
    raw.set(key, value[: len(value) // 2])


def _flip_last_bytes(value, raw, key):
    raw.setrange(key, len(value) - 3, bytes(b ^ 0xFF for b in value[-3:]))  # tensor bytes, not the header


def _garbage(value, raw, key):
    raw.set(key, b"not a kv entry")


def _empty(value, raw, key):
    raw.set(key, b"")


@pytest.mark.parametrize(("damage", "problem"), [
    (_truncate, "unreadable"), (_flip_last_bytes, "checksum"), (_garbage, "unreadable"), (_empty, "unreadable"),
])
def test_a_damaged_value_is_a_miss_warned_and_deleted(redis_url, raw, store_make_entry, damage, problem):
    store = RedisStore(redis_url, FP, kv_bits=4, group_size=16)
    entry = store_make_entry(1)
    store.put(entry)
    key = store.entry_key(entry.prefix_key)
    damage(raw.get(key), raw, key)
    with pytest.warns(StoreIntegrityWarning, match=problem) as record:
        assert store.get(entry.prefix_key) is None
    assert len(record) == 1 and key in str(record[0].message) and "recomputed" in str(record[0].message)
    assert not raw.exists(key) and not store.contains(entry.prefix_key)
    store.put(entry)  # healed
    _assert_same(store.get(entry.prefix_key), _expected(entry, 4))
    assert store.stats()["bad"] == 1


def test_inconsistent_values_are_not_served(redis_url, raw, store_make_entry):
    store = RedisStore(redis_url, FP, group_size=16)
    a, b, c = store_make_entry(1), store_make_entry(2), store_make_entry(3)
    for entry in (a, b):
        store.put(entry)
    # b's value under a's key (prefix key mismatch), c's value with a token id short (a checksum that fits)
    raw.set(store.entry_key(a.prefix_key), raw.get(store.entry_key(b.prefix_key)))
    stored = encode_entry(c, 16, 16)
    short = StoredEntry(stored.token_ids[:-1], stored.start, stored.prefix_key, stored.content_key, stored.dtype,
                        raw=stored.raw)
    raw.set(store.entry_key(c.prefix_key), entry_bytes(short, FP))
    with pytest.warns(StoreIntegrityWarning, match="prefix key"):
        assert store.get(a.prefix_key) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warned once per store; the rest are logged
        assert store.get(c.prefix_key) is None
    assert not raw.exists(store.entry_key(a.prefix_key)) and not raw.exists(store.entry_key(c.prefix_key))
    # A pointer that is no prefix key, or leads to an entry with other tokens, is dropped as well.
    raw.set(store.pointer_key(a.content_key), b"\xffnot hex")
    raw.set(store.pointer_key(c.content_key), b.prefix_key.hex())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert store.find_content(a.content_key) is None and store.find_content(c.content_key) is None
    assert not raw.exists(store.pointer_key(a.content_key)) and not raw.exists(store.pointer_key(c.content_key))
    assert store.stats()["bad"] == 4
    _assert_same(store.get(b.prefix_key), _expected(b, 16))  # its own key still serves it


# -- a server that goes away ------------------------------------------------------------------------


def test_a_killed_server_is_a_miss_and_a_skipped_write(tmp_path, store_make_entry):
    proc, url = _start_server(tmp_path)
    try:
        store = TieredStore(MemoryStore(kv_bits=8, group_size=16), redis=RedisStore(url, FP, kv_bits=8, group_size=16))
        a, b = store_make_entry(1), store_make_entry(2)
        store.put(a)
        _stop(proc)
        started = time.monotonic()
        with pytest.warns(StoreUnavailableWarning, match="cannot read from the Redis store") as record:
            assert store.redis.get(a.prefix_key) is None
            store.put(b)  # in memory; Redis skipped; logged, not warned again
            assert not store.redis.contains(b.prefix_key)
            assert store.find_content(store_make_entry(3).content_key) is None
            _assert_same(store.get(b.prefix_key), _expected(b, 8))  # the request goes on from memory
            store.remove(a.prefix_key)
        assert len(record) == 1 and url in str(record[0].message)
        assert time.monotonic() - started < 5  # refused connections fail fast, without backoff
        assert store.redis.stats()["errors"] >= 4
        # Back up (empty: it kept nothing): writes go through again, and a later outage warns again.
        proc, _ = _start_server(tmp_path, port=int(url.rsplit(":", 1)[1].split("/")[0]))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            store.put(b)
            assert store.redis.contains(b.prefix_key)
        _stop(proc)
        with pytest.warns(StoreUnavailableWarning, match="cannot write to the Redis store"):
            store.put(a)
    finally:
        if proc.poll() is None:
            _stop(proc)


# -- wiring: config, tiers, engines -------------------------------------------------------------------


def test_config_checks_the_url():
    for url in ("redis://localhost:6379/0", "rediss://cache:6380", "unix:///run/redis.sock"):
        assert StoreConfig(redis_url=url).redis_url == url
    for bad in ("localhost:6379", "http://localhost:6379", 6379):
        with pytest.raises(ConfigError, match="redis://host:6379/0") as info:
            StoreConfig(redis_url=bad)
        assert info.value.field == "redis_url"
    store = RedisStore("redis://kv:secret@127.0.0.1:1/0", FP)  # made without connecting; messages hide the password
    assert store.url == "redis://kv:***@127.0.0.1:1/0" and "secret" not in str(store.stats())


def test_make_store_puts_redis_behind_memory_and_disk(redis_url, tmp_path, store_make_entry):
    config = StoreConfig(disk_dir=tmp_path / "a", redis_url=redis_url, kv_bits=8, group_size=16)
    store = make_store(config, FP)
    assert store.behind == [store.disk, store.redis]
    entry = store_make_entry(1)
    store.put(entry)  # write-through: every tier has it
    assert store.memory.contains(entry.prefix_key) and store.disk.contains(entry.prefix_key)
    assert store.redis.contains(entry.prefix_key)
    # Another machine: its own memory and disk, the same Redis. A hit is promoted into both.
    other = make_store(StoreConfig(disk_dir=tmp_path / "b", redis_url=redis_url, kv_bits=8, group_size=16), FP)
    _assert_same(other.find_content(entry.content_key), _expected(entry, 8))
    assert other.memory.contains(entry.prefix_key) and other.disk.contains(entry.prefix_key)
    assert other.stats()["redis"]["hits"] == 1
    other.memory.remove(entry.prefix_key)
    _assert_same(other.get(entry.prefix_key), _expected(entry, 8))  # from disk now
    assert other.stats()["disk"]["hits"] == 1 and other.stats()["redis"]["hits"] == 1
    assert make_store(StoreConfig(), FP).redis is None


def test_without_the_redis_client(monkeypatch):
    # Nothing imports the client when kvboost_rag.store is imported: only a RedisStore being made does.
    module = ast.parse((REPO / "kvboost_rag" / "store" / "redis.py").read_text())
    top_level = [node for stmt in module.body for node in ast.walk(stmt)
                 if isinstance(node, (ast.Import, ast.ImportFrom)) and not _inside_function(stmt, node)]
    imported = {alias.name for node in top_level if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in top_level if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert not {name for name in imported if name == "redis" or name.startswith("redis.")}
    monkeypatch.setitem(sys.modules, "redis", None)  # what `import redis` does when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'kvboost-rag\[redis\]'"):
        RedisStore("redis://localhost:6379/0", FP)
    assert make_store(StoreConfig(), FP).redis is None  # everything else works without it


def _inside_function(stmt: ast.stmt, node: ast.AST) -> bool:
    return any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in ast.walk(f) for f in ast.walk(stmt))


@pytest.mark.parametrize("strategy", ["naive", "cacheblend"])
def test_engines_share_documents_through_redis(redis_url, make_tiny_engine, docs, rag_prompt, strategy):
    config = EngineConfig(store=StoreConfig(redis_url=redis_url))
    prompt = rag_prompt(docs, "Who founded the brewery?")
    first = make_tiny_engine(config)
    first.ingest(docs)
    want = first.prefill(prompt, strategy, write_back=False)
    # Another process: fresh memory, the same Redis. Its ingest finds every chunk stored and computes none.
    second = make_tiny_engine(config)
    assert second.fingerprint == first.fingerprint and len(second.store.memory) == 0
    second.ingest(docs)
    assert second.counters["documents_stored"] == len(docs) and second.counters["documents_computed"] == 0
    assert len(second.store.memory) == 0  # contains() asked Redis; nothing was read yet
    got = second.prefill(prompt, strategy, write_back=False)
    assert got.reused_tokens == want.reused_tokens > 0
    assert torch.equal(got.logits, want.logits)
    assert second.store.stats()["redis"]["hits"] > 0


# -- the document index, shared ------------------------------------------------------------------------

DOCS_KEY = f"kvboost:{FP[:16]}:documents"
NEW_DOC = ("The Orsund ferry crosses the strait between Kelby and Farnholm four times a day. It carries 300 "
           "passengers and 60 cars, and the crossing takes fifty minutes in calm weather.")


def _doc(i: int, fp: str = FP) -> Document:
    """A document whose id is its tokens' content key under `fp`, as an engine makes it."""
    tokens = tuple(range(100 * i, 100 * i + 40 + i))
    return Document(content_key(fp, tokens).hex(), f"Document {i}: " + "words of some length " * 3, tokens,
                    (Chunk(0, 20), Chunk(20, len(tokens))))


def _shared_index(url: str, fp: str = FP, path: Path | None = None) -> DocumentIndex:
    return DocumentIndex(path, shared=RedisDocuments(RedisStore(url, fp), fp))


def _commands(index: DocumentIndex) -> list[str]:
    """The names of the commands `index` sends to Redis from now on (pipelines aside)."""
    client, sent = index._shared._client, []
    send = client.execute_command

    def counted(*args, **options):
        sent.append(str(args[0]).upper())
        return send(*args, **options)

    client.execute_command = counted
    return sent


def test_indexes_share_documents_through_redis(redis_url, raw):
    first = _shared_index(redis_url)
    for i in (0, 1):
        first.add(_doc(i))
    # The layout other tools see: each record as the index file's line, a version, a log of what came when.
    assert raw.hget(DOCS_KEY, _doc(0).doc_id) == encode_record(_doc(0))
    assert raw.hget(DOCS_KEY, "version") == b"2" and raw.hget(DOCS_KEY, "#2") == _doc(1).doc_id.encode()
    second = _shared_index(redis_url)  # another process, which ingested nothing: it knows both at once
    assert len(second) == 2 and second.get(_doc(0).text) == _doc(0) and second.get(_doc(1).text) == _doc(1)
    # Nothing new: one lookup costs one round trip, whatever the corpus.
    sent = _commands(second)
    assert second.find(f"x {_doc(0).text} y")[0].document == _doc(0) and sent == ["HMGET"]
    # A document added later is found by the next lookup: the version moved, the log says which record to read.
    first.add(_doc(2))
    assert second.get(_doc(2).text) is None
    spans = second.find(f"{_doc(1).text} and {_doc(2).text}")
    assert [span.document for span in spans] == [_doc(1), _doc(2)] and sent.count("HKEYS") == 0
    # The same record again costs nothing: no version bump, nobody reads anything.
    RedisDocuments(RedisStore(redis_url, FP), FP).push(_doc(2))
    assert raw.hget(DOCS_KEY, "version") == b"3"
    assert second._shared.stats()["read"] == 3 and second._shared.stats()["bad"] == 0
    assert RedisDocuments(RedisStore(redis_url, "f" * 32), "f" * 32).pull() == []  # another model's namespace


def test_a_files_documents_are_shared(redis_url, tmp_path):
    path = tmp_path / f"documents-{FP[:16]}.jsonl"
    DocumentIndex(path).add(_doc(0))  # ingested before the store had a Redis tier
    both = _shared_index(redis_url, path=path)
    assert len(both) == 1
    assert _shared_index(redis_url).get(_doc(0).text) == _doc(0)  # found missing in Redis, so written there


def _flip_text(record: bytes) -> bytes:
    return record.replace(b"Document", b"Dokument", 1)


def _not_json(record: bytes) -> bytes:
    return record[: len(record) // 2]


@pytest.mark.parametrize(("damage", "problem"), [(_flip_text, "checksum"), (_not_json, "not a JSON record"),
                                                 (lambda record: b"\xff\xfe", "not UTF-8")])
def test_a_damaged_document_record_is_skipped_warned_and_deleted(redis_url, raw, damage, problem):
    first = _shared_index(redis_url)
    for i in (0, 1):
        first.add(_doc(i))
    field = _doc(0).doc_id
    raw.hset(DOCS_KEY, field, damage(raw.hget(DOCS_KEY, field)))
    with pytest.warns(StoreIntegrityWarning, match=problem) as record:
        second = _shared_index(redis_url)
    assert len(record) == 1 and field in str(record[0].message) and "tokenized again" in str(record[0].message)
    assert second.get(_doc(0).text) is None and second.get(_doc(1).text) == _doc(1)  # never used; the rest is
    assert not raw.hexists(DOCS_KEY, field) and second._shared.stats()["bad"] == 1
    second.add(_doc(0))  # ingested again: its record is written again
    assert raw.hget(DOCS_KEY, field) == encode_record(_doc(0))


def test_records_of_another_model_or_under_another_id_are_not_used(redis_url, raw):
    first = _shared_index(redis_url)
    first.add(_doc(1))
    # FOREIGN_FP shares the 16 characters of the key: only the content key under the full fingerprint tells.
    RedisDocuments(RedisStore(redis_url, FOREIGN_FP), FOREIGN_FP).push(_doc(0, FOREIGN_FP))
    with pytest.warns(StoreIntegrityWarning, match="content key"):
        assert first.find(_doc(0, FOREIGN_FP).text) == []  # read from the log by a lookup, refused there
    assert not raw.hexists(DOCS_KEY, _doc(0, FOREIGN_FP).doc_id)
    raw.hset(DOCS_KEY, _doc(2).doc_id, encode_record(_doc(1)))  # a sound record under another document's id
    with pytest.warns(StoreIntegrityWarning, match="another id"):
        second = _shared_index(redis_url)
    assert len(second) == 1 and second.get(_doc(1).text) == _doc(1)
    assert not raw.hexists(DOCS_KEY, _doc(2).doc_id) and raw.hexists(DOCS_KEY, _doc(1).doc_id)


def test_an_evicted_index_is_written_back(redis_url, raw):
    first = _shared_index(redis_url)
    for i in (0, 1):
        first.add(_doc(i))
    raw.delete(DOCS_KEY)  # what maxmemory's eviction (or FLUSHDB) does to it
    late = _shared_index(redis_url)
    assert len(late) == 0  # started meanwhile: it does not know them yet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert first.find(_doc(0).text)  # its next lookup finds the hash gone and writes what it holds back
    assert late.find(_doc(1).text)[0].document == _doc(1) and len(late) == 2
    assert len(_shared_index(redis_url)) == 2


def test_make_index_shares_only_with_a_redis_tier(redis_url, tmp_path):
    assert make_index(StoreConfig(), FP, make_store(StoreConfig(), FP))._shared is None
    config = StoreConfig(disk_dir=redis_url)  # as --store redis://...
    index = make_index(config, FP, make_store(config, FP))
    assert index._shared.key == DOCS_KEY and index._path is None


@pytest.mark.parametrize("strategy", ["naive", "cacheblend"])
def test_a_fresh_engine_finds_the_documents_another_ingested(redis_url, make_tiny_engine, docs, rag_prompt,
                                                               strategy):
    config = EngineConfig(store=StoreConfig(disk_dir=redis_url))
    prompt = rag_prompt(docs, "Who founded the brewery?")
    first = make_tiny_engine(config)
    first.ingest(docs)
    want = first.prefill(prompt, strategy, write_back=False)
    # Another process on the same Redis that ingests nothing: it knows every document and reuses their KV.
    second = make_tiny_engine(config)
    assert len(second.documents) == len(docs)
    got = second.prefill(prompt, strategy, write_back=False)
    doc_tokens = sum(len(second.documents.get(text).token_ids) for text in docs)
    reused = sum(len(c.token_ids) for c in got.plan.chunks if c.is_document and c.source in (EXACT, APPROX))
    assert reused >= 0.9 * doc_tokens
    assert got.reused_tokens == want.reused_tokens > 0 and torch.equal(got.logits, want.logits)
    assert second.counters["documents_computed"] == 0 and second.store.stats()["redis"]["hits"] > 0
    # A document the first ingests now is found by the second's next request.
    first.ingest([NEW_DOC])
    assert second.documents.get(NEW_DOC) is None
    later = second.plan(rag_prompt([NEW_DOC, *docs], "How long is the crossing?"), strategy)
    new_tokens = len(first.documents.get(NEW_DOC).token_ids)
    found = [c for c in later.chunks if c.is_document and c.source in (EXACT, APPROX)]
    assert sum(len(c.token_ids) for c in found) >= 0.9 * (doc_tokens + new_tokens)
    assert second.documents.get(NEW_DOC) == first.documents.get(NEW_DOC)
    assert second.counters["documents_computed"] == 0


def test_a_damaged_record_is_refused_by_an_engine(redis_url, raw, make_tiny_engine, docs):
    config = EngineConfig(store=StoreConfig(redis_url=redis_url))
    first = make_tiny_engine(config)
    first.ingest(docs)
    key, field = f"kvboost:{first.fingerprint[:16]}:documents", first.documents.get(docs[0]).doc_id
    good = raw.hget(key, field)
    raw.hset(key, field, good.replace(b"Halvorsen", b"Halvorsan", 1))  # what it feeds the model, edited
    with pytest.warns(StoreIntegrityWarning, match="checksum"):
        second = make_tiny_engine(config)
    assert second.documents.get(docs[0]) is None and all(second.documents.get(d) for d in docs[1:])
    second.ingest(docs)  # tokenized again, its KV found stored: nothing computed, the record written again
    assert second.counters["documents_computed"] == 0 and second.counters["documents_stored"] == len(docs)
    assert second.documents.get(docs[0]) == first.documents.get(docs[0]) and raw.hget(key, field) == good


def test_an_index_survives_a_killed_server(tmp_path, make_tiny_engine, docs, rag_prompt):
    proc, url = _start_server(tmp_path)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        config = EngineConfig(store=StoreConfig(redis_url=url))
        prompt = rag_prompt(docs, "Who founded the brewery?")
        first = make_tiny_engine(config)
        first.ingest(docs[:3])
        second = make_tiny_engine(config)
        assert len(second.documents) == 3
        _stop(proc)
        with pytest.warns(StoreUnavailableWarning):
            first.ingest(docs[3:])  # computed; its record kept in memory, unwritten
            out = second.generate(prompt, max_new_tokens=4)  # recomputed from scratch, no exception
        assert out.generated_tokens == 4 and out.reused_tokens == 0
        assert first.documents._shared.stats()["unwritten"] == 1 and len(first.documents) == len(docs)
        # Back, empty: the first's next lookup finds a new hash and writes all it holds; others find them again.
        proc, _ = _start_server(tmp_path, port=port)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first.plan(prompt, "cacheblend")
            assert first.documents._shared.stats()["unwritten"] == 0
            assert len(make_tiny_engine(config).documents) == len(docs)
            second.plan(prompt, "cacheblend")
            assert len(second.documents) == len(docs)
    finally:
        if proc.poll() is None:
            _stop(proc)


# -- the corpus's calibration, shared ------------------------------------------------------------------


def _calibration(engine) -> tuple[fidelity.Predictor, DriftMaps]:
    """A predictor and drift maps of `engine`'s shapes, as calibration would set them (without fitting)."""
    a, numbers = engine.adapter, torch.Generator().manual_seed(0)
    shape = (2, a.num_layers, a.num_kv_heads, a.head_dim + 1, a.head_dim)  # [P, L, H_kv, D + 1, D]
    maps = DriftMaps(torch.randn(shape, generator=numbers), torch.randn(shape, generator=numbers), 3)
    return fidelity.Predictor(0.25, -1.5, tokens=64, flips=5, documents=len(corpus())), maps


def _calibrated_like(engine, predictor, maps) -> bool:
    return (engine.predictor == predictor and engine.drift is not None and engine.drift.prompts == maps.prompts
            and torch.equal(engine.drift.keys, maps.keys) and torch.equal(engine.drift.values, maps.values))


def test_a_calibration_is_shared_through_redis(redis_url, raw, make_tiny_engine, monkeypatch, rag_prompt):
    monkeypatch.setattr(calibration, "PROMPTS", 4)  # what calibration does, not how well it predicts
    config = EngineConfig(store=StoreConfig(disk_dir=redis_url))  # Redis only: no folder for the files
    early = make_tiny_engine(config, guarded=True)  # started before anyone calibrated
    first = make_tiny_engine(config, guarded=True)
    assert early.predictor is None and first.predictor is None and first.fidelity_path is None
    first.ingest(corpus())  # calibrated by ingestion itself
    assert first.counters["calibrations"] == 1 and first.drift is not None
    key = f"kvboost:{first.fingerprint[:16]}:calibration:"
    assert fidelity.from_bytes(raw.get(key + "fidelity"), first.fingerprint) == first.predictor
    assert torch.equal(drift.from_bytes(raw.get(key + "drift"), first.fingerprint, first.adapter).keys,
                       first.drift.keys)
    # A restarted server, or another process on the same Redis: calibrated from the start, and it fits nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = make_tiny_engine(config, guarded=True)
        assert _calibrated_like(second, first.predictor, first.drift)
        second.ingest(corpus())
    assert second.counters["calibrations"] == 0 and second.counters["documents_computed"] == 0
    prompt = rag_prompt(corpus()[:4], "Who is the mayor of Varde?")
    assert torch.equal(second.prefill(prompt, write_back=False).logits, first.prefill(prompt, write_back=False).logits)
    # One already running when the first calibrated: due() finds the calibration saved meanwhile and takes it up.
    early.ingest(corpus())
    assert early.counters["calibrations"] == 0 and _calibrated_like(early, first.predictor, first.drift)


def test_a_local_file_comes_first_and_redis_serves_where_there_is_none(redis_url, make_tiny_engine, tmp_path):
    shared = make_tiny_engine(EngineConfig(store=StoreConfig(redis_url=redis_url)))
    predictor, maps = _calibration(shared)
    shared.set_predictor(predictor)
    shared.set_drift(maps)
    # Disk and Redis: a folder without the files takes Redis's; one with its own files keeps them.
    config = EngineConfig(store=StoreConfig(disk_dir=tmp_path, redis_url=redis_url))
    assert _calibrated_like(make_tiny_engine(config), predictor, maps)
    local = fidelity.Predictor(0.5, -2.5, tokens=40, flips=2, documents=3)
    write_atomic(tmp_path / f"fidelity-{shared.fingerprint[:16]}.safetensors",
                 fidelity.to_bytes(local, shared.fingerprint))
    assert make_tiny_engine(config).predictor == local


def _with_metadata(**changes):
    """The same calibration with its metadata changed: another model's (its whole fingerprint; the key names only
    16 characters), or an older format's."""
    return lambda blob: safetensors.torch.save(safetensors.torch.load(blob),
                                               metadata={**safetensors_metadata(blob), **changes})


def _not_finite(blob: bytes) -> bytes:
    tensors = {k: torch.full_like(v, float("nan")) for k, v in safetensors.torch.load(blob).items()}
    return safetensors.torch.save(tensors, metadata=safetensors_metadata(blob))


@pytest.mark.parametrize("damage", [_with_metadata(fingerprint=FOREIGN_FP), _with_metadata(version="1"), _not_finite,
                                    lambda blob: blob[:-7], lambda blob: b"junk"],
                         ids=["foreign", "old-version", "nan", "truncated", "garbage"])
def test_a_foreign_or_damaged_calibration_in_redis_is_refused(redis_url, raw, make_tiny_engine, damage):
    config = EngineConfig(store=StoreConfig(redis_url=redis_url))
    first = make_tiny_engine(config)
    predictor, maps = _calibration(first)
    first.set_predictor(predictor)
    first.set_drift(maps)
    for name in ("fidelity", "drift"):
        key = f"kvboost:{first.fingerprint[:16]}:calibration:{name}"
        raw.set(key, damage(raw.get(key)))
    with pytest.warns(UserWarning, match="not this model's, from an older kvboost-rag, or damaged") as record:
        second = make_tiny_engine(config)
    assert second.predictor is None and second.drift is None  # never used
    assert sum("in the Redis store" in str(w.message) for w in record) == 2
    # Ingestion still calibrates (it refuses the copy again) and the fit replaces it for everyone.
    second.ingest(corpus(), calibrate=False)
    with pytest.warns(UserWarning, match="the next ingest fits it again"):
        assert calibration.due(second)
    second.set_predictor(predictor)
    second.set_drift(maps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _calibrated_like(make_tiny_engine(config), predictor, maps)


def test_a_stopped_redis_leaves_an_engine_uncalibrated(tmp_path, make_tiny_engine):
    proc, url = _start_server(tmp_path)
    try:
        config = EngineConfig(store=StoreConfig(redis_url=url))
        first = make_tiny_engine(config)
        predictor, maps = _calibration(first)
        first.set_predictor(predictor)
        first.set_drift(maps)
        _stop(proc)
        with pytest.warns(StoreUnavailableWarning, match="cannot read"):
            second = make_tiny_engine(config)  # starts: the default curve, no drift maps
        assert second.predictor is None and second.drift is None
        with pytest.warns(StoreUnavailableWarning, match="cannot write"):
            first.set_predictor(predictor)  # kept in this engine; Redis skipped
        assert first.predictor == predictor
    finally:
        if proc.poll() is None:
            _stop(proc)
