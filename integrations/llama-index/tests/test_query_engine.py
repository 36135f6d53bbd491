"""A LlamaIndex query engine (default compact response mode) over pre-warmed nodes, in shuffled order.

What is checked: the chat LlamaIndex sends holds every retrieved node's text verbatim, in the form
KVBoostPrewarm stored it (text plus LLM-visible metadata), so the engine finds it wherever it sits;
the default strategy reuses that KV out of order; an exact repair (cacheblend recomputing every reused
token) gives the same greedy answer as a full prefill.
"""

from __future__ import annotations

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.llms.kvboost import KVBoostLLM, KVBoostPrewarm, llm_text
from llama_index.llms.kvboost.base import _to_chat_message

from kvboost_rag import RepairConfig
from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.repair.guard import ESCALATE, FULL, HALF, REPAIR

from .conftest import Shuffle

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def items():
    return load_items(bundled("tiny"))


@pytest.fixture(scope="module")
def index(engine, embed_model, items):
    # LLM-visible metadata on purpose: it is part of the text the synthesizer puts in the prompt.
    docs = [Document(text=text, metadata={"set": item.id}) for item in items for text in item.documents]
    pipeline = IngestionPipeline(transformations=[embed_model, KVBoostPrewarm(engine)])
    return VectorStoreIndex(pipeline.run(documents=docs), embed_model=embed_model)


def query_engine(index, llm):
    return index.as_query_engine(llm=llm, similarity_top_k=3, node_postprocessors=[Shuffle()])


def test_compact_prompt_holds_node_texts_verbatim(engine, index, items, chat_log):
    llm = KVBoostLLM(engine=engine, max_tokens=4)
    for item in items:
        response = query_engine(index, llm).query(item.question)
        assert response.response_mode if hasattr(response, "response_mode") else True
        [(messages, _)] = chat_log.chats[-1:]
        rendered = engine.render([_to_chat_message(m) for m in messages])
        found = [span.document.doc_id for span in engine.documents.find(rendered)]
        # In the order the (shuffled) nodes were given to the synthesizer, each exactly once.
        assert found == [n.node.metadata["kvboost_doc_id"] for n in response.source_nodes]
        assert all(llm_text(n.node).startswith("set: ") for n in response.source_nodes)


def test_shuffled_query_reuses_kv_and_matches_full(engine, index, items, chat_log):
    agree = 0
    for item in items:
        answers = {}
        for name, llm in [("full", KVBoostLLM(engine=engine, max_tokens=12, strategy="full")),
                          ("default", KVBoostLLM(engine=engine, max_tokens=12)),
                          ("exact", KVBoostLLM(engine=engine, max_tokens=12,
                                               repair={"recompute_ratio": 1.0, "fidelity": "fast"}))]:
            response = query_engine(index, llm).query(item.question)
            [(_, chat)] = chat_log.chats[-1:]
            assert chat.message.content == response.response
            doc_tokens = sum(len(engine.documents.get(llm_text(n.node).strip()).token_ids)
                             for n in response.source_nodes)
            answers[name] = (response.response, chat.additional_kwargs, doc_tokens)

        assert answers["full"][1]["reused_tokens"] == 0
        _, figures, doc_tokens = answers["default"]
        assert figures["strategy"] == "cacheblend"
        # The step that served the first token decides what the prefill reused; which step that is depends on the
        # guard's curves, which shadow checks refit in the background, so each is checked for what it is. Later
        # steps (an answer moved part-way, to a larger repair or a full prefill) say nothing of the prefill.
        first = figures["served"][0]
        if first["step"] == FULL:  # the guard did not trust the first token: a full prefill, full's answer
            assert figures["fell_back"] and figures["reused_tokens"] == 0
            assert answers["default"][0] == answers["full"][0]
        elif first["step"] == HALF:  # the same in bf16, where it runs natively: within the dtype floor, not equal
            assert figures["fell_back"] and figures["reused_tokens"] == 0
        else:
            assert not figures["fell_back"]
            assert figures["reused_tokens"] - figures["exact_tokens"] >= 0.5 * doc_tokens  # out-of-order reuse
            own = RepairConfig(fidelity=figures["fidelity"]).budget  # balanced's; strict's for records of a template
            assert (first["step"], first["budget"]) == (REPAIR, own) or (
                first["step"] == ESCALATE and first["budget"] > own)
        assert figures["recompute_budget"] == first["budget"]
        assert answers["exact"][1]["reused_tokens"] > 0
        assert answers["exact"][0] == answers["full"][0]
        agree += answers["default"][0] == answers["full"][0]
    print(f"default cacheblend agrees with full on {agree}/{len(items)} answers")
