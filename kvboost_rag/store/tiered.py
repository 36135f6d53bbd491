"""Memory in front of disk: what the engine talks to.

Writes go to both tiers at once (write-through), so a memory eviction loses nothing and needs no
spill. Reads try memory, then disk; a disk hit is promoted into memory in its stored form, so it
is never re-quantized. A disk write that fails (full, read-only) costs future reuse, never the
request: the entry stays in memory, the folder is warned about once (`files.write_failed`), and the
next write tries the disk again.
"""

from __future__ import annotations

from kvboost_rag.config import StoreConfig
from kvboost_rag.store.base import KVEntry, KVStore
from kvboost_rag.store.disk import DiskStore
from kvboost_rag.store.files import write_failed
from kvboost_rag.store.memory import MemoryStore
from kvboost_rag.store.quant import StoredEntry, decode_entry, encode_entry


class TieredStore(KVStore):
    def __init__(self, memory: MemoryStore, disk: DiskStore | None = None) -> None:
        self.memory = memory
        self.disk = disk

    def contains(self, prefix_key: bytes) -> bool:
        return self.memory.contains(prefix_key) or (self.disk is not None and self.disk.contains(prefix_key))

    def get(self, prefix_key: bytes) -> KVEntry | None:
        stored = self.memory.get_stored(prefix_key)
        if stored is None and self.disk is not None:
            stored = self._promote(self.disk.get_stored(prefix_key))
        return None if stored is None else decode_entry(stored)

    def find_content(self, content_key: bytes) -> KVEntry | None:
        stored = self.memory.find_content_stored(content_key)
        if stored is None and self.disk is not None:
            stored = self._promote(self.disk.find_content_stored(content_key))
        return None if stored is None else decode_entry(stored)

    def put(self, entry: KVEntry, *, pin: bool = False) -> None:
        stored = encode_entry(entry, self.memory.kv_bits, self.memory.group_size)  # once, for both tiers
        self.memory.put_stored(stored, pin=pin)  # raises before anything is written if the pin cannot fit
        if self.disk is not None:
            self._write_disk(stored)

    def is_pinned(self, prefix_key: bytes) -> bool:
        return self.memory.is_pinned(prefix_key)

    def pin(self, prefix_key: bytes) -> bool:
        if self.memory.pin(prefix_key):
            return True
        # On disk only: promoted in its stored form, pinned (never re-quantized, never written again).
        stored = None if self.disk is None else self.disk.get_stored(prefix_key)
        return stored is not None and self.memory.put_stored(stored, pin=True)

    def unpin(self, prefix_key: bytes) -> None:
        self.memory.unpin(prefix_key)

    def remove(self, prefix_key: bytes) -> None:
        self.memory.remove(prefix_key)
        if self.disk is not None:
            self.disk.remove(prefix_key)

    def close(self) -> None:
        self.memory.close()
        if self.disk is not None:
            self.disk.close()

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (the budgeted tier)."""
        return self.memory.nbytes

    def stats(self) -> dict:
        return dict(memory=self.memory.stats(), disk=None if self.disk is None else self.disk.stats())

    def _promote(self, stored: StoredEntry | None) -> StoredEntry | None:
        if stored is not None:
            self.memory.put_stored(stored)
        return stored

    def _write_disk(self, stored: StoredEntry) -> None:
        try:
            self.disk.put_stored(stored)
        except OSError as e:  # one warning per folder and outage, shared with the index and the documents
            write_failed(self.disk.directory, e)


def make_store(config: StoreConfig, fingerprint: str) -> KVStore:
    """The store a StoreConfig describes: memory with its budget, and disk when `disk_dir` is set."""
    # Every field was checked when the StoreConfig was made (StoreConfig.__post_init__).
    memory = MemoryStore(config.memory_budget_bytes, kv_bits=config.kv_bits, group_size=config.group_size)
    disk = None
    if config.disk_dir is not None:
        disk = DiskStore(config.disk_dir, fingerprint, kv_bits=config.kv_bits, group_size=config.group_size,
                         file_mode=config.file_mode)
    return TieredStore(memory, disk)
