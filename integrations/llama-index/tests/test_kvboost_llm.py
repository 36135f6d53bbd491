"""KVBoostLLM on the bundled model: completion, chat, streaming, async, stop strings, figures."""

from __future__ import annotations

import asyncio
import time

import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.kvboost import KVBoostLLM
from llama_index.llms.kvboost.base import _to_chat_message
from pydantic import ValidationError

DOC = ("The Vellmark Observatory stands on Mount Oren, 2,140 metres above the sea. It was opened in 1911 "
       "and its largest telescope has a mirror of 1.8 metres. The observatory is run by the Astral Society "
       "of Kessa, whose director is Ilse Marrow.")


def test_fields_and_validation():
    llm = KVBoostLLM(max_tokens=7, strategy="prefix", stop=["\n"])
    assert KVBoostLLM.class_name() == "KVBoostLLM" and llm._engine is None  # nothing loaded yet
    assert llm.model_name == "SmolLM2-135M-Instruct"
    fields = KVBoostLLM.model_fields
    assert all(fields[name].description for name in ("model", "dtype", "strategy", "max_tokens", "stop",
                                                      "recompute_ratio", "taper", "recency", "boundary_tokens",
                                                      "check_layer", "qa_order", "drift",
                                                      "drift_strength", "doc_context"))
    for bad in ({"strategy": "fastest"}, {"dtype": "int8"}, {"recompute_ratio": 2.0}, {"max_tokens": 0},
                {"taper": 0.5}, {"recency": -1.0}, {"qa_order": "random"}, {"drift_strength": 1.5},
                {"doc_context": "sentence"}):
        with pytest.raises(ValidationError):
            KVBoostLLM(**bad)
    with pytest.raises(TypeError, match="max_new_token"):
        llm._call({"max_new_token": 3})
    assert llm._engine is None


@pytest.mark.parametrize(("bad", "message"), [
    ({"recompute_ratio": float("nan")}, r"recompute_ratio must be a finite number in \[0, 1\], got nan"),
    ({"taper": 0.5}, "taper must be a finite number >= 1, got 0.5"),
    ({"boundary_tokens": -5}, "boundary_tokens must be an integer >= 0, got -5"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"top_k": -5}, "top_k must be an integer >= 0, got -5"),
    ({"stop": "###"}, "wrap it"),  # a bare stop string is refused, not split into letters
])
def test_per_call_values_out_of_range_are_refused_before_any_model_work(bad, message):
    llm = KVBoostLLM()
    with pytest.raises(ValueError, match=message):
        llm._call(bad)
    assert llm._engine is None  # nothing loaded


@pytest.mark.parametrize("bad", [{"temperature": float("inf")}, {"taper": float("inf")}, {"seed": -1},
                                 {"stop": [""]}])
def test_fields_out_of_range_are_refused_at_construction(bad):
    with pytest.raises(ValidationError):  # where pydantic's own bounds let them through
        KVBoostLLM(**bad)


def test_messages_to_chat():
    assert _to_chat_message(ChatMessage(role=MessageRole.DEVELOPER, content="d")) == {"role": "system",
                                                                                      "content": "d"}
    both = ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="a"), TextBlock(text="b")])
    assert _to_chat_message(both) == {"role": "user", "content": "a\nb"}
    with pytest.raises(ValueError, match="function calling"):
        _to_chat_message(ChatMessage(role=MessageRole.TOOL, content="42"))
    with pytest.raises(ValueError, match="text only"):
        _to_chat_message(ChatMessage(role=MessageRole.USER, blocks=[ImageBlock(url="http://x/y.png")]))


@pytest.mark.real_model
def test_repair_fields_map_to_repair_config(engine):
    llm = KVBoostLLM(recompute_ratio=0.3, taper=2.0, qa_order="relevance_last")
    repair = llm._call({"recency": 0.0, "check_layer": 2, "drift": False, "drift_strength": 0.5})["repair"]
    assert (repair.recompute_ratio, repair.taper, repair.recency, repair.check_layer) == (0.3, 2.0, 0.0, 2)
    assert repair.qa_order == "relevance_last" and repair.drift is False and repair.drift_strength == 0.5
    assert repair.select == engine.config.repair.select  # the rest from the engine's own config
    assert "repair" not in KVBoostLLM()._call({})


@pytest.mark.real_model
def test_doc_context_picks_how_documents_are_encoded(engine):
    assert KVBoostLLM(doc_context="passage").client is engine  # the default's engine, shared
    alone = KVBoostLLM(doc_context="none")
    assert alone.client is not engine and alone.client is KVBoostLLM(doc_context="none").client
    assert alone.client.fingerprint != engine.fingerprint  # its store never serves the other encoding
    prompt = [{"role": "system", "content": f"Answer from the document.\n\n{DOC}"}, {"role": "user", "content": "Who?"}]
    starts = {}
    for llm in (alone, KVBoostLLM()):
        llm.client.ingest([DOC], progress=False)
        starts[llm.client.config.chunking.doc_context] = [
            c.entry.start for c in llm.client.plan(prompt, "naive").chunks if c.is_document]
    assert starts["none"] == [0] and starts["passage"][0] > 50  # alone; after the opening and the passage

    assert KVBoostLLM(engine=alone.client).client is alone.client  # unset: the engine's own
    with pytest.raises(ValueError, match="differs from the given engine's 'none'"):
        KVBoostLLM(engine=alone.client, doc_context="passage")


@pytest.mark.real_model
def test_metadata_from_the_model(engine):
    meta = KVBoostLLM(max_tokens=9).metadata
    assert meta.context_window == engine.adapter.max_context and meta.num_output == 9
    assert meta.is_chat_model and not meta.is_function_calling_model
    assert KVBoostLLM(context_window=2048).metadata.context_window == 2048


@pytest.mark.real_model
def test_complete_chat_and_streams_agree(engine):
    llm = KVBoostLLM(max_tokens=10)
    llm.prewarm([DOC], show_progress=False)
    question = f"{DOC}\n\nWho is the director of the observatory?"
    done = llm.complete(question)
    figures = done.additional_kwargs
    assert done.text and figures["reused_tokens"] > 0 and figures["strategy"] == "cacheblend"
    assert figures["prompt_tokens"] == figures["reused_tokens"] + figures["recomputed_tokens"]
    assert done.raw["usage"]["completion_tokens"] == figures["completion_tokens"] == len(done.raw["token_ids"])

    # A bare completion prompt is one user turn of the chat template, the same as chat().
    chat = llm.chat([ChatMessage(role=MessageRole.USER, content=question)])
    assert chat.message.content == done.text and chat.message.role == MessageRole.ASSISTANT

    pieces = list(llm.stream_complete(question))
    assert "".join(p.delta for p in pieces) == pieces[-1].text == done.text
    assert pieces[-1].additional_kwargs["completion_tokens"] == figures["completion_tokens"]
    assert list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content=question)]))[-1].message.content \
        == done.text

    # formatted=True: the string goes to the model as it is (no chat template).
    raw = llm.complete(engine.render([{"role": "user", "content": question}]), formatted=True)
    assert raw.text == done.text
    assert llm.complete(question, strategy="full").additional_kwargs["reused_tokens"] == 0


@pytest.mark.real_model
def test_predict_uses_the_chat_template():
    llm = KVBoostLLM(max_tokens=8)
    out = llm.predict(PromptTemplate("Name one {thing}."), thing="colour")
    assert out == llm.chat([ChatMessage(role=MessageRole.USER, content="Name one colour.")]).message.content


@pytest.mark.real_model
def test_stop_strings():
    llm = KVBoostLLM(max_tokens=16)
    free = llm.complete("Write a sentence about the sea.").text
    stop = free.split()[2]
    cut = llm.complete("Write a sentence about the sea.", stop=[stop])
    assert cut.text == free[:free.index(stop)] and cut.additional_kwargs["finish_reason"] == "stop"
    assert KVBoostLLM(max_tokens=16, stop=[stop]).complete("Write a sentence about the sea.").text == cut.text


@pytest.mark.real_model
@pytest.mark.asyncio
async def test_async_variants_match_and_leave_the_loop_free():
    llm = KVBoostLLM(max_tokens=8)
    prompts = ["Name a colour.", "Name a fruit.", "Name an animal."]
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    started = time.perf_counter()
    together = await asyncio.gather(*(llm.acomplete(p) for p in prompts))
    elapsed = time.perf_counter() - started
    task.cancel()
    assert ticks >= min(10, elapsed / 0.005 / 4)  # a blocked loop would barely tick

    alone = [llm.complete(p).text for p in prompts]
    assert [r.text for r in together] == alone
    chats = await asyncio.gather(*(llm.achat([ChatMessage(role=MessageRole.USER, content=p)]) for p in prompts))
    assert [c.message.content for c in chats] == alone
    streamed = [r async for r in await llm.astream_complete(prompts[0])]
    assert streamed[-1].text == alone[0] and streamed[-1].additional_kwargs["completion_tokens"] > 0
    chatted = [r async for r in await llm.astream_chat([ChatMessage(role=MessageRole.USER, content=prompts[1])])]
    assert chatted[-1].message.content == alone[1]
