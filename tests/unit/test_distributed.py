"""Ingestion on Ray actors (kvboost_rag.distributed) against a real local Ray, bound to 127.0.0.1.

The actors load their model from a folder: tests/conftest.py's tiny random Llama saved with the bundled
tokenizer. What they store must be what one process stores, found by a caller's engine on the same store.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvboost_rag import ChunkingConfig, EngineConfig, KVBoost, StoreConfig
from kvboost_rag.distributed import ingest_with_ray
from kvboost_rag.models import convert_bundled
from kvboost_rag.store.disk import DiskStore
from kvboost_rag.store.folder import list_entry_files

# Ray takes this machine's network address as its node's, and binds every server to all interfaces, unless
# it runs as a single-machine Ray (read when ray is first imported): then everything listens on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvboost-rag[ray]')")

# Several chunks per document (max_chunk_tokens), so that chunk chaining across workers is covered.
CHUNKING = ChunkingConfig(max_chunk_tokens=24)


def _tiny_model():
    """tests/conftest.py's tiny random Llama; that file cannot be imported by name (see test_server.py)."""
    spec = importlib.util.spec_from_file_location("kvboost_tests_conftest", Path(__file__).parents[1] / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_model(), module.DOCS


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        pytest.skip("a Ray is already running in this process; these tests start their own")
    context = ray.init(num_cpus=2, include_dashboard=False, address="local", _node_ip_address="127.0.0.1",
                       log_to_driver=False, configure_logging=False)
    try:
        assert context.address_info["node_ip_address"] == "127.0.0.1", "Ray is not bound to 127.0.0.1 only"
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_and_docs(tmp_path_factory):
    """A folder the actors load the tiny model from, and the documents."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    model, docs = _tiny_model()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(convert_bundled()[0]).save_pretrained(folder)
    texts = [*docs, docs[0] + " It was renovated in 1990.", "A short one."]
    return str(folder), texts


def _config(folder: Path, **store) -> EngineConfig:
    return EngineConfig(chunking=CHUNKING, store=StoreConfig(disk_dir=folder, **store), calibrate=False)


def _entries(folder: Path, fingerprint: str) -> dict[str, object]:
    store = DiskStore(folder, fingerprint)
    return {p.stem: store.get(bytes.fromhex(p.stem)) for p in list_entry_files(folder)}


def test_workers_store_what_one_process_stores(local_ray, model_and_docs, tmp_path):
    model, texts = model_and_docs
    ids = ingest_with_ray(texts, model=model, config=_config(tmp_path / "ray"), workers=2, batch_size=2,
                          progress=False)

    # One process, its own store: the same ids, in input order.
    with KVBoost.from_pretrained(model, config=_config(tmp_path / "one")) as alone:
        assert ids == alone.ingest(texts, progress=False)
        fingerprint = alone.fingerprint

    # A caller's engine on the workers' store computes nothing: every document is found stored.
    with KVBoost.from_pretrained(model, config=_config(tmp_path / "ray")) as caller:
        assert caller.fingerprint == fingerprint
        assert caller.ingest(texts, progress=False) == ids
        assert caller.counters["documents_stored"] == len(texts)
        assert caller.counters["documents_computed"] == 0

    # The stored KV: the same chunks, the same numbers (actors run torch on one thread each).
    spread, single = _entries(tmp_path / "ray", fingerprint), _entries(tmp_path / "one", fingerprint)
    assert spread.keys() == single.keys() and len(single) > len(texts)
    for key, entry in single.items():
        other = spread[key]
        assert other is not None and entry is not None
        assert (other.token_ids, other.start, other.content_key) == (entry.token_ids, entry.start, entry.content_key)
        torch.testing.assert_close(other.keys, entry.keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(other.values, entry.values, rtol=0, atol=1e-6)


def test_a_memory_only_store_is_refused(model_and_docs):
    model, texts = model_and_docs
    with pytest.raises(ValueError, match="StoreConfig.disk_dir.*redis_url.*lost"):
        ingest_with_ray(texts, model=model, config=EngineConfig(calibrate=False))
    with pytest.raises(ValueError, match="shared by the processes"):
        ingest_with_ray(texts, model=model)  # no config: memory only too


def test_an_empty_document_is_refused_by_its_index(local_ray, model_and_docs, tmp_path):
    model, texts = model_and_docs
    bad = [*texts[:3], "   ", texts[3]]
    with pytest.raises(ValueError, match=r"^document 3: empty document"):
        ingest_with_ray(bad, model=model, config=_config(tmp_path), workers=1, batch_size=2, progress=False)


def test_bad_arguments_are_refused_before_ray_starts(model_and_docs, tmp_path):
    model, texts = model_and_docs
    with pytest.raises(TypeError, match="list of documents"):
        ingest_with_ray(texts[0], model=model, config=_config(tmp_path))
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        ingest_with_ray(texts, model=model, config=_config(tmp_path), workers=0)
    with pytest.raises(ValueError, match="conflicts with config.dtype"):
        ingest_with_ray(texts, model=model, dtype="bfloat16", config=_config(tmp_path))
    assert ingest_with_ray([], model=model, config=_config(tmp_path)) == []


def test_the_ingest_command_with_ray_workers(local_ray, model_and_docs, tmp_path, capsys):
    from kvboost_rag.cli import main

    model, texts = model_and_docs
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(text)
    store = tmp_path / "kv"
    assert main(["ingest", str(tmp_path), "--ray-workers", "2"]) == 2
    assert "--ray-workers needs --store" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="too few to calibrate"):  # 6 documents; calibration is left to this process
        assert main(["ingest", str(tmp_path), "--store", str(store), "--model", model, "--ray-workers", "2",
                     "--max-chunk-tokens", str(CHUNKING.max_chunk_tokens)]) == 0
    out = capsys.readouterr().out
    assert f"ray: documents {len(texts)} ingested on 2 workers" in out
    assert f"documents {len(texts)} (computed 0, already stored {len(texts)})" in out
