"""LangChain's pre-warm steps leave a calibrated store: the guard's predictor and the drift maps are fitted by
the pre-warm itself (no extra step), saved beside the store, and a later process pre-warming the same corpus
fits nothing and computes nothing."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_kvboost import ChatKVBoost, KVBoostPrewarmTransformer

from kvboost_rag import EngineConfig, KVBoost, StoreConfig
from kvboost_rag.models import load

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def loaded():
    return load(None, "float32", "cpu")


PLACES = ["Brekkvik", "Osterlund", "Dovrino", "Sarrento", "Lenwick", "Kessa", "Tavora", "Maldun", "Quenby"]
GOODS = ["copper wire", "tea", "glass jars", "wool", "rice", "printing ink", "spare axles", "salt", "maps"]


def corpus() -> list[Document]:
    # Nine short documents no other test ingests: calibrate.MIN_DOCUMENTS at least, short so that calibration's
    # prompts (8 documents each) stay a few hundred tokens.
    return [Document(page_content=f"The warehouse in {place} holds {40 + 7 * i} crates of {goods}; its keeper "
                                  f"is number {i + 3} on the harbour roll.", metadata={"n": i})
            for i, (place, goods) in enumerate(zip(PLACES, GOODS, strict=True))]


def test_prewarm_calibrates_once_and_a_new_process_fits_nothing(loaded, tmp_path):
    store = StoreConfig(disk_dir=tmp_path)  # the defaults otherwise: calibration on, the guard balanced
    first = KVBoost(loaded, EngineConfig(store=store))
    assert first.predictor is None and first.drift is None
    out = KVBoostPrewarmTransformer(ChatKVBoost(engine=first), show_progress=False).transform_documents(corpus())
    assert len(out) == 9 and first.counters["documents_computed"] == 9
    assert first.counters["calibrations"] == 1
    assert first.predictor is not None and first.predictor.tokens > 0 and first.drift is not None
    assert first.fidelity_path.exists() and first.drift_path.exists()

    # Another process on the same store (a fresh engine on its folder), pre-warming the same corpus again.
    second = KVBoost(loaded, EngineConfig(store=store))
    assert second.predictor == first.predictor  # read from the store, not fitted again
    ids = ChatKVBoost(engine=second).prewarm(corpus(), show_progress=False)
    assert ids == [d.metadata["kvboost_doc_id"] for d in out]
    assert second.counters["calibrations"] == 0 and second.counters["documents_computed"] == 0
