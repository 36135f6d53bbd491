"""The engine over a persistent store: another process serves what one ingested, and damaged files
are detected and recomputed, never served."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from kvboost_rag import ChunkingConfig, EngineConfig, StoreConfig
from kvboost_rag.store.disk import StoreIntegrityWarning, entry_path
from kvboost_rag.store.folder import verify_dir


def test_ingest_in_one_process_answer_in_another(tmp_path, docs):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(docs):
        (folder / f"doc{i}.txt").write_text(text)
    store = tmp_path / "store"
    cli = [sys.executable, "-m", "kvboost_rag.cli"]
    ingest = subprocess.run(cli + ["ingest", str(folder), "--store", str(store)], capture_output=True, text=True,
                            timeout=600, check=True)
    assert f"computed {len(docs)}, already stored 0" in ingest.stdout
    ask = subprocess.run(cli + ["ask", "Who founded the Halvard Brewing Company?", "--docs", str(folder), "--store",
                                str(store), "--strategy", "naive", "--max-new-tokens", "8"],
                         capture_output=True, text=True, timeout=600, check=True)
    assert f"0 computed, {len(docs)} found in the store" in ask.stdout
    reused = int(re.search(r"reused (\d+)", ask.stdout).group(1))
    assert reused > 0.5 * sum(len(d) for d in docs) / 6  # most document tokens came from disk


@pytest.fixture
def disk_engines(make_tiny_engine, tmp_path):
    # Documents stored alone: a prompt of just the document is then an exact hit, so a test sees what is served.
    def make(seed=0, folder="store"):
        store = StoreConfig(disk_dir=tmp_path / folder)
        config = EngineConfig(chunking=ChunkingConfig(doc_context="none"), store=store)
        return make_tiny_engine(config, seed=seed)
    return make


def damage_truncate(path, _):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def damage_flip(path, _):
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF  # inside the tensor bytes
    path.write_bytes(bytes(data))


def damage_swap(path, foreign):
    shutil.copyfile(foreign, path)


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip, damage_swap])
def test_damaged_files_are_detected_and_recomputed(disk_engines, docs, damage, tmp_path):
    engine = disk_engines()
    engine.ingest(docs[:2])
    engine.close()
    other = disk_engines(seed=1, folder="foreign")  # another model's file of the same document
    other.ingest(docs[:1])
    other.close()
    keys = engine.document(docs[0])
    from kvboost_rag import keys as keyring

    ((pkey, _),) = keyring.chain(engine.fingerprint, keys.chunk_tokens())
    ((foreign_key, _),) = keyring.chain(other.fingerprint, keys.chunk_tokens())
    path = entry_path(tmp_path / "store", pkey)
    damage(path, entry_path(tmp_path / "foreign", foreign_key))

    fresh = disk_engines()  # a restart over the damaged store
    with pytest.warns(StoreIntegrityWarning):
        pre = fresh.prefill(docs[0], "prefix", write_back=False)  # the document alone: an exact hit if intact
    assert pre.exact_tokens == 0  # the damaged chunk was not served...
    truth = fresh.adapter.reference_logits(pre.plan.token_ids)[-1]
    assert (pre.logits - truth).abs().max() < 1e-4  # ...and the answer is the full prefill's
    fresh.ingest(docs[:1])  # re-ingesting repairs the file
    assert fresh.counters["documents_computed"] == 1
    fresh.close()
    assert verify_dir(tmp_path / "store", fresh.fingerprint).ok
    again = disk_engines().prefill(docs[0], "prefix", write_back=False)
    assert again.exact_tokens == again.prompt_tokens - 1  # the last token runs again for its logits


def test_ingesting_twice_computes_nothing_the_second_time(disk_engines, docs):
    engine = disk_engines()
    engine.ingest(docs)
    assert engine.counters["documents_computed"] == len(docs)
    engine.close()
    restarted = disk_engines()
    restarted.ingest(docs)
    assert restarted.counters["documents_computed"] == 0 and restarted.counters["documents_stored"] == len(docs)
