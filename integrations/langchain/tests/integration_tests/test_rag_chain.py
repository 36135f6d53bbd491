"""A LangChain RAG chain over pre-warmed documents, retrieved in shuffled order.

What is checked: the prompt LangChain builds holds every retrieved document verbatim (so the engine
finds it and reuses its KV wherever it sits), the default strategy reuses document KV out of order,
and an exact repair (cacheblend recomputing every reused token) gives the same greedy answer as a
full prefill while still reading the shared prefix from the cache.
"""

from __future__ import annotations

import random

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_kvboost import ChatKVBoost, KVBoostPrewarmTransformer
from langchain_kvboost.chat_models import _to_chat_message

from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.likeness import likeness

pytestmark = pytest.mark.real_model

SYSTEM = "Answer the question using only the documents. Reply with the answer only."
PROMPT = ChatPromptTemplate.from_messages([("system", SYSTEM + "\n\nDocuments:\n\n{context}"),
                                           ("human", "{question}")])


def shuffled(docs: list[Document]) -> list[Document]:
    """The retriever's order, shuffled (seeded by the content, so every run sees the same order)."""
    docs = list(docs)
    random.Random("|".join(d.page_content[:20] for d in docs)).shuffle(docs)
    return docs


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


@pytest.fixture(scope="module")
def corpus():
    items = load_items(bundled("tiny"))
    docs = [Document(page_content=text, metadata={"item": item.id}) for item in items for text in item.documents]
    return items, docs


@pytest.fixture(scope="module")
def retriever(engine, embeddings, corpus):
    _, docs = corpus
    docs = KVBoostPrewarmTransformer(engine, show_progress=False).transform_documents(docs)
    store = InMemoryVectorStore(embeddings)
    store.add_documents(docs)
    return store.as_retriever(search_kwargs={"k": 3})


def rag_chain(retriever, llm):
    context = retriever | RunnableLambda(shuffled) | RunnableLambda(format_docs)
    return {"context": context, "question": RunnablePassthrough()} | PROMPT | llm


def test_prompt_holds_retrieved_documents_verbatim(engine, retriever, corpus):
    items, _ = corpus
    for item in items:
        docs = shuffled(retriever.invoke(item.question))
        messages = PROMPT.invoke({"context": format_docs(docs), "question": item.question}).to_messages()
        rendered = engine.render([_to_chat_message(m) for m in messages])
        found = [span.document.doc_id for span in engine.documents.find(rendered)]
        assert found == [d.metadata["kvboost_doc_id"] for d in docs]


def test_shuffled_chain_reuses_kv_and_matches_full(engine, retriever, corpus):
    items, _ = corpus
    llm = ChatKVBoost(engine=engine, max_tokens=16)
    agree = 0
    for item in items:
        full = rag_chain(retriever, llm.bind(strategy="full")).invoke(item.question)
        default = rag_chain(retriever, llm).invoke(item.question)
        unguarded = rag_chain(retriever, llm.bind(fidelity="fast")).invoke(item.question)
        exact = rag_chain(retriever, llm.bind(recompute_ratio=1.0)).invoke(item.question)

        assert full.response_metadata["reused_tokens"] == 0
        # The documents' KV is reused although their order is new (unguarded: the guard may not trust it).
        meta = unguarded.response_metadata
        docs = retriever.invoke(item.question)
        doc_tokens = sum(len(engine.documents.get(d.page_content).token_ids) for d in docs)
        assert meta["strategy"] == "cacheblend"
        assert meta["reused_tokens"] - meta["exact_tokens"] >= 0.5 * doc_tokens  # out-of-order reuse
        assert default.usage_metadata["input_tokens"] == full.usage_metadata["input_tokens"]
        # Documents that are records of one template are held to strict by the default (likeness.py).
        alike = likeness([d.page_content for d in docs]) >= engine.config.strict_likeness
        assert default.response_metadata["fidelity"] == ("strict" if alike else "balanced")
        # Exact repair: every reused document token is recomputed, the prefix is still read from the
        # cache (written back by the request above), and the greedy answer is a full prefill's.
        assert exact.response_metadata["reused_tokens"] > 0 and exact.response_metadata["recompute_budget"] == 1.0
        assert exact.content == full.content
        agree += default.content == full.content
    print(f"default cacheblend agrees with full on {agree}/{len(items)} answers")


def test_stuff_documents_chain_keeps_boundaries(engine, retriever, corpus):
    combine = pytest.importorskip("langchain_classic.chains.combine_documents")

    class LastMessage(BaseCallbackHandler):
        message = None

        def on_llm_end(self, response, **kwargs):
            self.message = response.generations[0][0].message

    items, _ = corpus
    # Unguarded: what is checked is which KV the chain's prompt could reuse, not whether the guard trusts it.
    llm = ChatKVBoost(engine=engine, max_tokens=16, repair={"fidelity": "fast"})
    chain = combine.create_stuff_documents_chain(llm, PROMPT)
    for item in items:
        docs = shuffled(retriever.invoke(item.question))
        seen = LastMessage()
        answer = chain.invoke({"context": docs, "question": item.question}, config={"callbacks": [seen]})
        meta = seen.message.response_metadata
        assert answer == seen.message.content
        doc_tokens = sum(len(engine.documents.get(d.page_content).token_ids) for d in docs)
        # Every document's KV came from the store (less the few tokens the repair recomputes).
        assert meta["reused_tokens"] >= 0.5 * doc_tokens
