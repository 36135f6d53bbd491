"""A LangChain RAG chain whose documents' KV is computed once, at ingestion.

    python cookbook/langchain_rag.py [--items 3] [--k 4] [--strategy cacheblend]

Offline: the bundled SmolLM2-135M-Instruct, the bundled synthetic benchmark documents (invented
towns, ships, ... with look-alike distractors) and offline embeddings (see offline_embeddings.py).
The retriever's order is shuffled before the prompt is built: the stored KV is reused wherever a
document lands. Prints each answer next to the expected one, with TTFT and how many prompt tokens
were read from the cache.
"""

from __future__ import annotations

import argparse
import random
import time

from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_kvboost import ChatKVBoost, KVBoostPrewarmTransformer
from offline_embeddings import encoder, langchain_embeddings

from kvboost_rag.bench.data import bundled, load_items

SYSTEM = "Answer the question using only the documents. Reply with the answer only."
PROMPT = ChatPromptTemplate.from_messages([
    ("system", SYSTEM + "\n\nDocuments:\n\n{context}"),
    ("human", "{question}"),
])


def format_docs(docs: list[Document]) -> str:
    # Each page_content lands in the prompt verbatim: that is what lets the engine find it.
    return "\n\n".join(doc.page_content for doc in docs)


def shuffle(docs: list[Document]) -> list[Document]:
    docs = list(docs)
    random.Random(docs[0].page_content if docs else 0).shuffle(docs)
    return docs


def load_corpus(n_items: int, per_item: int = 4):
    """The first `n_items` benchmark items and a pool of their documents: each item's answer document
    and its first look-alikes, `per_item` in all (the answer's look-alikes are the distractors)."""
    items = load_items(bundled("synthetic_k8"), limit=n_items)
    docs = []
    for item in items:
        answer = [] if item.answer_doc is None else [item.answer_doc]
        others = [i for i in range(len(item.documents)) if i not in answer]
        keep = sorted(answer + others[:per_item - len(answer)])
        docs += [Document(page_content=item.documents[i], metadata={"item": item.id}) for i in keep]
    return items, docs


def build_retriever(llm: ChatKVBoost, docs: list[Document], k: int):
    """Pre-warm the documents' KV (once, at ingestion), index them, and return a retriever."""
    docs = KVBoostPrewarmTransformer(llm, show_progress=True).transform_documents(docs)
    store = InMemoryVectorStore(langchain_embeddings())
    store.add_documents(docs)
    return store.as_retriever(search_kwargs={"k": k})


def rag_chain(retriever, llm):
    """question -> AIMessage: retrieve, shuffle, stuff into the prompt, answer."""
    context = retriever | RunnableLambda(shuffle) | RunnableLambda(format_docs)
    return {"context": context, "question": RunnablePassthrough()} | PROMPT | llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=3, help="benchmark items to index (4 documents each)")
    parser.add_argument("--k", type=int, default=4, help="documents retrieved per question")
    parser.add_argument("--strategy", default="cacheblend")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    started = time.perf_counter()
    llm = ChatKVBoost(strategy=args.strategy, max_tokens=args.max_tokens)
    items, docs = load_corpus(args.items)
    print(f"model {llm.client.model_id}, embeddings {encoder().name}: {len(docs)} documents")
    chain = rag_chain(build_retriever(llm, docs, args.k), llm)
    print(f"ready in {time.perf_counter() - started:.1f}s\n")

    for item in items:
        msg = chain.invoke(item.question)
        meta, usage = msg.response_metadata, msg.usage_metadata
        print(f"Q: {item.question}")
        print(f"A: {msg.content.strip()!r}   (expected {item.answers[0]!r})")
        print(f"   {meta['strategy']}: ttft {meta['ttft_ms']:.0f} ms, "
              f"{usage['input_token_details']['cache_read']}/{usage['input_tokens']} prompt tokens from the cache "
              f"({meta['exact_tokens']} exact prefix, {meta['recomputed_tokens']} recomputed)\n")
    print(f"done in {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
