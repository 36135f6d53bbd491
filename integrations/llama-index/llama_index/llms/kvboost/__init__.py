"""LlamaIndex integration of kvboost-rag: an LLM that reuses precomputed document KV."""

from llama_index.llms.kvboost.base import KVBoostLLM
from llama_index.llms.kvboost.prewarm import DOC_ID_KEY, KVBoostPrewarm, llm_text

from kvboost_rag.serving import shared_engine

__all__ = ["KVBoostLLM", "KVBoostPrewarm", "DOC_ID_KEY", "llm_text", "shared_engine"]
__version__ = "0.1.0"
