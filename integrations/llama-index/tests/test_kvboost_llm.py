"""KVBoostLLM on the bundled model: completion, chat, streaming, async, stop strings, figures."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time

import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.kvboost import KVBoostLLM
from llama_index.llms.kvboost.base import _to_chat_message
from pydantic import ValidationError

from kvboost_rag.config import RepairConfig
from kvboost_rag.llm import REPAIR_FIELDS
from kvboost_rag.repair import names as repair_names

DOC = ("The Vellmark Observatory stands on Mount Oren, 2,140 metres above the sea. It was opened in 1911 "
       "and its largest telescope has a mirror of 1.8 metres. The observatory is run by the Astral Society "
       "of Kessa, whose director is Ilse Marrow.")


def test_fields_and_validation():
    llm = KVBoostLLM(max_tokens=7, strategy="prefix", stop=["\n"])
    assert KVBoostLLM.class_name() == "KVBoostLLM" and llm._engine is None  # nothing loaded yet
    assert llm.model_name == "SmolLM2-135M-Instruct"
    fields = KVBoostLLM.model_fields
    assert all(fields[name].description for name in ("model", "dtype", "strategy", "max_tokens", "stop", "repair",
                                                      "doc_context"))
    assert all(name in fields["strategy"].description for name in repair_names())
    assert all(f.name in fields["repair"].description for f in dataclasses.fields(RepairConfig))
    assert not set(REPAIR_FIELDS) & set(fields)  # no field per repair knob
    for bad in ({"strategy": "fastest"}, {"dtype": "int8"}, {"max_tokens": 0},
                {"doc_context": "sentence"}, {"repair": "fast"}):
        with pytest.raises(ValidationError):
            KVBoostLLM(**bad)
    with pytest.raises(TypeError, match="max_new_token"):
        llm._call({"max_new_token": 3})
    for misspelt in ("recompute", "ratio"):  # the per-call arguments named in the error come from the configs
        with pytest.raises(TypeError, match=f"unexpected argument.*{misspelt}; per-call arguments are strategy, "
                                            "max_tokens, .*, recompute_ratio, taper, .*, write_back"):
            llm._call({misspelt: 0.5})
    assert llm._engine is None


@pytest.mark.parametrize(("repair", "message"), [
    ({"recompute_ratio": 2.0}, r"RepairConfig.recompute_ratio must be a finite number in \[0, 1\], got 2.0"),
    ({"taper": 0.5}, "RepairConfig.taper must be a finite number >= 1, got 0.5"),
    ({"recency": -1.0}, "RepairConfig.recency must be a finite number >= 0, got -1.0"),
    ({"size_multiple": 1.5}, "RepairConfig.size_multiple must be an integer >= -1, got 1.5"),
    ({"drift": 1}, "RepairConfig.drift must be True or False, got 1"),  # not coerced to True
    ({"recompute": 0.3}, "unknown repair setting.*'recompute'; RepairConfig's fields are boundary_tokens, check_layer"),
])
def test_a_bad_repair_dict_fails_at_construction_naming_the_field(repair, message):
    with pytest.raises(ValidationError, match=message):
        KVBoostLLM(repair=repair)


def test_repair_takes_a_config_or_a_dict_of_its_fields():
    config = RepairConfig(taper=2.0)
    assert KVBoostLLM(repair=config).repair is config
    assert KVBoostLLM(repair={"taper": 2.0, "drift": False}).repair == {"taper": 2.0, "drift": False}


@pytest.mark.parametrize(("bad", "message"), [
    ({"recompute_ratio": float("nan")}, r"recompute_ratio must be a finite number in \[0, 1\], got nan"),
    ({"taper": 0.5}, "taper must be a finite number >= 1, got 0.5"),
    ({"boundary_tokens": -5}, "boundary_tokens must be an integer >= 0, got -5"),
    ({"drift": "no"}, "drift must be True or False"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"top_k": -5}, "top_k must be an integer >= 0, got -5"),
    ({"stop": "###"}, "wrap it"),  # a bare stop string is refused, not split into letters
    ({"strategy": "fastest"}, "unknown strategy 'fastest'; use one of full, "),
])
def test_per_call_values_out_of_range_are_refused_before_any_model_work(bad, message):
    llm = KVBoostLLM()
    with pytest.raises(ValueError, match=message):
        llm._call(bad)
    assert llm._engine is None  # nothing loaded


@pytest.mark.parametrize("bad", [{"temperature": float("inf")}, {"seed": -1}, {"stop": [""]},
                                 {"repair": {"taper": float("inf")}}])
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


@pytest.mark.real_model
def test_repair_settings_reach_the_engines_repair_config(engine):
    tuned = _with_repair(engine, taper=3.0, boundary_tokens=5)
    base = tuned.config.repair
    llm = KVBoostLLM(engine=tuned, max_tokens=2, repair={"recompute_ratio": 1.0})
    llm.complete("Name a colour.", recompute_ratio=0.3, check_layer=2)  # per call, over the field
    llm.chat([ChatMessage(role=MessageRole.USER, content="Name a colour.")], drift=False)
    KVBoostLLM(engine=tuned, max_tokens=2).complete("Name a colour.")
    whole = RepairConfig(recompute_ratio=0.5)
    list(KVBoostLLM(engine=tuned, max_tokens=2, repair=whole).stream_complete("Name a colour.", taper=2.0))
    assert tuned.seen == [
        dataclasses.replace(base, recompute_ratio=0.3, check_layer=2),  # the rest from the engine's config
        dataclasses.replace(base, recompute_ratio=1.0, drift=False),
        None,  # nothing set: the engine's own
        dataclasses.replace(whole, taper=2.0),  # a whole RepairConfig replaces the engine's
    ]
    assert tuned.seen[0].taper == 3.0 and tuned.seen[0].boundary_tokens == 5
    layers = engine.adapter.num_layers
    with pytest.raises(ValueError, match=f"check_layer must be below the model's {layers} layers"):
        KVBoostLLM(engine=engine, repair={"check_layer": layers})
    with pytest.raises(ValueError, match=f"check_layer must be below the model's {layers} layers"):
        KVBoostLLM(engine=engine).complete("hi", check_layer=layers)


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


def test_device_is_checked_at_construction_and_reaches_the_engine(monkeypatch):
    import llama_index.llms.kvboost.base as base

    assert KVBoostLLM().device == "auto" and "'cuda:N'" in KVBoostLLM.model_fields["device"].description
    with pytest.raises(ValidationError, match="unknown device 'gpu'"):
        KVBoostLLM(device="gpu")
    asked = []
    monkeypatch.setattr(base, "shared_engine", lambda *args: asked.append(args) or "engine")
    assert KVBoostLLM(device="cpu").client == "engine" and asked == [(None, "float32", None, "cpu")]
