"""KVBoostPrewarmTransformer: a document transformer that stores each document's KV on the way in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import BaseDocumentTransformer, Document

from kvboost_rag import KVBoost
from kvboost_rag.llm import ingest

from .chat_models import ChatKVBoost

DOC_ID_KEY = "kvboost_doc_id"


class KVBoostPrewarmTransformer(BaseDocumentTransformer):
    """Ingest every document's `page_content` into a KVBoost engine; pass the documents on.

    Put it after the text splitter, so the KV is computed for the exact chunks the retriever will
    return (and a stuff chain will paste into the prompt):

        ```python
        splits = RecursiveCharacterTextSplitter(chunk_size=800).split_documents(docs)
        splits = KVBoostPrewarmTransformer(llm).transform_documents(splits)
        vectorstore.add_documents(splits)
        ```

    Each returned document is a copy with the engine's document id under
    `metadata["kvboost_doc_id"]`; the text is unchanged. Documents with no text are passed on
    as they are. Idempotent: a document already stored costs a lookup.
    """

    def __init__(self, llm: ChatKVBoost | KVBoost, *, pin: bool = False, show_progress: bool = True,
                 metadata_key: str = DOC_ID_KEY):
        self.engine = llm.client if isinstance(llm, ChatKVBoost) else llm
        self.pin = pin
        self.show_progress = show_progress
        self.metadata_key = metadata_key

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        ids = ingest(self.engine, [d.page_content for d in documents], pin=self.pin, progress=self.show_progress)
        return [doc.model_copy(update={"metadata": {**doc.metadata, self.metadata_key: doc_id}}) if doc_id else doc
                for doc, doc_id in zip(documents, ids, strict=True)]
