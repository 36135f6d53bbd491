"""Ingestion spread over Ray actors that write to one shared store.

    ids = ingest_with_ray(texts, model="/models/smol", config=EngineConfig(store=StoreConfig(disk_dir="kv/")),
                          workers=4)
    engine = KVBoost.from_pretrained("/models/smol", config=EngineConfig(store=StoreConfig(disk_dir="kv/")))
    engine.ingest(texts)     # computes nothing: every document is found stored (counters["documents_stored"])

Each of `workers` actors loads its own engine once and ingests the batches it is handed, one at a time, as it
finishes the last (so long documents do not leave the other actors idle). The KV an actor computes is worth
something only where the caller can read it: the config must name a store shared by the processes, a disk
folder every actor can reach (`StoreConfig.disk_dir`; a network file system across machines) or a Redis
server (`StoreConfig.redis_url`). Folder writes are atomic and the document index is appended under a file
lock, so actors writing at once lose nothing; an actor's own memory tier holds nothing (it would only cost
its RAM). With Redis the document index is shared there too (store/redis_documents.py), so the caller's
engine finds the actors' documents in its prompts even without the `ingest` call above.

Calibration (the drift maps and the fidelity guard, calibrate.py) is left to the caller: the actors never
calibrate, and the caller's `engine.ingest(texts)` above, which computes no KV, fits them when due, once.

The caller's engine must load the same model with the same chunking settings, or its fingerprint (and so
every key) differs and it finds nothing: name the model by a hub id or a path that means the same file in
every worker. Needs the `ray` extra: pip install 'kvboost-rag[ray]'. Ray is used as the caller set it up
(`ray.init(address=...)` before the call), else started by Ray's own defaults on this machine.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

from .config import EngineConfig

_INSTALL_HINT = "pip install 'kvboost-rag[ray]'"


def ingest_with_ray(texts: Sequence[str], *, model: str | None = None, dtype: str = "float32",
                    config: EngineConfig | None = None, workers: int = 2, batch_size: int = 16,
                    progress: bool | None = None) -> list[str]:
    """Ingest `texts` on `workers` Ray actors, `batch_size` documents per task; returns the document ids in
    input order, the ids `KVBoost.ingest` returns for them. `model` and `dtype` are as in
    `KVBoost.from_pretrained` (`dtype` is used when `config` is None; a config names its own). `progress`: a
    bar over documents as batches finish (None: only on a terminal).

    Raises ValueError for a config without a shared store, and with the engine's message (naming the
    document's index in `texts`) for a document the engine refuses; RuntimeError when a worker could not
    write the store (run again once it takes writes: whatever was stored is reused)."""
    if isinstance(texts, str):
        raise TypeError("ingest_with_ray takes a list of documents; wrap a single one: ingest_with_ray([text])")
    config = _worker_config(config, dtype)
    for name, value in (("workers", workers), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    texts = list(texts)
    if not texts:
        return []
    ray = _import_ray()
    batches = [(start, texts[start:start + batch_size]) for start in range(0, len(texts), batch_size)]
    workers = min(workers, len(batches))
    if not ray.is_initialized():
        ray.init()
    cpus = ray.cluster_resources().get("CPU", 0)
    if workers > cpus:  # each actor holds a CPU for its life: the extra ones would wait for ever
        raise ValueError(f"workers={workers}, but the Ray cluster has {cpus:g} CPUs and each worker takes one; "
                         f"give workers={int(cpus)} or fewer, or a larger cluster")
    actor = ray.remote(num_cpus=1)(_IngestWorker)
    actors = [actor.remote(model, config) for _ in range(workers)]
    try:
        return _run(ray, actors, batches, len(texts), progress)
    finally:
        for a in actors:
            ray.kill(a)


def _worker_config(config: EngineConfig | None, dtype: str) -> EngineConfig:
    """The actors' config: the caller's, refused without a shared store, never calibrating, no memory tier."""
    if config is None:
        config = EngineConfig(dtype=dtype)
    elif dtype not in ("float32", config.dtype):
        raise ValueError(f"dtype={dtype!r} conflicts with config.dtype={config.dtype!r}: give it in the config only")
    if config.store.disk_dir is None and config.store.redis_url is None:
        raise ValueError("ingest_with_ray needs a store shared by the processes: set StoreConfig.disk_dir (a folder "
                         "every worker can reach) or StoreConfig.redis_url. With memory only, the KV each worker "
                         "computes would be lost when it exits, and this process would compute it all again")
    # A memory budget of 0: the actor's memory tier keeps nothing, its writes go straight to the shared tiers.
    return dataclasses.replace(config, calibrate=False, store=dataclasses.replace(config.store, memory_budget_bytes=0))


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"ingest_with_ray needs Ray, which is not installed: {_INSTALL_HINT}", name="ray") from e
    return ray


def _run(ray, actors: list, batches: list[tuple[int, list[str]]], total: int, progress: bool | None) -> list[str]:
    """Hand each idle actor the next batch until none is left; the ids in input order."""
    ids: list[str | None] = [None] * total
    fingerprints: set[str] = set()
    pending = list(reversed(batches))  # popped from the end: input order
    running: dict = {}  # task ref -> (actor, start)

    def hand(a) -> None:
        start, batch = pending.pop()
        running[a.ingest.remote(start, batch)] = (a, start)

    bar = tqdm(total=total, desc="ingest (ray)", unit="doc", disable=not progress if progress is not None else None)
    try:
        for a in actors:
            if pending:
                hand(a)
        while running:
            [done], _ = ray.wait(list(running), num_returns=1)
            a, start = running.pop(done)
            fingerprint, batch_ids = _result(ray, done)
            fingerprints.add(fingerprint)
            ids[start:start + len(batch_ids)] = batch_ids
            bar.update(len(batch_ids))
            if pending:
                hand(a)
        ray.get([a.close.remote() for a in actors])  # the disk tier's index and any held-back document record
    finally:
        bar.close()
    if len(fingerprints) > 1:
        raise RuntimeError(f"the Ray workers loaded different models (fingerprints {sorted(fingerprints)}): name "
                           "the model by a hub id or a path that is the same file on every node")
    return ids


def _result(ray, ref):
    """A task's result; a document the engine refused raises the engine's own error, not Ray's wrapper of it."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (ValueError, TypeError, RuntimeError)):
            raise e.cause from None
        raise


class _IngestWorker:
    """A Ray actor's state: one engine, loaded once, ingesting the batches it is given."""

    def __init__(self, model: str | None, config: EngineConfig):
        from .engine import KVBoost

        self.engine = KVBoost.from_pretrained(model, config=config)

    def ingest(self, start: int, texts: list[str]) -> tuple[str, list[str]]:
        """(the engine's fingerprint, the ids of `texts`, documents start..start+len-1 of the caller's list)."""
        from .store.files import StoreWriteWarning

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", StoreWriteWarning)
            try:
                ids = self.engine.ingest(texts, progress=False, calibrate=False)
            except ValueError:
                _refuse_with_index(self.engine.document, texts, start)
                raise
        for w in caught:
            if issubclass(w.category, StoreWriteWarning):
                # Ingestion that cannot be shared is no ingestion: the caller would compute it all again.
                raise RuntimeError(f"a Ray worker could not write the shared store: {w.message}")
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return self.engine.fingerprint, ids

    def close(self) -> None:
        self.engine.close()


def _refuse_with_index(document: Callable[[str], object], texts: list[str], start: int) -> None:
    """Raise the engine's error for the first document of the batch it refuses, named by its index in the
    caller's list (engine.ingest names it by its index in the batch). Run only once a batch has failed."""
    for i, text in enumerate(texts):
        try:
            document(text)
        except ValueError as e:
            raise ValueError(f"document {start + i}: {e}") from None
