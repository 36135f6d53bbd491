"""LangChain integration of kvboost-rag: a chat model that reuses precomputed document KV."""

from kvboost_rag.serving import shared_engine
from langchain_kvboost.chat_models import ChatKVBoost
from langchain_kvboost.prewarm import DOC_ID_KEY, KVBoostPrewarmTransformer

__all__ = ["ChatKVBoost", "KVBoostPrewarmTransformer", "DOC_ID_KEY", "shared_engine"]
__version__ = "0.1.0"
