"""Standard LangChain unit tests for ChatKVBoost, and checks that need no model."""

from __future__ import annotations

import dataclasses

import pytest
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_kvboost import ChatKVBoost
from langchain_kvboost.chat_models import _to_chat_message
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import ValidationError

from kvboost_rag.config import RepairConfig
from kvboost_rag.llm import REPAIR_FIELDS
from kvboost_rag.repair import names as repair_names


class TestChatKVBoostUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return ChatKVBoost

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False


def test_construction_loads_no_model():
    llm = ChatKVBoost()
    assert llm.engine is None and llm._engine is None
    assert llm.model_name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("bad", [{"strategy": "fastest"}, {"dtype": "int8"},
                                 {"max_tokens": 0}, {"top_p": 0.0}, {"temperature": -1.0},
                                 {"doc_context": "sentence"}, {"repair": "fast"}])
def test_rejects_bad_settings(bad):
    with pytest.raises(ValidationError):
        ChatKVBoost(**bad)


@pytest.mark.parametrize(("repair", "message"), [
    ({"recompute_ratio": 1.5}, r"RepairConfig.recompute_ratio must be a finite number in \[0, 1\], got 1.5"),
    ({"boundary_tokens": -1}, "RepairConfig.boundary_tokens must be an integer >= 0, got -1"),
    ({"taper": float("inf")}, "RepairConfig.taper must be a finite number >= 1, got inf"),
    ({"recency": float("nan")}, "RepairConfig.recency must be a finite number >= 0, got nan"),
    ({"drift": "no"}, "RepairConfig.drift must be True or False, got 'no'"),  # not coerced to False
    ({"recompute": 0.3}, "unknown repair setting.*'recompute'; RepairConfig's fields are boundary_tokens, check_layer"),
])
def test_a_bad_repair_dict_fails_at_construction_naming_the_field(repair, message):
    with pytest.raises(ValidationError, match=message):
        ChatKVBoost(repair=repair)


def test_repair_takes_a_config_or_a_dict_of_its_fields():
    config = RepairConfig(recompute_ratio=0.3)
    assert ChatKVBoost(repair=config).repair is config
    assert ChatKVBoost(repair={"recompute_ratio": 0.3, "drift": False}).repair == {"recompute_ratio": 0.3,
                                                                                    "drift": False}
    assert ChatKVBoost(repair={"taper": None}).repair == {"taper": None}  # None: not set, the engine's
    # The strategies and repair fields the description names are the registry's and RepairConfig's own.
    fields = ChatKVBoost.model_fields
    assert all(name in fields["strategy"].description for name in repair_names())
    assert all(f.name in fields["repair"].description for f in dataclasses.fields(RepairConfig))
    assert not set(REPAIR_FIELDS) & set(fields)  # no field per repair knob


def test_aliases_and_identifying_params():
    llm = ChatKVBoost(max_new_tokens=5, stop_sequences=["\n"], strategy="selective",
                      repair={"boundary_tokens": 4, "drift": False})
    assert llm.max_tokens == 5 and llm.stop == ["\n"]
    params = llm._identifying_params
    assert params["strategy"] == "selective" and params["max_tokens"] == 5
    assert params["repair"] == {"boundary_tokens": 4, "drift": False}
    assert llm._llm_type == "kvboost-chat"
    ls = llm._get_ls_params()
    assert ls["ls_provider"] == "kvboost" and ls["ls_model_name"] == "SmolLM2-135M-Instruct"
    assert ls["ls_stop"] == ["\n"] and ls["ls_max_tokens"] == 5


def test_message_roles_and_text_blocks():
    assert _to_chat_message(SystemMessage("s")) == {"role": "system", "content": "s"}
    assert _to_chat_message(HumanMessage("h", name="bob")) == {"role": "user", "content": "h"}
    assert _to_chat_message(AIMessage("a")) == {"role": "assistant", "content": "a"}
    assert _to_chat_message(ChatMessage(role="user", content="c")) == {"role": "user", "content": "c"}
    blocks = HumanMessage([{"type": "text", "text": "one "}, "two"])
    assert _to_chat_message(blocks) == {"role": "user", "content": "one two"}


def test_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="text only"):
        _to_chat_message(HumanMessage([{"type": "image_url", "image_url": {"url": "data:,"}}]))
    with pytest.raises(ValueError, match="tool calling"):
        _to_chat_message(ToolMessage("42", tool_call_id="1"))
    with pytest.raises(NotImplementedError):
        ChatKVBoost().bind_tools([])
    # Checked before the engine is touched: no model load for a misspelt argument.
    llm = ChatKVBoost()
    with pytest.raises(TypeError, match="max_new_token"):
        llm._request([HumanMessage("hi")], None, {"max_new_token": 3})
    with pytest.raises(TypeError, match="tool calling"):
        llm._request([HumanMessage("hi")], None, {"tools": []})
    with pytest.raises(ValueError, match="unknown strategy 'fastest'; use one of full, "):
        llm._request([HumanMessage("hi")], None, {"strategy": "fastest"})
    for misspelt in ("recompute", "ratio"):  # the per-call arguments named in the error come from the configs
        with pytest.raises(TypeError, match=f"unexpected argument.*{misspelt}; per-call arguments are strategy, "
                                            "max_tokens, .*, recompute_ratio, taper, .*, write_back"):
            llm._request([HumanMessage("hi")], None, {misspelt: 0.5})
    assert llm._engine is None


@pytest.mark.parametrize(("bad", "message"), [
    ({"recompute_ratio": float("nan")}, r"recompute_ratio must be a finite number in \[0, 1\], got nan"),
    ({"recompute_ratio": 2.0}, r"recompute_ratio must be a finite number in \[0, 1\], got 2.0"),
    ({"taper": float("nan")}, "taper must be a finite number >= 1"),
    ({"boundary_tokens": -5}, "boundary_tokens must be an integer >= 0, got -5"),
    ({"check_layer": -1}, "check_layer must be an integer >= 0"),
    ({"size_multiple": -2}, "size_multiple must be an integer >= -1, got -2"),
    ({"drift": "no"}, "drift must be True or False"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"top_k": -5}, "top_k must be an integer >= 0, got -5"),
    ({"max_tokens": 0}, "max_new_tokens must be an integer >= 1"),
])
def test_per_call_values_out_of_range_are_refused_before_any_model_work(bad, message):
    llm = ChatKVBoost()
    with pytest.raises(ValueError, match=message):
        llm._request([HumanMessage("hi")], None, bad)
    assert llm._engine is None  # nothing loaded


def test_a_bare_stop_string_is_refused_not_split_into_letters():
    llm = ChatKVBoost()
    with pytest.raises(ValueError, match=r"wrap it, stop=\['###'\]"):
        llm._request([HumanMessage("hi")], "###", {})
    assert llm._engine is None


@pytest.mark.parametrize("bad", [{"temperature": float("inf")}, {"seed": -1}, {"stop": [""]}, {"top_k": 2.5}])
def test_settings_out_of_range_are_refused_at_construction(bad):
    with pytest.raises(ValidationError):
        ChatKVBoost(**bad)


def test_device_is_checked_at_construction_and_reaches_the_engine(monkeypatch):
    import langchain_kvboost.chat_models as chat_models

    assert ChatKVBoost().device == "auto" and "'cuda:N'" in ChatKVBoost.model_fields["device"].description
    with pytest.raises(ValidationError, match="unknown device 'gpu'"):
        ChatKVBoost(device="gpu")
    asked = []
    monkeypatch.setattr(chat_models, "shared_engine", lambda *args: asked.append(args) or "engine")
    llm = ChatKVBoost(device="cpu", dtype="bfloat16")
    assert llm.client == "engine" and asked == [(None, "bfloat16", None, "cpu")]
    assert llm._identifying_params["device"] == "cpu"
