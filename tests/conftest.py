"""Engines shared by the tests: a tiny random-weight Llama (fast) and the bundled SmolLM2 (the truth)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.bench.data import BenchItem
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.config import RepairConfig
from kvboost_rag.models import LoadedModel, convert_bundled, load


@pytest.fixture(scope="session")
def bundled_tokenizer():
    folder, _ = convert_bundled()
    return AutoTokenizer.from_pretrained(folder)


def tiny_model(seed: int = 0, vocab_size: int = 49152, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config = LlamaConfig(**(settings | overrides))
    return LlamaForCausalLM(config).eval()


# The methods as they are: no calibration at ingestion, no fidelity guard (a random model is unsure of every
# token, so the guard would serve full prefills). The guard's and calibration's tests pass their own configs.
BARE = EngineConfig(calibrate=False, repair=RepairConfig(fidelity="fast"))


@pytest.fixture
def make_tiny_engine(bundled_tokenizer):
    """A factory: fresh engines on a tiny random Llama with the real tokenizer (own store each)."""

    def make(config: EngineConfig | None = None, seed: int = 0, store=None, guarded: bool = False,
             **overrides) -> KVBoost:
        """`guarded`: keep the config's calibration and fidelity guard; else the engine runs bare (see BARE)."""
        loaded = LoadedModel(tiny_model(seed, **overrides), bundled_tokenizer, "tiny-random-llama", f"seed{seed}")
        config = config or EngineConfig()
        if not guarded:
            config = dataclasses.replace(config, calibrate=False,
                                         repair=dataclasses.replace(config.repair, fidelity="fast"))
        return KVBoost(loaded, config, store=store)

    return make


@pytest.fixture(scope="session")
def real_loaded():
    # On the CPU wherever the suite runs: its truths (tolerances, agreements) were measured there; the CUDA path
    # has its own tests (test_device.py).
    return load(None, "float32", "cpu")


@pytest.fixture
def real_engine(real_loaded):
    """The bundled SmolLM2-135M-Instruct in fp32, with a fresh store, running the methods bare: no
    calibration at ingestion, no fidelity guard (their own tests build engines with them)."""
    return KVBoost(real_loaded, BARE)


DOCS = [
    "The Halvorsen Brewing Company was founded in 1873 in the town of Brekkvik. It employs 412 people and "
    "exports its dark ale to twelve countries. Its founder, Ingrid Halvorsen, learned brewing in Bremen.",
    "The Halvard Brewing Company was founded in 1921 in Osterlund. It employs 88 people and is known for a "
    "pale lager brewed with water from the springs above the town. It was founded by Tomas Halvard.",
    "Mira Castellane is a painter from Dovrino who completed 409 works over her career, most of them "
    "landscapes of the northern coast. She taught for twenty years at the academy in Sarrento.",
    "The Velmar Observatory stands on Mount Aske at 2,140 metres. It opened in 1962 and its main telescope "
    "has a mirror of 3.6 metres. The observatory is run by the University of Lenwick.",
]


@pytest.fixture
def docs() -> list[str]:
    return list(DOCS)


@pytest.fixture
def rag_prompt():
    """rag_prompt(docs, question) -> chat messages laid out as the bench lays them out."""

    def make(documents: list[str], question: str) -> list[dict]:
        item = BenchItem(id="t", documents=tuple(documents), question=question,
                         system="Answer the question using only the documents.")
        return render_prompt(item)

    return make
