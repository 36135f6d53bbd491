"""What the OpenAI-compatible server refuses, and that no request can stall another (issue 40, items 1-3).

Driven over real HTTP, by the real openai client where it can send the request and by httpx where it cannot (a
body over the bound, a role it would not send), against servers on 127.0.0.1 over the tiny random-weight engine
test_server.py uses.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import httpx
import openai
import pytest
from test_server import GREEDY, MODEL, QUESTION, _chat, _serving, _tiny_model

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.config import ConfigError, RepairConfig
from kvboost_rag.models import LoadedModel
from kvboost_rag.server import create_app
from kvboost_rag.server_requests import limits_for

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine(bundled_tokenizer):
    engine = KVBoost(LoadedModel(_tiny_model(), bundled_tokenizer, "tiny-random-llama", "seed0"), EngineConfig())
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def base_url(engine):
    with _serving(create_app(engine, model_name=MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def limits(engine):
    return limits_for(engine.adapter.max_context)


def _post(base_url: str, body: dict, route: str = CHAT, client: httpx.Client | None = None, **kwargs) -> httpx.Response:
    """POST `body` as JSON; on `client`'s kept-alive connection when given, else on a new one."""
    # json.dumps escapes what is not ASCII, a lone surrogate too (which httpx's own encoding refuses to send)
    send = client.post if client is not None else httpx.post
    return send(f"{base_url}{route}", content=json.dumps(body), headers={"content-type": "application/json"},
                timeout=60, **kwargs)


def _error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---- item 1: bounded before any tokenizing, and tokenized outside the engine's lock ---------------------------


def test_the_default_bounds_follow_the_context_window(engine, limits):
    assert limits.max_prompt_bytes == 8 * engine.adapter.max_context
    assert limits.max_body_bytes == 6 * limits.max_prompt_bytes + 64 * 1024
    given = limits_for(engine.adapter.max_context, 1000, 5000)
    assert given == dataclasses.replace(limits, max_prompt_bytes=1000, max_body_bytes=5000)
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(engine, max_body_bytes=0)


def test_a_body_over_the_bound_is_refused_413_before_it_is_read(base_url, engine, limits, monkeypatch):
    tokenized = []
    monkeypatch.setattr(engine, "tokenize", lambda text: tokenized.append(len(text)))
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 4_000_000}]}  # 20 MB
    started = time.perf_counter()
    error = _error(_post(base_url, huge), 413)
    assert time.perf_counter() - started < 5  # 40 s of tokenizing before the bound (issue 40)
    assert error["code"] == "request_too_large" and str(limits.max_body_bytes) in error["message"]
    # A body sent in chunks, without a Content-Length, is cut off once it is over the bound.
    chunks = (b'{"messages": [{"role": "user", "content": "' + b"x" * 65536 for _ in range(64))
    reply = httpx.post(f"{base_url}{CHAT}", content=chunks, headers={"content-type": "application/json"}, timeout=60)
    assert _error(reply, 413)["code"] == "request_too_large"
    assert tokenized == []


@pytest.mark.parametrize("route", ["chat", "completion", "documents"])
def test_text_over_max_prompt_bytes_is_refused_413_before_tokenizing(base_url, engine, limits, monkeypatch, route):
    tokenized = []
    monkeypatch.setattr(engine, "tokenize", lambda text: tokenized.append(len(text)))
    monkeypatch.setattr(engine, "document", lambda text: tokenized.append(len(text)))
    text = "é" * (limits.max_prompt_bytes // 2 + 1)  # under the bound in characters, over it in UTF-8 bytes
    body, param = {"chat": ({"messages": [{"role": "user", "content": text}]}, "messages"),
                   "completion": ({"prompt": [text]}, "prompt"),
                   "documents": ({"documents": ["a short one", text]}, "documents[1]")}[route]
    path = {"chat": CHAT, "completion": "/v1/completions", "documents": "/v1/documents"}[route]
    error = _error(_post(base_url, body, path), 413)
    assert error["param"] == param and error["code"] == "request_too_large"
    assert str(limits.max_prompt_bytes) in error["message"] and "--max-prompt-bytes" in error["message"]
    assert tokenized == []


def test_the_bounds_are_configurable(engine):
    with _serving(create_app(engine, model_name=MODEL, max_prompt_bytes=64, max_body_bytes=100_000)) as url:
        assert _error(_post(url, {"prompt": "x" * 65}, "/v1/completions"), 413)["param"] == "prompt"
        assert _post(url, {"prompt": "x" * 64, **GREEDY}, "/v1/completions").status_code == 200
        assert _error(_post(url, {"prompt": "x" * 100_000}, "/v1/completions"), 413)["param"] is None  # the body
    from kvboost_rag.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-prompt-bytes", "1000", "--max-body-bytes", "9000"])
    assert (args.max_prompt_bytes, args.max_body_bytes) == (1000, 9000)
    assert build_parser().parse_args(["serve"]).max_prompt_bytes is None  # the context window's


def test_a_prompt_is_tokenized_outside_the_engines_lock(client, engine, monkeypatch):
    real_tokenize, held = engine.tokenize, []

    def spy(text):
        held.append(engine.lock.held_here())
        return real_tokenize(text)

    monkeypatch.setattr(engine, "tokenize", spy)
    assert _chat(client).choices[0].finish_reason is not None
    assert held and not any(held)


def test_a_slow_prompt_never_delays_another_requests_answer(client, engine, monkeypatch):
    """One request's preparation (here a tokenizer made slow, as 20 MB of text once made it) runs beside another's
    prefill and decode, not before them."""
    real_tokenize, inside = engine.tokenize, threading.Event()

    def slow_for_the_marked(text):
        if "SLOW-PROMPT" in text:
            inside.set()
            time.sleep(3.0)
        return real_tokenize(text)

    monkeypatch.setattr(engine, "tokenize", slow_for_the_marked)
    _chat(client)  # warm
    started = time.perf_counter()
    alone = _chat(client, max_tokens=4)
    alone_s = time.perf_counter() - started
    slow = threading.Thread(target=_chat, args=(client, [{"role": "user", "content": "SLOW-PROMPT: hello"}]))
    slow.start()
    assert inside.wait(timeout=30)
    started = time.perf_counter()
    beside = _chat(client, max_tokens=4)
    beside_s = time.perf_counter() - started
    slow.join(timeout=60)
    assert beside.choices[0].message.content == alone.choices[0].message.content
    assert beside_s < 1.5, f"{beside_s:.2f} s beside a slow prompt, {alone_s:.2f} s alone"


# ---- item 2: every per-request setting honoured with the engine's checks, or refused -------------------------

# A value out of range for each RepairConfig field: a new field fails this test until it has one.
_BAD = {"boundary_tokens": -1, "check_layer": 99, "recompute_ratio": -1, "taper": "x", "recency": -1.0,
        "size_multiple": -2, "drift": "yes", "fidelity": "wizard"}
# A value other than the default for each, and a strategy under which it changes what the request computes (drift
# maps are used only once calibration fitted some: the tiny engine here has none, so `drift` changes nothing).
_GOOD = {"boundary_tokens": (3, "selective"), "check_layer": (2, "cacheblend"), "recompute_ratio": (0.5, "cacheblend"),
         "taper": (1.0, "cacheblend"), "recency": (0.0, "cacheblend"), "size_multiple": (4, "cacheblend"),
         "drift": (False, "cacheblend"), "fidelity": ("fast", "cacheblend")}
_VISIBLE = {"boundary_tokens", "check_layer", "recompute_ratio", "size_multiple", "fidelity"}  # on 3 layers


def test_every_repair_field_has_a_case_here():
    assert set(_BAD) == set(_GOOD) == {f.name for f in dataclasses.fields(RepairConfig)}


@pytest.mark.parametrize("field", sorted(_BAD))
def test_a_repair_setting_out_of_range_is_refused_naming_the_field_and_its_range(client, engine, field):
    try:  # what the engine says of that value: its range, in the engine's words
        engine.prefill(QUESTION, repair=dataclasses.replace(engine.config.repair, **{field: _BAD[field]}))
        raise AssertionError(f"the engine took {field}={_BAD[field]!r}")
    except ConfigError as e:
        expected = str(e)
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, extra_body={field: _BAD[field]})
    assert e.value.param == field and expected in e.value.message
    with pytest.raises(openai.BadRequestError):  # streamed: refused before any event
        _chat(client, stream=True, extra_body={field: _BAD[field]})


@pytest.mark.parametrize("field", sorted(_GOOD))
def test_a_repair_setting_is_honoured(client, engine, docs, rag_prompt, field):
    value, strategy = _GOOD[field]
    engine.ingest(docs[:3])
    prompt = rag_prompt(docs[:3], "Who founded the Halvard company?")
    # The guard off (but where it is the setting): a random model's tokens are all unsure, so every guarded request
    # would fall back to a full prefill and no setting would show. Neither call writes back what it computed: both
    # find the store as it is now.
    given = {"fidelity": "fast", field: value}
    out = _chat(client, prompt, extra_body={"strategy": strategy, "write_back": False, **given})

    def engines(settings: dict):
        return engine.generate(prompt, strategy=strategy, max_new_tokens=GREEDY["max_tokens"], write_back=False,
                               repair=dataclasses.replace(engine.config.repair, **settings))

    figures = ("recomputed_tokens", "reused_tokens", "recompute_budget")
    expected = engines(given)
    assert [out.choices[0].message.content, *(out.kvboost[f] for f in figures)] == \
           [expected.text, *(getattr(expected, f) for f in figures)]
    if field in _VISIBLE:  # and not what the request would have done without it
        default = engines({"fidelity": "fast"} if field != "fidelity" else {})
        assert [expected.text, *(getattr(expected, f) for f in figures)] != \
               [default.text, *(getattr(default, f) for f in figures)]


def test_a_repair_setting_changes_what_is_recomputed(client, engine, docs, rag_prompt):
    engine.ingest(docs[:3])
    prompt = rag_prompt(docs[:3], "Who founded the Halvard company?")
    default = _chat(client, prompt, extra_body={"strategy": "cacheblend", "fidelity": "fast"}).kvboost
    everything = _chat(client, prompt, extra_body={"strategy": "cacheblend", "fidelity": "fast",
                                                   "recompute_ratio": 1.0}).kvboost
    assert everything["recompute_budget"] == 1.0 != default["recompute_budget"]
    assert everything["recomputed_tokens"] > default["recomputed_tokens"]
    few = _chat(client, prompt, extra_body={"strategy": "selective", "boundary_tokens": 1}).kvboost
    many = _chat(client, prompt, extra_body={"strategy": "selective", "boundary_tokens": 12}).kvboost
    assert many["recomputed_tokens"] > few["recomputed_tokens"]


@pytest.mark.parametrize("body, param", [
    ({"write_back": "no"}, "write_back"), ({"temperature": "0"}, "temperature"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": 10**9}, "max_tokens"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"seed": -1}, "seed"), ({"top_p": 1.5}, "top_p"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"), ({"strategy": "magic"}, "strategy"), ({"recompute_ration": 0.5}, "recompute_ration"),
    ({"temprature": 0}, "temprature"), ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
])
def test_a_setting_of_the_wrong_type_or_range_or_name_is_refused_naming_it(base_url, body, param):
    error = _error(_post(base_url, {"model": MODEL, "messages": QUESTION, **body}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_write_back_is_honoured(client, engine):
    question = [{"role": "user", "content": "A question never asked before, about the tides of Varde."}]
    before = engine.counters["chunks_written_back"]
    _chat(client, question, extra_body={"strategy": "full", "write_back": False})
    _chat(client, question, extra_body={"strategy": "prefix", "write_back": False})
    assert engine.counters["chunks_written_back"] == before
    _chat(client, question, extra_body={"strategy": "prefix"})
    assert engine.counters["chunks_written_back"] > before


# ---- item 3: messages OpenAI refuses --------------------------------------------------------------------------


@pytest.mark.parametrize("messages, param, words", [
    ([{"role": "system", "content": "Be brief."}, {"role": "wizard", "content": "hi"}], "messages[1].role", "wizard"),
    ([{"content": "hi"}], "messages[0].role", "no role"),
    ([{"role": 3, "content": "hi"}], "messages[0].role", "3"),
    ([{"role": "tool", "content": "hi"}], "messages[0].role", "'tool'"),
    ([{"role": "user", "content": None}], "messages[0].content", "null"),
    ([{"role": "user"}], "messages[0].content", "null"),
    ([{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}], "messages[0].content", "null"),
    ([{"role": "user", "content": 7}], "messages[0].content", "int"),
    ([{"role": "user", "content": []}], "messages[0].content", "empty"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]",
     "image_url"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "messages[0].content[0].text", "null"),
    ([{"role": "user", "content": "hi", "mood": "sunny"}], "messages[0].mood", "mood"),
    ([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}], "messages[0].tool_calls", "tools"),
    ([{"role": "user", "content": "hi", "name": 5}], "messages[0].name", "int"),
    (["hi"], "messages[0]", "dictionary"),
    ([{"role": "user", "content": "a lone \ud800 surrogate"}], "messages[0].content", "surrogate"),
])
def test_messages_openai_refuses_are_refused_naming_the_index_and_field(base_url, messages, param, words):
    error = _error(_post(base_url, {"model": MODEL, "messages": messages}), 400)
    assert error["param"] == param and words in error["message"], error


def test_text_parts_and_the_developer_role_are_still_taken(client):
    plain = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}])
    parts = _chat(client, [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                           {"role": "user", "content": [{"type": "text", "text": "Name a "},
                                                        {"type": "text", "text": "river."}], "name": "ann"}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_malformed_request_never_takes_a_slot(engine, monkeypatch):
    """While the only slot is held, a malformed or oversized request is answered for what it is (400, 413), not
    429: it never waited for, nor held, a slot."""
    real_stream, release = engine.stream, threading.Event()

    def held(*args, **kwargs):
        def pieces():
            for i, piece in enumerate(real_stream(*args, **kwargs)):
                yield piece
                if i >= 1:
                    release.wait(timeout=60)

        return pieces()

    monkeypatch.setattr(engine, "stream", held)
    with _serving(create_app(engine, model_name=MODEL, max_requests=1)) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        try:
            stream = _chat(client, max_tokens=2000, stream=True, extra_body={"strategy": "full"})
            next(iter(stream))
            assert _error(_post(url, {"messages": [{"role": "wizard", "content": "hi"}]}), 400)["param"]
            assert _error(_post(url, {"messages": QUESTION, "taper": 0}), 400)["param"] == "taper"
            assert _error(_post(url, {"messages": [{"role": "user", "content": "x" * 10**6}]}), 413)
            assert "empty prompt" in _error(_post(url, {"prompt": ""}, "/v1/completions"), 400)["message"]
            assert _error(_post(url, {"documents": ["a", " "]}, "/v1/documents"), 400)["param"] == "documents[1]"
            assert _error(_post(url, {"messages": QUESTION}), 429)["code"] == "queue_full"  # a valid one waits
        finally:
            release.set()
        stream.close()


def test_the_serve_command_freezes_what_it_loaded_before_serving(bundled_tokenizer, monkeypatch):
    """A full collection scans every object the process holds (~470k with the bundled model loaded: ~230 ms with the
    GIL held, a stall of every request in flight, which the soak met); what was loaded before serving is frozen out
    of those scans."""
    import gc

    import uvicorn

    from kvboost_rag.cli import build_parser
    from kvboost_rag.cli import serve as serve_cli

    tiny = KVBoost(LoadedModel(_tiny_model(), bundled_tokenizer, "tiny-random-llama", "seed0"), EngineConfig())
    frozen = []
    monkeypatch.setattr(serve_cli, "make_engine", lambda args, config: tiny)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: frozen.append(gc.get_freeze_count()))
    try:
        assert serve_cli.main(build_parser().parse_args(["serve"])) == 0
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 100_000  # the tiny model, the tokenizer and the libraries at least


def test_an_error_quotes_at_most_a_little_of_the_request(base_url):
    long_name = "x" * 100_000
    for body in ({"messages": QUESTION, "logprobs": [1] * 20_000}, {"messages": [{"role": long_name, "content": "a"}]},
                 {"messages": [{"role": "user", "content": "a", long_name: 1}]}):
        reply = _post(base_url, body)
        assert reply.status_code == 400 and len(reply.content) < 1000, reply.content[:200]


def test_a_client_flooding_malformed_requests_is_answered_slower_and_valid_requests_are_not(engine):
    """A client's refusals beyond server_gate.ERROR_BURST come ERROR_DELAY_S later (an asyncio sleep): a client that
    waits for each answer is held to about ERROR_RATE refusals a second, so refusing it cannot take the GIL the
    engine's thread needs (docs/load_test.md). Its valid requests are answered as ever."""
    from kvboost_rag import server_gate

    bad = {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}
    # One kept-alive connection: a new one per request (httpx.post) costs the client 30-60 ms on a slow CPU, as much
    # as the delay itself, and the checks below time the server's answer, not the client's set-up.
    with _serving(create_app(engine, model_name=MODEL)) as url, httpx.Client() as http:

        def refuse() -> float:
            started = time.perf_counter()
            _error(_post(url, bad, client=http), 400)
            return time.perf_counter() - started

        for _ in range(3):
            assert http.get(f"{url}/health").status_code == 200  # connected and warm; /health takes no token
        took, first = [], time.perf_counter()
        for _ in range(3 * server_gate.ERROR_BURST):
            took.append(refuse())
        elapsed = time.perf_counter() - first
        assert max(took[:server_gate.ERROR_BURST // 2]) < server_gate.ERROR_DELAY_S  # a burst is answered at once
        fast = sum(t < server_gate.ERROR_DELAY_S for t in took)
        assert fast <= server_gate.ERROR_BURST + server_gate.ERROR_RATE * elapsed + 1  # then at most the rate
        assert sum(t >= server_gate.ERROR_DELAY_S for t in took) >= server_gate.ERROR_BURST // 2
        assert max(took) < 0.1 + server_gate.ERROR_DELAY_S
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            assert _chat(client, max_tokens=2).choices[0].message.content
        time.sleep(server_gate.ERROR_BURST / server_gate.ERROR_RATE)  # the bucket fills again
        assert refuse() < server_gate.ERROR_DELAY_S
