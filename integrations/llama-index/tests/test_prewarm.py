"""KVBoostPrewarm in an IngestionPipeline: idempotent, text-neutral, safe with IngestionCache.

Evidence of "nothing computed" is the engine's own counters (`documents_computed`, one per document
whose KV was computed) and, as a second witness, the number of model forwards: the adapter's
`run_layers` is wrapped with a counter (the real forward still runs; nothing about the model is faked).
"""

from __future__ import annotations

import pytest
from llama_index.core import Document
from llama_index.core.ingestion import IngestionCache, IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode
from llama_index.llms.kvboost import DOC_ID_KEY, KVBoostLLM, KVBoostPrewarm, llm_text

from kvboost_rag import EngineConfig, KVBoost, StoreConfig
from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.models import load

pytestmark = pytest.mark.real_model


class Computed:
    """Documents computed, and document rows the model ran, by `engine` since the last `take()`."""

    def __init__(self, engine: KVBoost, monkeypatch):
        # The shared engine's shadow checks of earlier tests' answers run forwards in the background: let them end.
        assert engine.shadow.drain(timeout=120)
        self.engine, self.forwards = engine, 0
        self.documents = engine.counters["documents_computed"]
        real = engine.adapter.run_layers

        def counted(hidden, positions, *args, **kwargs):
            # The ingestion context is encoded once per engine, from position 0; documents come after it, side
            # by side (a row each of one forward's hidden states [B, S, H]).
            context = engine._doc_context and engine._context_cache is None and int(positions[0]) == 0
            self.forwards += 0 if context else hidden.shape[0]
            return real(hidden, positions, *args, **kwargs)

        monkeypatch.setattr(engine.adapter, "run_layers", counted)
        # Calibration (run by ingestion once the corpus is large enough) runs forwards of its own: not counted.
        calibrate = engine.calibrate

        def uncounted(*args, **kwargs):
            before = self.forwards
            try:
                return calibrate(*args, **kwargs)
            finally:
                self.forwards = before

        monkeypatch.setattr(engine, "calibrate", uncounted)

    def take(self) -> int:
        documents = self.engine.counters["documents_computed"] - self.documents
        assert documents == self.forwards  # ingestion: one row per computed document
        self.documents, self.forwards = self.engine.counters["documents_computed"], 0
        return documents


def documents(n_items: int, offset: int = 0) -> list[Document]:
    # synthetic_k8: documents no other test ingests, so the first run really computes.
    items = load_items(bundled("synthetic_k8"), limit=offset + n_items)[offset:]
    return [Document(text=text, metadata={"topic": item.id}, excluded_embed_metadata_keys=["topic"])
            for item in items for text in item.documents[:3]]


def splitter() -> SentenceSplitter:
    return SentenceSplitter(chunk_size=96, chunk_overlap=0)


def test_second_run_computes_nothing(engine, monkeypatch):
    computed = Computed(engine, monkeypatch)
    # No IngestionCache (the pipeline has one by default): the transformation itself runs twice.
    pipeline = IngestionPipeline(transformations=[splitter(), KVBoostPrewarm(KVBoostLLM(engine=engine))],
                                 disable_cache=True)
    first = pipeline.run(documents=documents(1))
    assert len(first) > 3 and computed.take() == len(first)  # every new node computed
    second = pipeline.run(documents=documents(1))
    assert computed.take() == 0
    assert [n.metadata[DOC_ID_KEY] for n in second] == [n.metadata[DOC_ID_KEY] for n in first]


def test_key_changes_neither_embedded_nor_llm_text(engine):
    plain = IngestionPipeline(transformations=[splitter()]).run(documents=documents(1, offset=1))
    warmed = IngestionPipeline(transformations=[splitter(), KVBoostPrewarm(engine, show_progress=True)]).run(
        documents=documents(1, offset=1))
    for a, b in zip(plain, warmed, strict=True):
        assert b.metadata[DOC_ID_KEY] and DOC_ID_KEY not in a.metadata
        assert DOC_ID_KEY in b.excluded_embed_metadata_keys and DOC_ID_KEY in b.excluded_llm_metadata_keys
        assert b.get_content(MetadataMode.EMBED) == a.get_content(MetadataMode.EMBED)
        assert b.get_content(MetadataMode.LLM) == a.get_content(MetadataMode.LLM)
        # What was stored is the node's text as the LLM sees it, LLM-visible metadata included.
        stored = engine.documents.get(llm_text(b).strip())
        assert stored is not None and stored.doc_id == b.metadata[DOC_ID_KEY]
        assert stored.text.startswith("topic: ")
    # Running the warmed nodes through again is a no-op: same ids, the exclusions not duplicated.
    again = KVBoostPrewarm(engine)(warmed)
    assert all(n.excluded_llm_metadata_keys.count(DOC_ID_KEY) == 1 for n in again)


def test_ingestion_cache_hits_only_for_the_same_store(engine, monkeypatch):
    cache = IngestionCache()
    docs = documents(1, offset=2)

    def run(target: KVBoost):
        pipeline = IngestionPipeline(transformations=[splitter(), KVBoostPrewarm(target)], cache=cache)
        return pipeline.run(documents=docs)

    computed = Computed(engine, monkeypatch)
    first = run(engine)
    assert computed.take() == len(first)
    assert [n.metadata[DOC_ID_KEY] for n in run(engine)] == [n.metadata[DOC_ID_KEY] for n in first]
    assert computed.take() == 0  # a cache hit: this engine's store already holds every node

    # Another engine (a fresh in-memory store) misses the cache, so its KV is computed rather than
    # its nodes claiming KV it never got. Not calibrating: a second fit of the same corpus (~55 s on 2 cores) has
    # nothing to do with the cache.
    other = KVBoost.from_pretrained(calibrate=False)
    other_computed = Computed(other, monkeypatch)
    nodes = run(other)
    assert other_computed.take() == len(nodes) and computed.take() == 0
    assert all(other.documents.get(llm_text(n).strip()) is not None for n in nodes)


def test_prewarm_leaves_a_calibrated_store_and_a_new_process_fits_nothing(tmp_path):
    # The defaults (calibration on, the guard balanced) on a persistent store: the pipeline's pre-warm fits the
    # guard's predictor and the drift maps by itself; a later process pre-warming the same nodes fits and
    # computes nothing.
    store = StoreConfig(disk_dir=tmp_path)
    loaded = load(None, "float32", "cpu")
    first = KVBoost(loaded, EngineConfig(store=store))
    assert first.predictor is None
    pipeline = IngestionPipeline(transformations=[KVBoostPrewarm(KVBoostLLM(engine=first))], disable_cache=True)
    corpus = [Document(text=f"The tram depot in {town} keeps {12 + 5 * i} trams; its oldest was built in {1890 + i}.")
              for i, town in enumerate(["Arvo", "Belmont", "Corra", "Dunmere", "Elsk", "Farrow", "Gilde", "Holm",
                                        "Ivrea"])]
    nodes = pipeline.run(documents=corpus)
    assert len(nodes) == 9 and first.counters["documents_computed"] == 9
    assert first.counters["calibrations"] == 1 and first.predictor.tokens > 0 and first.drift is not None
    assert first.fidelity_path.exists() and first.drift_path.exists()

    second = KVBoost(loaded, EngineConfig(store=store))
    assert second.predictor == first.predictor  # read from the store
    ids = KVBoostLLM(engine=second).prewarm(nodes, show_progress=False)
    assert ids == [n.metadata[DOC_ID_KEY] for n in nodes]
    assert second.counters["calibrations"] == 0 and second.counters["documents_computed"] == 0
