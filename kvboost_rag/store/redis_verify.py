"""`kvboost-rag store verify redis://...`: every key of kvboost-rag's in a Redis, checked as its kind says.

The Redis tier (store/redis.py) and the document index shared through it (redis_documents.py) write, per model
fingerprint (the 16 characters of its namespace):

    kvboost:{fp}:p:{prefix key hex}             an entry: checked as the tier reads one (entry_from_bytes: format
                                                version, checksum, prefix key, shapes), its fingerprint against the
                                                namespace
    kvboost:{fp}:c:{content key hex}            a pointer: the hex prefix key of an entry of these tokens. One whose
                                                entry is gone (evicted, removed) is stale, not bad: the tier drops it
                                                when it next reads it
    kvboost:{fp}:calibration:drift | fidelity   the corpus's calibration, checked as its file in a store folder is
                                                (folder.check_calibration); the fidelity predictor's shadow check
                                                figures (fidelity.Observed) reported as `store stats` reports them
    kvboost:{fp}:documents                      the document index, a hash: each record by its checksum, its field
                                                against its doc_id and, where the model's whole fingerprint is known
                                                (--fingerprint, or the one the namespace's entries carry), its doc_id
                                                against its tokens, as RedisDocuments reads them

Any other key under `kvboost:` is unknown, and fails verify as a file that is not ours does in a store folder; keys
outside it are other programs' (a Redis may be shared) and are only counted. Verify changes nothing: an engine
deletes a bad value when it reads it (`redis-cli DEL KEY` does it by hand), and Redis's maxmemory policy does what
prune does for a folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvboost_rag import fidelity
from kvboost_rag.keys import content_key
from kvboost_rag.store.documents import decode_record
from kvboost_rag.store.entries import BadEntryFile, entry_from_bytes
from kvboost_rag.store.files import safetensors_metadata
from kvboost_rag.store.folder import check_calibration
from kvboost_rag.store.redis import _CLIENT_DEFAULTS, KEY_PREFIX, _import_redis, redacted

BATCH = 500  # values per round trip
# The names the tiers write (see the module docstring); group 1 is the namespace.
_KEY = re.compile(r"kvboost:([0-9a-f]{16}):(?:(p|c):((?:[0-9a-f]{2})+)|calibration:(drift|fidelity)|(documents))")
_DOC_ID = re.compile(r"[0-9a-f]{32}")
_INDEX_FIELDS = (b"epoch", b"version")  # the index's own fields beside its records and its log (b"#n")


@dataclass
class RedisVerifyReport:
    """What `verify_redis` found: every key under kvboost:, by kind."""

    url: str
    good: int = 0  # intact entries (of the fingerprint, when one is given)
    foreign: int = 0  # intact entries of another fingerprint
    fingerprints: dict[str, int] = field(default_factory=dict)  # intact entries per whole fingerprint
    pointers: int = 0  # content pointers to an intact entry of their tokens
    stale_pointers: int = 0  # pointers whose entry is gone or bad: dropped by the tier on its next read
    calibrations: list[str] = field(default_factory=list)  # intact drift maps and fidelity predictors
    # Intact fidelity predictor -> the shadow checks' figures kept with it; None: no shadow checks yet
    observed: dict[str, fidelity.Observed | None] = field(default_factory=dict)
    documents: dict[str, int] = field(default_factory=dict)  # document index -> intact records
    bad: dict[str, str] = field(default_factory=dict)  # key (a record: "key field") -> what is wrong
    unknown: list[str] = field(default_factory=list)  # under kvboost: but named like nothing kvboost-rag writes
    other_keys: int = 0  # outside kvboost:, another program's

    @property
    def ok(self) -> bool:
        return not self.bad and not self.unknown


def verify_redis(url: str, fingerprint: str | None = None) -> RedisVerifyReport:
    """Check every key under kvboost: in the Redis at `url`; with `fingerprint`, entries of other models count as
    foreign. Raises the client's ConnectionError when the Redis cannot be reached."""
    redis = _import_redis()
    client = redis.Redis.from_url(url, **_CLIENT_DEFAULTS)
    report = RedisVerifyReport(redacted(url))
    try:
        ours = sorted(key.decode("utf-8", "replace") for key in client.scan_iter(match=f"{KEY_PREFIX}:*", count=1000))
        report.other_keys = max(client.dbsize() - len(ours), 0)
        kinds: dict[str, list[re.Match]] = {"p": [], "c": [], "calibration": [], "documents": []}
        for key in ours:
            m = _KEY.fullmatch(key)
            if m is None:
                report.unknown.append(key)
            else:
                kinds[m.group(2) or ("calibration" if m.group(4) else "documents")].append(m)
        whole = _check_entries(client, kinds["p"], fingerprint, report)
        _check_calibrations(client, kinds["calibration"], report, whole)
        _check_pointers(client, kinds["c"], report)
        for m in kinds["documents"]:
            namespace = m.group(1)
            known = fingerprint if fingerprint and fingerprint[:16] == namespace else whole.get(namespace)
            _check_documents(client, m.group(0), known, report)
    finally:
        client.close()
    return report


def _values(client, keys: list[str]) -> list:
    """GET of each key, in batches; a value of the wrong type (a hash where a string goes) is the error itself."""
    values = []
    for at in range(0, len(keys), BATCH):
        pipe = client.pipeline(transaction=False)
        for key in keys[at:at + BATCH]:
            pipe.get(key)
        values += pipe.execute(raise_on_error=False)
    return values


def _check_entries(client, found: list[re.Match], fingerprint: str | None,
                   report: RedisVerifyReport) -> dict[str, str]:
    """Count the intact entries; the whole fingerprint each namespace's entries carry (when they all agree)."""
    whole: dict[str, set[str]] = {}
    for m, data in zip(found, _values(client, [m.group(0) for m in found]), strict=True):
        key, namespace = m.group(0), m.group(1)
        if data is None:
            continue  # evicted or deleted while we looked
        try:
            if isinstance(data, Exception):
                raise BadEntryFile(f"not a string value ({data})")
            entry_from_bytes(data, prefix_key=bytes.fromhex(m.group(3)))
            owner = safetensors_metadata(data).get("fingerprint", "")
            if owner[:16] != namespace:
                raise BadEntryFile(f"written for model fingerprint {owner!r}, not one of this namespace's")
        except (BadEntryFile, ValueError) as e:
            report.bad[key] = str(e)
            continue
        whole.setdefault(namespace, set()).add(owner)
        report.fingerprints[owner] = report.fingerprints.get(owner, 0) + 1
        if fingerprint in (None, owner):
            report.good += 1
        else:
            report.foreign += 1
    return {namespace: next(iter(owners)) for namespace, owners in whole.items() if len(owners) == 1}


def _check_calibrations(client, found: list[re.Match], report: RedisVerifyReport, whole: dict[str, str]) -> None:
    for m, data in zip(found, _values(client, [m.group(0) for m in found]), strict=True):
        key, kind = m.group(0), m.group(4)
        if data is None:
            continue
        try:
            if isinstance(data, Exception):
                raise BadEntryFile(f"not a string value ({data})")
            check_calibration(kind, data, m.group(1))
        except BadEntryFile as e:
            report.bad[key] = str(e)
            continue
        report.calibrations.append(key)
        if kind == "fidelity":
            report.observed[key] = fidelity.observed_in(data)  # checked whole by check_calibration
        whole.setdefault(m.group(1), safetensors_metadata(data)["fingerprint"])


def _check_pointers(client, found: list[re.Match], report: RedisVerifyReport) -> None:
    keys = [m.group(0) for m in found]
    pointers = _values(client, keys)
    targets: list[tuple[re.Match, str]] = []
    for m, pointer in zip(found, pointers, strict=True):
        if pointer is None:
            continue
        try:
            if isinstance(pointer, Exception):
                raise ValueError(f"not a string value ({pointer})")
            prefix_hex = pointer.decode("ascii")
            bytes.fromhex(prefix_hex)
        except ValueError as e:  # UnicodeDecodeError is one
            report.bad[m.group(0)] = f"not a prefix key ({e})"
            continue
        targets.append((m, f"{KEY_PREFIX}:{m.group(1)}:p:{prefix_hex}"))
    for (m, entry_key), data in zip(targets, _values(client, [k for _, k in targets]), strict=True):
        try:
            stored = None if data is None or isinstance(data, Exception) else entry_from_bytes(data)
        except BadEntryFile:
            stored = None  # reported as the entry's own damage
        if stored is None:
            report.stale_pointers += 1
        elif stored.content_key.hex() != m.group(3):
            report.bad[m.group(0)] = f"points at {entry_key}, an entry of other tokens"
        else:
            report.pointers += 1


def _check_documents(client, key: str, fingerprint: str | None, report: RedisVerifyReport) -> None:
    """The index's records, as RedisDocuments reads them (its content-key check where `fingerprint` is known)."""
    try:
        fields = client.hgetall(key)
    except Exception as e:  # noqa: BLE001 - the client's ResponseError for a key that is not a hash
        report.bad[key] = f"not a hash ({e})"
        return
    intact = 0
    for name, value in sorted(fields.items()):
        if name in _INDEX_FIELDS or name.startswith(b"#"):
            continue
        doc_id = name.decode("utf-8", "replace")
        try:
            if not _DOC_ID.fullmatch(doc_id):
                raise ValueError("not a document id")
            doc = decode_record(value)
            if doc.doc_id != doc_id:
                raise ValueError(f"the record of document {doc.doc_id[:40]!r} under another id")
            if fingerprint is not None and content_key(fingerprint, doc.token_ids).hex() != doc_id:
                raise ValueError("its id is not its tokens' content key: another model's, or edited")
        except ValueError as e:
            report.bad[f"{key} {doc_id[:40]}"] = f"a document record the engine skips: {e}"
            continue
        intact += 1
    report.documents[key] = intact
