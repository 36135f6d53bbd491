"""Fixtures shared by the langchain-kvboost tests: one engine per session, the offline embeddings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

COOKBOOK = Path(__file__).resolve().parents[3] / "cookbook"


def offline_embeddings_module():
    """cookbook/offline_embeddings.py, loaded once per process (the tests use what the examples use)."""
    name = "offline_embeddings"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, COOKBOOK / "offline_embeddings.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def engine():
    """The process-wide engine on the bundled model (what ChatKVBoost() uses), loaded once."""
    from langchain_kvboost import shared_engine

    return shared_engine()


@pytest.fixture(scope="session")
def embeddings():
    return offline_embeddings_module().langchain_embeddings()
