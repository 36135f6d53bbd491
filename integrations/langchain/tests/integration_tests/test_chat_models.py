"""Standard LangChain integration tests for ChatKVBoost on the bundled model, and its own behaviour."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_kvboost import ChatKVBoost, KVBoostPrewarmTransformer
from langchain_tests.integration_tests import ChatModelIntegrationTests
from pydantic import ValidationError

from kvboost_rag import RepairConfig

pytestmark = pytest.mark.real_model

DOC = ("The Vellmark Observatory stands on Mount Oren, 2,140 metres above the sea. It was opened in 1911 "
       "and its largest telescope has a mirror of 1.8 metres. The observatory is run by the Astral Society "
       "of Kessa, whose director is Ilse Marrow.")


def _rag_messages(question: str, doc: str = DOC) -> list[tuple[str, str]]:
    return [("system", f"Answer from the document.\n\n{doc}"), ("human", question)]


# The standard suite has async tests; the root config runs pytest-asyncio in strict mode.
@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:.*is marked with '@pytest.mark.asyncio' but it is not an async function")
class TestChatKVBoostIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return ChatKVBoost

    @property
    def chat_model_params(self) -> dict:
        # Small, so the suite runs in a few minutes on two cores; the bundled model loads once.
        return {"max_tokens": 12}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatKVBoost(max_tokens=8)
        llm.prewarm([DOC], show_progress=False)
        messages = _rag_messages("Who is the director?")
        if not stream:
            return llm.invoke(messages)
        full = None
        for chunk in llm.stream(messages):
            full = chunk if full is None else full + chunk
        return full


def test_prewarmed_document_is_read_from_cache(engine):
    llm = ChatKVBoost(max_tokens=8)
    assert llm.client is engine  # one engine per (model, dtype) in the process
    [doc_id] = llm.prewarm([Document(page_content=DOC)], show_progress=False)
    assert doc_id and engine.documents.get(DOC).doc_id == doc_id

    msg = llm.invoke(_rag_messages("How high is the observatory?"))
    usage, meta = msg.usage_metadata, msg.response_metadata
    doc_tokens = len(engine.document(DOC).token_ids)
    assert usage["input_token_details"]["cache_read"] == meta["reused_tokens"] >= doc_tokens - 16
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert meta["strategy"] == "cacheblend" and meta["ttft_ms"] > 0 and meta["total_ms"] >= meta["ttft_ms"]
    assert meta["reused_tokens"] + meta["recomputed_tokens"] == usage["input_tokens"]

    full = llm.invoke(_rag_messages("How high is the observatory?"), strategy="full", max_tokens=3)
    assert full.response_metadata["strategy"] == "full"
    assert full.usage_metadata["input_token_details"]["cache_read"] == 0
    assert full.usage_metadata["output_tokens"] <= 3


def _stored_starts(llm: ChatKVBoost) -> list[int]:
    """Where the prompt's reused documents were encoded at ingestion (token position of their first token)."""
    plan = llm.client.plan([{"role": "system", "content": f"Answer from the document.\n\n{DOC}"},
                            {"role": "user", "content": "Who?"}], "naive")
    return [c.entry.start for c in plan.chunks if c.is_document]


def test_doc_context_picks_how_documents_are_encoded(engine):
    assert ChatKVBoost(doc_context="passage").client is engine  # the default's engine, shared
    alone = ChatKVBoost(doc_context="none")
    assert alone.client is not engine and alone.client is ChatKVBoost(doc_context="none").client
    assert alone.client.fingerprint != engine.fingerprint  # its store never serves the other encoding
    for llm in (alone, ChatKVBoost()):
        llm.prewarm([DOC], show_progress=False)
    assert _stored_starts(alone) == [0]  # encoded alone, from position 0
    assert _stored_starts(ChatKVBoost())[0] > 50  # after the template's opening and the passage

    assert ChatKVBoost(engine=alone.client).client is alone.client  # unset: the engine's own
    with pytest.raises(ValidationError, match="differs from the given engine's 'none'"):
        ChatKVBoost(engine=alone.client, doc_context="passage")


def test_stream_carries_figures_on_the_last_chunk_only():
    llm = ChatKVBoost(max_tokens=10)
    chunks = list(llm.stream(_rag_messages("When was it opened?")))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1
    assert chunks[-1].usage_metadata is not None and chunks[-1].chunk_position == "last"
    full = sum(chunks[1:], chunks[0])
    assert full.response_metadata["model_name"] == "SmolLM2-135M-Instruct"
    assert full.content == llm.invoke(_rag_messages("When was it opened?")).content  # greedy: same text


def _with_repair(engine, **settings):
    """The engine's model and store under another repair config: a shallow copy, nothing loaded again, whose
    prefill records the RepairConfig each call brings (None = the engine's own)."""
    tuned = copy.copy(engine)
    tuned.config = dataclasses.replace(engine.config, repair=dataclasses.replace(engine.config.repair, **settings))
    tuned.seen = []

    def prefill(*args, repair=None, **kwargs):
        tuned.seen.append(repair)
        return engine.prefill(*args, repair=repair, **kwargs)

    tuned.prefill = prefill
    return tuned


def test_repair_settings_reach_the_engines_repair_config(engine):
    tuned = _with_repair(engine, taper=3.0, boundary_tokens=5)
    base = tuned.config.repair
    llm = ChatKVBoost(engine=tuned, max_tokens=2, repair={"recompute_ratio": 1.0})
    llm.invoke("Name a colour.", recompute_ratio=0.3, check_layer=2)  # per call, over the field
    llm.bind(drift=False).invoke("Name a colour.")
    ChatKVBoost(engine=tuned, max_tokens=2).invoke("Name a colour.")
    whole = RepairConfig(recompute_ratio=0.5)
    ChatKVBoost(engine=tuned, max_tokens=2, repair=whole).invoke("Name a colour.", taper=2.0)
    assert tuned.seen == [
        dataclasses.replace(base, recompute_ratio=0.3, check_layer=2),  # the rest from the engine's config
        dataclasses.replace(base, recompute_ratio=1.0, drift=False),
        None,  # nothing set: the engine's own
        dataclasses.replace(whole, taper=2.0),  # a whole RepairConfig replaces the engine's
    ]
    assert tuned.seen[0].taper == 3.0 and tuned.seen[0].boundary_tokens == 5


def test_repair_settings_are_checked_against_the_engines_model(engine):
    layers = engine.adapter.num_layers
    with pytest.raises(ValidationError, match=f"check_layer must be below the model's {layers} layers"):
        ChatKVBoost(engine=engine, repair={"check_layer": layers})
    llm = ChatKVBoost(repair={"check_layer": layers})  # no engine yet: checked at the first call
    with pytest.raises(ValueError, match=f"check_layer must be below the model's {layers} layers"):
        llm.invoke("hi")
    with pytest.raises(ValueError, match=f"check_layer must be below the model's {layers} layers"):
        ChatKVBoost().invoke("hi", check_layer=layers)


def test_stop_strings_cut_the_answer():
    llm = ChatKVBoost(max_tokens=16)
    prompt = "Write a sentence about the sea."
    free = llm.invoke(prompt).content
    words = free.split()
    assert len(words) >= 3
    stop = words[2]
    cut = llm.invoke(prompt, stop=[stop])
    assert cut.content == free[:free.index(stop)]  # greedy: the same text, up to the stop string
    assert cut.response_metadata["finish_reason"] == "stop"
    assert ChatKVBoost(max_tokens=16, stop=[stop]).invoke(prompt).content == cut.content


@pytest.mark.asyncio
async def test_async_calls_leave_the_event_loop_free():
    llm = ChatKVBoost(max_tokens=8)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    started = time.perf_counter()
    msg = await llm.ainvoke("Name a colour.")
    elapsed = time.perf_counter() - started
    task.cancel()
    assert msg.content
    # A blocked loop would tick once or not at all while the model runs.
    assert ticks >= min(10, elapsed / 0.005 / 4)


@pytest.mark.asyncio
async def test_concurrent_requests_match_sequential_ones():
    llm = ChatKVBoost(max_tokens=8)
    prompts = ["Name a colour.", "Name a fruit.", "Name an animal."]
    together = await asyncio.gather(*(llm.ainvoke(p) for p in prompts))
    streamed = []
    for p in prompts:
        text = ""
        async for chunk in llm.astream(p):
            text += chunk.content
        streamed.append(text)
    alone = [llm.invoke(p).content for p in prompts]
    assert [m.content for m in together] == alone == streamed


@pytest.mark.asyncio
async def test_abandoned_stream_leaves_the_engine_usable():
    llm = ChatKVBoost(max_tokens=20)
    async for _ in llm.astream("Tell me about the sea."):
        break
    assert (await llm.ainvoke("Name a colour.")).content


def test_prewarm_transformer_records_doc_ids(engine):
    docs = [Document(page_content=DOC, metadata={"source": "a"}), Document(page_content="   ")]
    out = KVBoostPrewarmTransformer(engine, show_progress=False).transform_documents(docs)
    assert out[0].page_content == DOC and out[0].metadata["source"] == "a"
    assert out[0].metadata["kvboost_doc_id"] == engine.documents.get(DOC).doc_id
    assert "kvboost_doc_id" not in docs[0].metadata  # the input is not modified
    assert out[1] is docs[1]  # nothing to store for an empty document
