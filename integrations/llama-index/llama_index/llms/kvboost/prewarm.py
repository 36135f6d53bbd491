"""KVBoostPrewarm: an IngestionPipeline transformation that stores each node's KV as the LLM will see it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from kvboost_rag import KVBoost
from kvboost_rag.llm import ingest
from kvboost_rag.serving import engine_scope

from .base import KVBoostLLM

DOC_ID_KEY = "kvboost_doc_id"


def llm_text(node: BaseNode) -> str:
    """The text of `node` exactly as a response synthesizer puts it into the prompt.

    The default (compact) mode takes `node.get_content(metadata_mode=MetadataMode.LLM)` (the
    text with its LLM-visible metadata), strips it, and joins the nodes with blank lines; the
    other modes use the same per-node string. The engine strips documents too, so this string
    is found verbatim in the prompt.
    """
    return node.get_content(metadata_mode=MetadataMode.LLM)


class KVBoostPrewarm(TransformComponent):
    """Precompute and store the KV of every node's text as the LLM will see it.

    Put it last in the pipeline (after the splitter and anything that changes text or metadata the
    LLM sees), so the stored text is the text retrieved later:

    ```python
    pipeline = IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=256), embed_model, KVBoostPrewarm(llm, show_progress=True)])
    nodes = pipeline.run(documents=docs)
    ```

    Each node gets its document id under `metadata["kvboost_doc_id"]`; that key is added to the
    node's `excluded_embed_metadata_keys` and `excluded_llm_metadata_keys`, so neither the embedded
    text nor the LLM text changes. Idempotent: a node already stored costs a lookup, and computes
    nothing. Nodes with no text are passed on untouched.

    With an IngestionCache, a cache hit skips this step: `engine_scope` is part of the cache key,
    so a hit happens only where the same KV store already holds these nodes (the same engine
    object, or the same persistent `disk_dir`).
    """

    show_progress: bool = Field(default=False, description="Show a progress bar while ingesting.")
    pin: bool = Field(default=False, description="Pin the stored chunks (never evicted from memory).")
    metadata_key: str = Field(default=DOC_ID_KEY, description="Node metadata key that receives the doc id.")
    engine_scope: str = Field(
        default="",
        description="Which KV store the nodes go to (part of the IngestionCache key); set from the engine.")

    _engine: KVBoost = PrivateAttr()

    def __init__(self, llm: KVBoostLLM | KVBoost, **kwargs: Any) -> None:
        engine = llm.client if isinstance(llm, KVBoostLLM) else llm
        kwargs.setdefault("engine_scope", engine_scope(engine))
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVBoostPrewarm"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        key = self.metadata_key
        texts = []
        for node in nodes:
            # Excluded first: the key must never be part of the text whose KV we store.
            for excluded in (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys):
                if key not in excluded:
                    excluded.append(key)
            texts.append(llm_text(node))
        ids = ingest(self._engine, texts, pin=self.pin, progress=self.show_progress)
        for node, doc_id in zip(nodes, ids, strict=True):
            if doc_id:
                node.metadata[key] = doc_id
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)
