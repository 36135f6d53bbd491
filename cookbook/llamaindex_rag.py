"""A LlamaIndex query engine over nodes whose KV is stored by the ingestion pipeline.

    python cookbook/llamaindex_rag.py [--items 3] [--k 4] [--strategy cacheblend]

Offline: the bundled SmolLM2-135M-Instruct, the bundled synthetic benchmark documents and offline
embeddings (see offline_embeddings.py). `KVBoostPrewarm` runs last in the `IngestionPipeline`, so
it stores each node's text exactly as the response synthesizer will put it into the prompt (text
plus LLM-visible metadata); the query engine runs in its default (compact) response mode. The
figures come through LlamaIndex's instrumentation (each LLM response's additional_kwargs).
"""

from __future__ import annotations

import argparse
import time

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.llms.kvboost import KVBoostLLM, KVBoostPrewarm
from offline_embeddings import encoder, llamaindex_embedding

from kvboost_rag.bench.data import bundled, load_items


class LastFigures(BaseEventHandler):
    """Keeps the figures of the last LLM chat LlamaIndex made."""

    figures: dict = {}

    @classmethod
    def class_name(cls) -> str:
        return "LastFigures"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.figures = event.response.additional_kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=3, help="benchmark items to index (4 documents each)")
    parser.add_argument("--k", type=int, default=4, help="nodes retrieved per question")
    parser.add_argument("--strategy", default="cacheblend")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    started = time.perf_counter()
    llm = KVBoostLLM(strategy=args.strategy, max_tokens=args.max_tokens)
    embed_model = llamaindex_embedding()
    items = load_items(bundled("synthetic_k8"), limit=args.items)
    docs = []
    for item in items:  # each item's answer document and its first look-alikes, 4 in all
        answer = [] if item.answer_doc is None else [item.answer_doc]
        keep = sorted(answer + [i for i in range(len(item.documents)) if i not in answer][:4 - len(answer)])
        docs += [Document(text=item.documents[i], metadata={"collection": item.id.split("-")[-2]}) for i in keep]
    print(f"model {llm.client.model_id}, embeddings {encoder().name}: {len(docs)} documents")

    pipeline = IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=512, chunk_overlap=0),
        embed_model,
        KVBoostPrewarm(llm, show_progress=True),  # last: after everything that changes the text
    ])
    nodes = pipeline.run(documents=docs)
    print(f"{len(nodes)} nodes, KV stored; e.g. {nodes[0].metadata}")
    index = VectorStoreIndex(nodes, embed_model=embed_model)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=args.k)  # response_mode="compact"
    print(f"ready in {time.perf_counter() - started:.1f}s\n")

    figures = LastFigures()
    get_dispatcher().add_event_handler(figures)
    for item in items:
        response = query_engine.query(item.question)
        f = figures.figures
        print(f"Q: {item.question}")
        print(f"A: {str(response).strip()!r}   (expected {item.answers[0]!r})")
        print(f"   {f['strategy']}: ttft {f['ttft_ms']:.0f} ms, {f['reused_tokens']}/{f['prompt_tokens']} prompt "
              f"tokens from the cache ({f['exact_tokens']} exact prefix, {f['recomputed_tokens']} recomputed)\n")

    # Running the pipeline again (its IngestionCache off, so every step really runs) computes no KV:
    # every node is already stored. The engine counts what it computed.
    computed = llm.client.counters["documents_computed"]
    IngestionPipeline(transformations=pipeline.transformations, disable_cache=True).run(documents=docs)
    print(f"pipeline re-run without its cache: {llm.client.counters['documents_computed'] - computed} "
          "documents' KV computed")
    print(f"done in {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
