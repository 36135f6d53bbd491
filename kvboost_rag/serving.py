"""Serving one engine to many callers: one engine per (model, dtype, doc_context, device) in the process, and stepping
an engine stream from asyncio. Framework-neutral; both integrations (LangChain, LlamaIndex) and the HTTP server
use it (what the LLM classes share beyond that is in `llm.py`).

Several LLM objects (one per chain, per temperature, per framework...) must not load the model, nor
keep separate KV stores, more than once: `shared_engine` hands every caller the same `KVBoost`.

`astream_pieces` runs each step of `KVBoost.stream` (the prefill, then one decode step) on a worker
thread of a pool per engine (up to WORKERS of them), so the event loop never blocks on the model and concurrent
requests are in their decode steps at the same time: the engine's batcher (batching.py) runs those steps as
one forward. A stream's own steps run one after another (the next is submitted once the last is back), and a
cancelled stream is closed once the step it is in finishes, never while it runs (a generator cannot be closed
while executing). The engine holds its own lock per forward, so prefills and batches still take turns.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .config import ChunkingConfig, EngineConfig, check_doc_context
from .engine import KVBoost, StreamPiece
from .models import BUNDLED_NAME, DTYPES, resolve_device

_ENGINES: dict[tuple[str, str, str, str], KVBoost] = {}
_LOCK = threading.Lock()
_WORKERS: weakref.WeakKeyDictionary[KVBoost, ThreadPoolExecutor] = weakref.WeakKeyDictionary()
_DONE = object()
# Streams stepped at once per engine: more than a decode batch usefully holds; further ones queue for a worker.
WORKERS = 32


def model_key(model: str | None) -> str:
    """A stable name for the cache: the bundled model's name, a resolved local folder, or a hub id."""
    if model is None:
        return BUNDLED_NAME
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def shared_engine(model: str | None = None, dtype: str = "float32", doc_context: str | None = None,
                  device: str = "auto") -> KVBoost:
    """The process-wide engine for (model, dtype, doc_context, device), loaded on first use.

    `doc_context` (ChunkingConfig.doc_context; None = its default) decides how documents are encoded
    at ingestion, so engines that differ in it keep different stores, and each loads its own copy of the
    model (an engine's lock guards the forwards of its own model only). `device` is EngineConfig.device; "auto"
    and the device it resolves to name the same engine.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    doc_context = check_doc_context(doc_context or ChunkingConfig.doc_context)
    where = str(resolve_device(device))  # a device this machine lacks fails here, naming what to do
    key = (model_key(model), dtype, doc_context, where)
    # Loading under the lock: a second caller waits for the first load instead of loading again.
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            config = EngineConfig(dtype=dtype, chunking=ChunkingConfig(doc_context=doc_context), device=where)
            engine = KVBoost.from_pretrained(model, config=config)
            _ENGINES[key] = engine
        return engine


def _worker(engine: KVBoost) -> ThreadPoolExecutor:
    with _LOCK:
        pool = _WORKERS.get(engine)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kvboost")
            _WORKERS[engine] = pool
        return pool


async def astream_pieces(engine: KVBoost, stream: Iterator[StreamPiece]) -> AsyncIterator[StreamPiece]:
    """Iterate `stream` (made by `engine.stream`) without blocking the event loop."""
    pool = _worker(engine)
    step = None  # the step in flight, if any
    try:
        while True:
            step = pool.submit(next, stream, _DONE)
            piece = await asyncio.wrap_future(step)
            if piece is _DONE:
                return
            yield piece
    finally:
        # A cancelled stream may be inside a step on a worker: close it once that step is done (a step that never
        # started was cancelled with the await, and is done).
        def close(_=None) -> None:
            pool.submit(stream.close)

        if step is None:
            close()
        else:
            step.add_done_callback(close)  # runs at once when the step is done already


_SCOPES: weakref.WeakKeyDictionary[KVBoost, str] = weakref.WeakKeyDictionary()


def engine_scope(engine: KVBoost) -> str:
    """Names where `engine` keeps its KV: the same string means the same stored documents.

    A persistent store (disk_dir) is named by its folder, so it stays valid across processes; an
    in-memory store lives and dies with its engine object, so it gets a fresh name per engine.
    """
    disk_dir = engine.config.store.disk_dir
    if disk_dir is not None:
        return f"{engine.fingerprint[:16]}@{Path(disk_dir).resolve()}"
    with _LOCK:
        scope = _SCOPES.get(engine)
        if scope is None:
            scope = _SCOPES[engine] = f"{engine.fingerprint[:16]}@memory:{uuid.uuid4().hex}"
        return scope
