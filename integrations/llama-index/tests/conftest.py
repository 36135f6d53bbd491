"""Fixtures shared by the llama-index-llms-kvboost tests: one engine per session, offline embeddings."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor

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


class Shuffle(BaseNodePostprocessor):
    """Shuffles the retrieved nodes (seeded by their text): the documents reach the LLM in a new order."""

    @classmethod
    def class_name(cls) -> str:
        return "Shuffle"

    def _postprocess_nodes(self, nodes, query_bundle=None):
        nodes = list(nodes)
        random.Random("|".join(n.node.get_content()[:20] for n in nodes)).shuffle(nodes)
        return nodes


class ChatLog(BaseEventHandler):
    """Records every LLM chat (messages and response) LlamaIndex makes, through its instrumentation."""

    chats: list = []

    @classmethod
    def class_name(cls) -> str:
        return "ChatLog"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent):
            self.chats.append((event.messages, event.response))


@pytest.fixture(scope="session")
def engine():
    """The process-wide engine on the bundled model (what KVBoostLLM() uses), loaded once."""
    from llama_index.llms.kvboost import shared_engine

    return shared_engine()


@pytest.fixture(scope="session")
def embed_model():
    return offline_embeddings_module().llamaindex_embedding()


@pytest.fixture
def chat_log():
    dispatcher = get_dispatcher()
    log = ChatLog(chats=[])
    dispatcher.add_event_handler(log)
    yield log
    dispatcher.event_handlers.remove(log)
