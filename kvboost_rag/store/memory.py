"""The in-memory tier: a strict byte budget and importance-weighted eviction.

Every byte of stored tensors (raw KV, or codes + scales + zero points) counts against the budget,
which is checked and updated under one lock, so it holds even with threads putting and getting at
once. Quantization and dequantization happen outside the lock.

Eviction keeps what saves the most compute per byte: an entry's value is the prefill work one hit
saves (tokens x layers), weighted by how often it was hit and how recently, divided by its bytes.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from kvboost_rag.store.base import KVEntry
from kvboost_rag.store.quant import StoredEntry, StoredFormStore, encode_entry

log = logging.getLogger(__name__)


def eviction_score(
    num_tokens: int, num_layers: int, hits: int, age: int, nbytes: int, half_life: float
) -> float:
    """Compute saved per byte: (tokens x layers saved per hit) x (1 + hits) x recency / bytes.

    age counts store accesses since the entry was last used; recency halves every `half_life`.
    The lowest score is evicted first.
    """
    recency = 0.5 ** (age / half_life)
    return num_tokens * num_layers * (1 + hits) * recency / max(nbytes, 1)


@dataclass
class _Slot:
    stored: StoredEntry
    pinned: bool
    hits: int
    last_access: int


class MemoryStore(StoredFormStore):
    """Entries in memory, quantized when kv_bits < 16.

    budget_bytes: None for no limit, 0 to keep nothing in memory (a disk tier alone). An unpinned entry
    larger than the budget less the pinned bytes is not kept, nor will any entry that size be, so none
    is reused from memory: the first time, a RuntimeWarning names the smallest budget that would have
    kept it; later ones are logged. Pinning past the budget raises ValueError.
    on_evict: called with each evicted entry, outside the lock, after the put that evicted it.
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        *,
        kv_bits: int = 16,
        group_size: int = 64,
        half_life: float = 128.0,
        on_evict: Callable[[StoredEntry], None] | None = None,
    ) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"memory budget must be >= 0 bytes or None, got {budget_bytes}")
        if half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self.budget_bytes = budget_bytes
        self.kv_bits = kv_bits
        self.group_size = group_size
        self.half_life = half_life
        self.on_evict = on_evict
        self._lock = threading.Lock()
        self._slots: dict[bytes, _Slot] = {}
        self._by_content: dict[bytes, set[bytes]] = {}
        self._nbytes = 0
        self._pinned_bytes = 0
        self._clock = 0  # store accesses so far; ages are measured in these
        self._counts = dict(hits=0, misses=0, puts=0, evictions=0, rejected=0)
        self._warned_too_small = False

    # -- KVStore -----------------------------------------------------------------------------

    def contains(self, prefix_key: bytes) -> bool:
        with self._lock:
            return prefix_key in self._slots

    def put(self, entry: KVEntry, *, pin: bool = False) -> None:
        self.put_stored(encode_entry(entry, self.kv_bits, self.group_size), pin=pin)

    def remove(self, prefix_key: bytes) -> None:
        with self._lock:
            if prefix_key in self._slots:
                self._drop(prefix_key)

    # -- stored form, for the tiered store --------------------------------------------------

    def get_stored(self, prefix_key: bytes) -> StoredEntry | None:
        with self._lock:
            slot = self._slots.get(prefix_key)
            self._touch(slot)
            return None if slot is None else slot.stored

    def find_content_stored(self, content_key: bytes) -> StoredEntry | None:
        with self._lock:
            candidates = [self._slots[k] for k in self._by_content.get(content_key, ())]
            # Any context will do; the most recently used one is the likeliest to stay useful.
            slot = max(candidates, key=lambda s: s.last_access, default=None)
            self._touch(slot)
            return None if slot is None else slot.stored

    def put_stored(self, stored: StoredEntry, *, pin: bool = False) -> bool:
        """Keep `stored` (as it is, whatever its kv_bits). Returns whether it is now in memory."""
        evicted: list[StoredEntry] = []
        with self._lock:
            kept = self._insert(stored, pin, evicted)
            # Rejected for being too large (a budget of 0 keeps nothing on purpose): warned once, outside the lock.
            warn = not kept and self.budget_bytes != 0 and not self._warned_too_small
            self._warned_too_small |= warn
            pinned_bytes = self._pinned_bytes
        if warn:
            self._warn_too_small(stored.nbytes, pinned_bytes)
        for victim in evicted:
            self._notify_evicted(victim)
        return kept

    def is_pinned(self, prefix_key: bytes) -> bool:
        with self._lock:
            slot = self._slots.get(prefix_key)
            return slot is not None and slot.pinned

    def pin(self, prefix_key: bytes) -> bool:
        """Pin an entry already in memory; False when absent. It always fits: pinned bytes plus its own
        are at most the bytes held, which are within the budget."""
        with self._lock:
            slot = self._slots.get(prefix_key)
            if slot is None:
                return False
            if not slot.pinned:
                slot.pinned = True
                self._pinned_bytes += slot.stored.nbytes
            return True

    def unpin(self, prefix_key: bytes) -> None:
        """Make an entry evictable again (no-op when absent or not pinned)."""
        with self._lock:
            slot = self._slots.get(prefix_key)
            if slot is not None and slot.pinned:
                slot.pinned = False
                self._pinned_bytes -= slot.stored.nbytes

    # -- introspection --------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def stats(self) -> dict:
        with self._lock:
            return dict(
                entries=len(self._slots),
                pinned_entries=sum(s.pinned for s in self._slots.values()),
                nbytes=self._nbytes,
                pinned_bytes=self._pinned_bytes,
                budget_bytes=self.budget_bytes,
                kv_bits=self.kv_bits,
                **self._counts,
            )

    # -- internals (called with the lock held) ------------------------------------------------

    def _touch(self, slot: _Slot | None) -> None:
        self._clock += 1
        if slot is None:
            self._counts["misses"] += 1
            return
        self._counts["hits"] += 1
        slot.hits += 1
        slot.last_access = self._clock

    def _insert(self, stored: StoredEntry, pin: bool, evicted: list[StoredEntry]) -> bool:
        self._clock += 1
        self._counts["puts"] += 1
        size = stored.nbytes
        existing = self._slots.get(stored.prefix_key)
        if existing is not None:
            # Same prefix key, same KV: keep what is there, just note the use and any new pin.
            if pin and not existing.pinned:
                self._check_pin_fits(size)
                existing.pinned = True
                self._pinned_bytes += size
            existing.last_access = self._clock
            return True
        if pin:
            self._check_pin_fits(size)
        elif self.budget_bytes is not None and size > self.budget_bytes - self._pinned_bytes:
            self._counts["rejected"] += 1
            log.info(
                "KV entry of %d bytes not kept in memory: budget %d bytes, %d of them pinned",
                size,
                self.budget_bytes,
                self._pinned_bytes,
            )
            return False
        self._make_room(size, evicted)
        self._slots[stored.prefix_key] = _Slot(stored, pin, hits=0, last_access=self._clock)
        self._by_content.setdefault(stored.content_key, set()).add(stored.prefix_key)
        self._nbytes += size
        if pin:
            self._pinned_bytes += size
        return True

    def _warn_too_small(self, size: int, pinned_bytes: int) -> None:
        warnings.warn(
            f"kvboost-rag: a {size:,}-byte KV chunk does not fit the {self.budget_bytes:,}-byte memory budget "
            f"({pinned_bytes:,} bytes of it pinned), so chunks this size are not kept in memory and not reused "
            f"from it; set memory_budget_bytes to at least {size + pinned_bytes:,} (better, room for many "
            f"chunks), or store fewer bits (kv_bits=8 or 4). Further such chunks are logged, not warned.",
            RuntimeWarning,
            stacklevel=3,
        )

    def _check_pin_fits(self, size: int) -> None:
        if self.budget_bytes is not None and self._pinned_bytes + size > self.budget_bytes:
            raise ValueError(
                f"pinning this {size}-byte KV entry would put {self._pinned_bytes + size} pinned bytes in a "
                f"{self.budget_bytes}-byte memory budget; raise memory_budget_bytes or pin fewer documents"
            )

    def _make_room(self, size: int, evicted: list[StoredEntry]) -> None:
        """Evict the lowest-scoring unpinned entries until `size` more bytes fit the budget."""
        if self.budget_bytes is None or self._nbytes + size <= self.budget_bytes:
            return
        candidates = sorted(
            (s for s in self._slots.values() if not s.pinned),
            key=lambda s: (self._score(s), s.last_access),
        )
        for slot in candidates:
            if self._nbytes + size <= self.budget_bytes:
                break
            self._drop(slot.stored.prefix_key)
            self._counts["evictions"] += 1
            evicted.append(slot.stored)

    def _score(self, slot: _Slot) -> float:
        s = slot.stored
        age = self._clock - slot.last_access
        return eviction_score(s.num_tokens, s.num_layers, slot.hits, age, s.nbytes, self.half_life)

    def _drop(self, prefix_key: bytes) -> None:
        slot = self._slots.pop(prefix_key)
        size = slot.stored.nbytes
        self._nbytes -= size
        if slot.pinned:
            self._pinned_bytes -= size
        keys = self._by_content[slot.stored.content_key]
        keys.discard(prefix_key)
        if not keys:
            del self._by_content[slot.stored.content_key]

    def _notify_evicted(self, stored: StoredEntry) -> None:
        if self.on_evict is None:
            return
        try:
            self.on_evict(stored)
        except Exception:  # a failing spill must not fail the put that caused it
            log.exception("on_evict callback failed for a KV entry; it is dropped")
