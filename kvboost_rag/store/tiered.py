"""Memory in front of the persistent tiers, disk then Redis: what the engine talks to.

Writes go to every tier at once (write-through), so a memory eviction loses nothing and needs no
spill. Reads try memory, then each tier behind it, fastest first; a hit is promoted, in its stored
form (never re-quantized), into memory and the tiers before the one it came from (a Redis hit lands
on the local disk too). A tier that cannot be written costs future reuse, never the request: the
entry stays in the tiers that took it. A disk write that fails (full, read-only) is warned about once
per folder (`files.write_failed`) and the next write tries again; the Redis tier warns about its own
outages (store/redis.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvboost_rag.config import StoreConfig
from kvboost_rag.store.base import KVEntry, KVStore
from kvboost_rag.store.disk import DiskStore
from kvboost_rag.store.documents import DocumentIndex
from kvboost_rag.store.files import write_failed
from kvboost_rag.store.memory import MemoryStore
from kvboost_rag.store.quant import StoredEntry, decode_entry, encode_entry
from kvboost_rag.store.redis import RedisStore
from kvboost_rag.store.redis_documents import RedisDocuments


class TieredStore(KVStore):
    def __init__(self, memory: MemoryStore, disk: DiskStore | None = None, redis: RedisStore | None = None) -> None:
        self.memory = memory
        self.disk = disk
        self.redis = redis
        # The tiers behind memory, fastest first; each speaks get_stored / find_content_stored / put_stored.
        self.behind: list[DiskStore | RedisStore] = [tier for tier in (disk, redis) if tier is not None]

    def contains(self, prefix_key: bytes) -> bool:
        return self.memory.contains(prefix_key) or any(tier.contains(prefix_key) for tier in self.behind)

    def get(self, prefix_key: bytes) -> KVEntry | None:
        stored = self.memory.get_stored(prefix_key)
        if stored is None:
            stored = self._promote(self._read_behind(lambda tier: tier.get_stored(prefix_key)))
        return None if stored is None else decode_entry(stored)

    def find_content(self, content_key: bytes) -> KVEntry | None:
        stored = self.memory.find_content_stored(content_key)
        if stored is None:
            stored = self._promote(self._read_behind(lambda tier: tier.find_content_stored(content_key)))
        return None if stored is None else decode_entry(stored)

    def put(self, entry: KVEntry, *, pin: bool = False) -> None:
        stored = encode_entry(entry, self.memory.kv_bits, self.memory.group_size)  # once, for every tier
        self.memory.put_stored(stored, pin=pin)  # raises before anything is written if the pin cannot fit
        for tier in self.behind:
            self._write(tier, stored)

    def is_pinned(self, prefix_key: bytes) -> bool:
        return self.memory.is_pinned(prefix_key)

    def pin(self, prefix_key: bytes) -> bool:
        if self.memory.pin(prefix_key):
            return True
        # Behind memory only: promoted in its stored form, pinned (never re-quantized, never written again).
        stored = self._read_behind(lambda tier: tier.get_stored(prefix_key))
        return stored is not None and self.memory.put_stored(stored, pin=True)

    def unpin(self, prefix_key: bytes) -> None:
        self.memory.unpin(prefix_key)

    def remove(self, prefix_key: bytes) -> None:
        self.memory.remove(prefix_key)
        for tier in self.behind:
            tier.remove(prefix_key)

    def close(self) -> None:
        self.memory.close()
        for tier in self.behind:
            tier.close()

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (the budgeted tier)."""
        return self.memory.nbytes

    def stats(self) -> dict:
        return dict(memory=self.memory.stats(), disk=None if self.disk is None else self.disk.stats(),
                    redis=None if self.redis is None else self.redis.stats())

    def _promote(self, stored: StoredEntry | None) -> StoredEntry | None:
        if stored is not None:
            self.memory.put_stored(stored)
        return stored

    def _read_behind(self, read: Callable[[DiskStore | RedisStore], StoredEntry | None]) -> StoredEntry | None:
        """The first hit among the tiers behind memory, also written to the tiers before the one it came from."""
        for i, tier in enumerate(self.behind):
            stored = read(tier)
            if stored is not None:
                for faster in self.behind[:i]:
                    self._write(faster, stored)
                return stored
        return None

    def _write(self, tier: DiskStore | RedisStore, stored: StoredEntry) -> None:
        try:
            tier.put_stored(stored)
        except OSError as e:  # only the disk tier raises; one warning per folder and outage, shared with the index
            write_failed(tier.directory, e)


def make_store(config: StoreConfig, fingerprint: str) -> KVStore:
    """The store a StoreConfig describes: memory with its budget, then disk when `disk_dir` is set, then
    Redis when `redis_url` is."""
    # Every field was checked when the StoreConfig was made (StoreConfig.__post_init__).
    memory = MemoryStore(config.memory_budget_bytes, kv_bits=config.kv_bits, group_size=config.group_size)
    disk = redis = None
    if config.disk_dir is not None:
        disk = DiskStore(config.disk_dir, fingerprint, kv_bits=config.kv_bits, group_size=config.group_size,
                         file_mode=config.file_mode)
    if config.redis_url is not None:
        redis = RedisStore(config.redis_url, fingerprint, kv_bits=config.kv_bits, group_size=config.group_size)
    return TieredStore(memory, disk, redis)


def make_index(config: StoreConfig, fingerprint: str, store: KVStore) -> DocumentIndex:
    """The document index beside `store`: a file in `disk_dir` when set, and shared through Redis (see
    redis_documents.py) when `store` has a Redis tier (or is one)."""
    path = Path(config.disk_dir) / f"documents-{fingerprint[:16]}.jsonl" if config.disk_dir else None
    redis = redis_tier(store)
    shared = RedisDocuments(redis, fingerprint) if redis is not None else None
    return DocumentIndex(path, file_mode=config.file_mode, shared=shared)


def redis_tier(store: KVStore) -> RedisStore | None:
    """`store`'s Redis tier (or `store` itself when it is a RedisStore); None when it has none."""
    redis = store if isinstance(store, RedisStore) else getattr(store, "redis", None)
    return redis if isinstance(redis, RedisStore) else None
