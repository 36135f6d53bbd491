"""The document index shared through Redis, so that a process finds in its prompts the documents another ingested.

With a Redis tier, the engine's DocumentIndex (documents.py) keeps its records in one Redis hash beside the KV
entries, in the namespace of the model fingerprint (which covers how documents are encoded: chunking and the
ingestion context), as the KV entries are:

    kvboost:{fingerprint[:16]}:documents    a hash of
        {doc_id}    the document's record: documents.encode_record's line, byte for byte (checksummed)
        version     bumped by every record written, so that a process notices new documents in one round trip
        #{n}        the doc_id of the record written at version n: what a process reads forward from the
                    version it saw, so that it fetches only the new records
        epoch       a random id set when the hash is made: a hash evicted or flushed and made again is read in full

A process reads every record when its index is made, and before each prompt's lookup asks for the epoch and
version (one HMGET); when they moved, it reads the log from the version it saw and the records it lacks. A
record is written by one script (record, version and log at once); the same record already there costs
nothing, a different one (damaged, say) is replaced.

A record is used only if it passes decode_record's checks (its checksum) and its doc_id is both its field and
the content key of its tokens under this model's full fingerprint (the key holds only 16 characters of it);
any other is skipped, deleted (unless replaced meanwhile), warned about once per engine (StoreIntegrityWarning)
and logged after. That document is then tokenized again when next ingested, and its record written again.

A Redis that cannot be reached or refuses a write is the KV tier's outage (RedisStore._reaching: one
StoreUnavailableWarning, shared with the KV tier): the index works from what it holds in memory; records not
written are kept and written by the next call that reaches Redis (every lookup tries); a hash found gone (a new
epoch: evicted, flushed, a restarted server) gets every document this process holds written again.

Eviction: the index is one key without a TTL, read by every lookup of every process, so `allkeys-lru` (or -lfu)
evicts it only after everything no one has read for longer; evicted anyway, the running processes keep their
documents in memory and write them back on their next lookup, but a process started meanwhile does not find
them in its prompts until then or until they are ingested again (which computes nothing while their KV is
stored). KV entries without index records are harmless: evicted in their turn. `volatile-*` policies never
evict it (nor the KV entries, which have no TTL either).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
import warnings
from collections.abc import Iterable

from kvboost_rag.keys import content_key
from kvboost_rag.store.documents import Document, decode_record, encode_record
from kvboost_rag.store.entries import StoreIntegrityWarning
from kvboost_rag.store.redis import KEY_PREFIX, RedisStore

log = logging.getLogger(__name__)

BATCH = 1000  # fields per HMGET, records per pipeline: a large corpus is read and written in steps
LOG_LIMIT = 10 * BATCH  # more new records than this are found by listing the hash's fields instead
_EPOCH, _VERSION, _LOG = b"epoch", b"version", b"#"
# KEYS[1] the hash; ARGV doc_id, record, a fresh epoch. Returns {0} when that very record is there already,
# else {the new version, the epoch}.
_ADD = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return {0} end
redis.call('HSETNX', KEYS[1], 'epoch', ARGV[3])
local version = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], '#' .. version, ARGV[1])
return {version, redis.call('HGET', KEYS[1], 'epoch')}
"""
# Delete field ARGV[1] only if its value is still the one read (sha1 ARGV[2]): never a record written meanwhile.
_DELETE_IF_UNCHANGED = """
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value and redis.sha1hex(value) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


class RedisDocuments:
    """A DocumentIndex's records in the Redis of `store` (its connection pool and outage warnings), for the model
    with this `fingerprint`. Thread-safe: one call at a time."""

    def __init__(self, store: RedisStore, fingerprint: str) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.key = f"{KEY_PREFIX}:{fingerprint[:16]}:documents"
        client = store._client  # the KV tier's pool and timeouts: one connection setup, one outage state
        self._client = client
        self._add = client.register_script(_ADD)
        self._delete_if_unchanged = client.register_script(_DELETE_IF_UNCHANGED)
        self._lock = threading.Lock()
        self._known: dict[str, Document] = {}  # every document this process holds, read or added
        self._unwritten: dict[str, Document] = {}  # held, not in Redis yet: written by the next call that can
        self._seen: tuple[bytes | None, int] | None = None  # (epoch, version) read last; None: read in full next
        self._warned_bad = False
        self.counts = dict(read=0, written=0, bad=0)

    def hold(self, docs: Iterable[Document]) -> None:
        """Documents this process has from elsewhere (the index's file): written when Redis is found lacking them."""
        with self._lock:
            for doc in docs:
                self._known.setdefault(doc.doc_id, doc)

    def push(self, doc: Document) -> None:
        """Write `doc`'s record (kept for later when Redis does not take it)."""
        with self._lock:
            self._known.setdefault(doc.doc_id, doc)
            self._unwritten[doc.doc_id] = doc
            self._write_unwritten()

    def flush(self) -> None:
        with self._lock:
            if self._unwritten:
                self._write_unwritten()

    def pull(self) -> list[Document]:
        """The documents other processes added since the last call; one round trip when there are none."""
        with self._lock:
            state = None
            with self._reaching("read the document index from"):
                state = self._client.hmget(self.key, [_EPOCH, _VERSION])
            if state is None:  # unreachable: the index goes on with what it holds
                return []
            now = (state[0], _version(state[1]))
            if now == self._seen:
                docs = []
            elif self._seen is not None and now[0] is not None and now[0] == self._seen[0] and (
                    0 < now[1] - self._seen[1] <= LOG_LIMIT):
                docs = self._read_log(now)
            else:  # the first call, a new epoch (the hash was evicted or flushed and made again) or a version reset
                docs = self._read_all(now)
            if self._unwritten:
                self._write_unwritten()
            return docs

    def stats(self) -> dict:
        with self._lock:
            return dict(key=self.key, documents=len(self._known), unwritten=len(self._unwritten), **self.counts)

    # -- internals (called with the lock held) ----------------------------------------------------

    def _reaching(self, doing: str):
        return self.store._reaching(doing)

    def _read_log(self, now: tuple[bytes, int]) -> list[Document]:
        """The records written after the version seen, as the log lists them."""
        ids = self._hmget([b"#%d" % n for n in range(self._seen[1] + 1, now[1] + 1)])
        if ids is None:
            return []
        docs = self._read_records([i for i in ids if i is not None])
        if docs is not None:
            self._seen = now
        return docs or []

    def _read_all(self, now: tuple[bytes | None, int]) -> list[Document]:
        """Every record this process lacks; what it holds and Redis lacks is written again."""
        fields = None
        with self._reaching("read the document index from"):
            fields = self._client.hkeys(self.key)
        if fields is None:
            return []
        ids = {f for f in fields if f not in (_EPOCH, _VERSION) and not f.startswith(_LOG)}
        docs = self._read_records(ids)
        if docs is None:
            return []
        self._seen = now
        present = {i.decode("ascii", "replace") for i in ids}
        for doc_id, doc in self._known.items():
            if doc_id not in present:
                self._unwritten.setdefault(doc_id, doc)
        return docs

    def _read_records(self, ids: Iterable[bytes]) -> list[Document] | None:
        """The documents of the records under `ids` this process lacks, checked; None when Redis did not answer."""
        wanted = [i for i in dict.fromkeys(ids) if i.decode("ascii", "replace") not in self._known]
        records = self._hmget(wanted)
        if records is None:
            return None
        docs = []
        for field, record in zip(wanted, records, strict=True):
            if record is None:  # deleted since it was listed
                continue
            doc_id = field.decode("ascii", "replace")
            try:
                doc = decode_record(record)
                if doc.doc_id != doc_id:
                    raise ValueError(f"the record of document {doc.doc_id[:40]!r} under another id")
                if content_key(self.fingerprint, doc.token_ids).hex() != doc.doc_id:
                    raise ValueError("its id is not its tokens' content key: another model's, or edited")
            except ValueError as e:
                self._drop_bad(field, record, str(e))
                continue
            self._known[doc_id] = doc
            docs.append(doc)
        self.counts["read"] += len(docs)
        return docs

    def _hmget(self, fields: list[bytes]) -> list[bytes | None] | None:
        values: list[bytes | None] = []
        for at in range(0, len(fields), BATCH):
            got = None
            with self._reaching("read the document index from"):
                got = self._client.hmget(self.key, fields[at:at + BATCH])
            if got is None:
                return None
            values += got
        return values

    def _write_unwritten(self) -> None:
        docs = list(self._unwritten.values())
        for at in range(0, len(docs), BATCH):
            batch, results = docs[at:at + BATCH], None
            with self._reaching("write the document index to"), self._client.pipeline(transaction=False) as pipe:
                for doc in batch:
                    self._add(keys=[self.key], args=[doc.doc_id, encode_record(doc), uuid.uuid4().hex], client=pipe)
                results = pipe.execute()
            if results is None:  # kept, for the next call that reaches Redis
                return
            for doc, result in zip(batch, results, strict=True):
                del self._unwritten[doc.doc_id]
                self._advance(result)

    def _advance(self, result: list) -> None:
        """After a record written at a version: still up to date when it was the very next one (ours alone)."""
        version = int(result[0])
        if version == 0:  # that very record was there already
            return
        self.counts["written"] += 1
        epoch = result[1]
        if self._seen is not None and self._seen[0] in (None, epoch) and version == self._seen[1] + 1:
            self._seen = (epoch, version)

    def _drop_bad(self, field: bytes, record: bytes, problem: str) -> None:
        self.counts["bad"] += 1
        with self._reaching("write to"):
            self._delete_if_unchanged(keys=[self.key], args=[field, hashlib.sha1(record).hexdigest()])
        where = f"{field.decode('ascii', 'replace')[:40]!r} of {self.key} in the Redis store at {self.store.url}"
        if self._warned_bad:
            log.info("deleted bad document record %s: %s", where, problem)
            return
        self._warned_bad = True
        warnings.warn(f"kvboost-rag: ignoring document record {where}: {problem}. It was deleted; that document is "
                      "tokenized again when next ingested (its stored KV is still reused) and its record written "
                      "again. Further bad records are logged, not warned.", StoreIntegrityWarning, stacklevel=5)


def _version(value: bytes | None) -> int:
    return int(value) if value is not None and value.isdigit() else 0
