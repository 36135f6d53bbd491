"""The shared tier: entries in Redis, so that several processes and machines reuse one store.

A value is an entry in the disk tier's file format, byte for byte (`disk.entry_bytes`: safetensors whose
metadata holds the format version, the full model fingerprint and an xxh3_128 checksum), so an entry is
kept as it is stored (raw or quantized, never re-quantized) and checked in full on every read
(`disk.entry_from_bytes`: checksum, fingerprint, prefix key, shapes, number of token ids). Keys:

    kvboost:{fingerprint[:16]}:p:{prefix key hex}   the entry
    kvboost:{fingerprint[:16]}:c:{content key hex}  the prefix key (hex) of the last entry put with these tokens
    kvboost:{fingerprint[:16]}:calibration:drift     the corpus's drift maps (drift.to_bytes), and
    kvboost:{fingerprint[:16]}:calibration:fidelity  the fidelity guard's predictor (fidelity.to_bytes): what a
                                                    process started later uses instead of calibrating (calibrate.py)

A value that is damaged, truncated, of another format version or of another model (the whole fingerprint
is checked, not only the 16 characters in its key) is never served: it is a miss, it is deleted (unless it
was replaced meanwhile), and the first one a store meets is warned about (StoreIntegrityWarning); later
ones are logged. The chunk is then recomputed and put again.

A Redis that cannot be reached, times out or refuses a command (OOM under `maxmemory-policy noeviction`,
a read-only replica) never fails a request: a read is a miss, a write is skipped (the entry stays in the
faster tiers), one StoreUnavailableWarning per outage says so, and every later call tries again. Timeouts
default to `_CLIENT_DEFAULTS`; the URL's own options (`?socket_timeout=1&socket_connect_timeout=1`) win.

Size and lifetime are Redis's business: set `maxmemory` and `maxmemory-policy allkeys-lru` (or -lfu).
Eviction is safe: an evicted entry is a miss and its chunk is recomputed; a content pointer whose entry
was evicted is a miss too (and the pointer is dropped); an evicted pointer only loses find_content hits
until an entry with those tokens is put again. `remove` deletes the entry and leaves its pointer to be
dropped the same way. No key has a TTL, so `volatile-*` policies evict nothing: use an `allkeys-` one.

The document index lives beside the entries, in one hash (`kvboost:{fingerprint[:16]}:documents`, see
redis_documents.py) that every process reads on each lookup, so LRU keeps it. An evicted index costs no
answer: running processes keep their documents in memory and write them back on their next lookup; a process
started meanwhile does not find them in its prompts until then or until they are ingested again. KV entries
without index records are harmless (evicted in their turn).

The `redis` client is imported when a RedisStore is made, so the rest of kvboost-rag works without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import warnings
from urllib.parse import urlsplit, urlunsplit

from kvboost_rag.store.base import KVEntry
from kvboost_rag.store.entries import BadEntryFile, StoreIntegrityWarning, entry_bytes, entry_from_bytes
from kvboost_rag.store.files import StoreWriteWarning
from kvboost_rag.store.quant import StoredEntry, StoredFormStore, encode_entry

log = logging.getLogger(__name__)

KEY_PREFIX = "kvboost"
# Client settings unless the URL gives its own: a Redis that hangs costs a request seconds, not forever,
# and a pooled connection the server dropped (restart, idle timeout) is reopened once, without backoff.
_CLIENT_DEFAULTS = dict(socket_timeout=5.0, socket_connect_timeout=2.0)
# Delete KEYS[1] only if its value is still the one read (sha1 ARGV[1]): never a value put meanwhile.
_DELETE_IF_UNCHANGED = """
local value = redis.call('GET', KEYS[1])
if value and redis.sha1hex(value) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class StoreUnavailableWarning(StoreWriteWarning):
    """The Redis tier cannot be reached or refused a command: reads are misses, new KV is not shared."""


def _import_redis():
    try:
        import redis
    except ImportError as e:
        raise ImportError(
            "StoreConfig.redis_url needs the redis client: pip install 'kvboost-rag[redis]'"
        ) from e
    return redis


def redacted(url: str) -> str:
    """`url` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisStore(StoredFormStore):
    """Entries in the Redis at `url` (redis://, rediss:// or unix://), served only to the model with this
    `fingerprint`. Entries are written at `kv_bits` / `group_size`; one written at other settings (by
    another process) is served at its own precision. Thread-safe: the client's connection pool is, and
    this object's own state is behind a lock."""

    def __init__(self, url: str, fingerprint: str, *, kv_bits: int = 16, group_size: int = 64) -> None:
        redis = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = redacted(url)
        self.fingerprint = fingerprint
        self.kv_bits = kv_bits
        self.group_size = group_size
        self.namespace = f"{KEY_PREFIX}:{fingerprint[:16]}"
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        self._client = redis.Redis.from_url(url, **_CLIENT_DEFAULTS, retry=retry)
        self._delete_if_unchanged = self._client.register_script(_DELETE_IF_UNCHANGED)
        self._errors = (redis.RedisError, OSError)
        self._lock = threading.Lock()
        self._unavailable = False  # in an outage, already warned about
        self._warned_bad = False
        self._counts = dict(hits=0, misses=0, bad=0, writes=0, errors=0)

    def entry_key(self, prefix_key: bytes) -> str:
        return f"{self.namespace}:p:{prefix_key.hex()}"

    def pointer_key(self, content_key: bytes) -> str:
        return f"{self.namespace}:c:{content_key.hex()}"

    def calibration_key(self, name: str) -> str:
        return f"{self.namespace}:calibration:{name}"

    # -- the corpus's calibration (its bytes are checked by drift.from_bytes / fidelity.from_bytes) ----

    def read_calibration(self, name: str) -> bytes | None:
        """The calibration value `name` ("drift", "fidelity"); None when absent or Redis is unreachable (warned)."""
        data = None
        with self._reaching("read from"):
            data = self._client.get(self.calibration_key(name))
        return data

    def write_calibration(self, name: str, data: bytes) -> bool:
        """Put the calibration value `name`; False (warned) when Redis did not take it."""
        written = False
        with self._reaching("write to"):
            written = bool(self._client.set(self.calibration_key(name), data))
        return written

    # -- KVStore -----------------------------------------------------------------------------

    def contains(self, prefix_key: bytes) -> bool:
        """A value is there (values are checked in full only by get, and deleted when bad)."""
        found = False
        with self._reaching("read from"):
            found = bool(self._client.exists(self.entry_key(prefix_key)))
        return found

    def put(self, entry: KVEntry, *, pin: bool = False) -> None:
        # pin means nothing here: what Redis keeps is its maxmemory policy's business.
        self.put_stored(encode_entry(entry, self.kv_bits, self.group_size))

    def remove(self, prefix_key: bytes) -> None:
        with self._reaching("write to"):
            self._client.delete(self.entry_key(prefix_key))

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self._client.close()

    # -- stored form, for the tiered store --------------------------------------------------

    def put_stored(self, stored: StoredEntry) -> bool:
        """Put `stored` as it is; False (warned) when Redis did not take it."""
        data = entry_bytes(stored, self.fingerprint)
        written = False
        with self._reaching("write to"):
            with self._client.pipeline(transaction=True) as pipe:  # the entry and its pointer, or neither
                pipe.set(self.entry_key(stored.prefix_key), data)
                pipe.set(self.pointer_key(stored.content_key), stored.prefix_key.hex())
                pipe.execute()
            written = True
        if written:
            self._count("writes")
        return written

    def get_stored(self, prefix_key: bytes) -> StoredEntry | None:
        key = self.entry_key(prefix_key)
        data = None
        with self._reaching("read from"):
            data = self._client.get(key)
        if data is None:
            self._count("misses")
            return None
        try:
            stored = entry_from_bytes(data, fingerprint=self.fingerprint, prefix_key=prefix_key)
        except BadEntryFile as e:
            self._drop_bad(key, data, str(e))
            return None
        self._count("hits")
        return stored

    def find_content_stored(self, content_key: bytes) -> StoredEntry | None:
        key = self.pointer_key(content_key)
        pointer = None
        with self._reaching("read from"):
            pointer = self._client.get(key)
        if pointer is None:
            self._count("misses")
            return None
        try:
            prefix_key = bytes.fromhex(pointer.decode("ascii"))
        except ValueError:  # UnicodeDecodeError is one
            self._drop_bad(key, pointer, "not a prefix key")
            return None
        stored = self.get_stored(prefix_key)
        if stored is None:  # evicted, removed or bad: the pointer leads nowhere
            self._delete(key, pointer)
        elif stored.content_key != content_key:
            self._drop_bad(key, pointer, f"points at {self.entry_key(prefix_key)}, an entry with other tokens")
            return None
        return stored

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            return dict(url=self.url, namespace=self.namespace, **self._counts)

    # -- internals ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _reaching(self, doing: str):
        """Run a Redis call; a failure is warned about once per outage and swallowed (the caller's
        defaults, a miss or nothing written, stand), a success ends the outage."""
        try:
            yield
        except self._errors as e:
            with self._lock:
                self._counts["errors"] += 1
                first = not self._unavailable
                self._unavailable = True
            if first:
                warnings.warn(
                    f"kvboost-rag: cannot {doing} the Redis store at {self.url} ({type(e).__name__}: {e}). Answers "
                    "are not affected: what it holds is recomputed when needed, and new KV and documents stay in "
                    "this process's faster tiers. Every later call tries again; check that the server is up and "
                    "reachable, and that it has memory (maxmemory-policy allkeys-lru lets it evict). Further failures "
                    "are logged, not warned.",
                    StoreUnavailableWarning,
                    stacklevel=4,
                )
            else:
                log.info("still cannot %s the Redis store at %s: %s", doing, self.url, e)
            return
        if self._unavailable:  # the common case, no lock
            with self._lock:
                ended, self._unavailable = self._unavailable, False
            if ended:
                log.info("the Redis store at %s is reachable again", self.url)

    def _drop_bad(self, key: str, data: bytes, problem: str) -> None:
        """A value that must not be served: delete it (if unchanged since read) and warn about the first."""
        with self._lock:
            self._counts["bad"] += 1
            first = not self._warned_bad
            self._warned_bad = True
        self._delete(key, data)
        if not first:
            log.info("deleted bad KV value %s from the Redis store at %s: %s", key, self.url, problem)
            return
        warnings.warn(
            f"kvboost-rag: ignoring stored KV value {key} in the Redis store at {self.url}: {problem}. It was "
            "deleted; the chunk will be recomputed and stored again. Further bad values are logged, not warned.",
            StoreIntegrityWarning,
            stacklevel=4,
        )

    def _delete(self, key: str, data: bytes) -> None:
        with self._reaching("write to"):
            self._delete_if_unchanged(keys=[key], args=[hashlib.sha1(data).hexdigest()])

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1
