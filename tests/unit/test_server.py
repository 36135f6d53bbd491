"""The OpenAI-compatible server (kvboost_rag.server), driven over real HTTP by the real openai client.

One uvicorn server per module, on a free port of 127.0.0.1 in a background thread, over one tiny
random-weight engine (tests/conftest.py's make_tiny_engine, built once for the module); a server with an API key
and one bounded to a single request in flight share that engine.
"""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.cli import serve as serve_cli
from kvboost_rag.models import LoadedModel
from kvboost_rag.server import create_app
from kvboost_rag.server_gate import DEFAULT_MAX_REQUESTS

MODEL = "tiny-kvboost"
KEY = "sk-kvboost-test-key"
QUESTION = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Which city has the oldest observatory?"}]
GREEDY = dict(temperature=0, max_tokens=6)


def _tiny_model():
    """tests/conftest.py's tiny random Llama, the model behind make_tiny_engine. That fixture is
    function-scoped (one server per module needs one engine per module), and tests/conftest.py cannot be
    imported by name (`conftest` is tests/unit/conftest.py here): loaded by path."""
    spec = importlib.util.spec_from_file_location("kvboost_tests_conftest", Path(__file__).parents[1] / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_model()


@pytest.fixture(scope="module")
def engine(bundled_tokenizer):
    # What make_tiny_engine() makes: the tiny model, the real tokenizer, a store of its own.
    engine = KVBoost(LoadedModel(_tiny_model(), bundled_tokenizer, "tiny-random-llama", "seed0"), EngineConfig())
    yield engine
    engine.close()


@contextmanager
def _serving(app):
    """`app` served by uvicorn in a background thread: its base URL."""
    # IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on sockets that say they are TCP (uvicorn's own
    # do), and with it on, a response's body waits for the client's delayed ACK of its headers: 40 ms a request.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no other process can take it meanwhile
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def base_url(engine):
    with _serving(create_app(engine, model_name=MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def keyed_url(engine):
    with _serving(create_app(engine, model_name=MODEL, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def narrow_url(engine):
    with _serving(create_app(engine, model_name=MODEL, max_requests=1)) as url:
        yield url


def _chat(client, messages=QUESTION, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **{**GREEDY, **kwargs})


def _metrics(base_url, **kwargs) -> dict:
    """/metrics parsed: {(sample name, sorted labels): value}."""
    reply = httpx.get(f"{base_url}/metrics", **kwargs)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(reply.text) for sample in family.samples}


def _sample(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


# ---- answers -------------------------------------------------------------------------------------


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok", "model": MODEL}


@pytest.mark.parametrize("strategy", ["full", "cacheblend"])
def test_chat_is_the_engines_answer(client, engine, strategy):
    out = _chat(client, extra_body={"strategy": strategy})
    expected = engine.generate(QUESTION, strategy=strategy, max_new_tokens=GREEDY["max_tokens"])
    assert out.object == "chat.completion" and out.model == MODEL
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == expected.prompt_tokens
    assert out.usage.completion_tokens == expected.generated_tokens
    assert out.usage.total_tokens == expected.prompt_tokens + expected.generated_tokens
    assert out.kvboost["strategy"] == strategy
    assert out.kvboost["ttft_ms"] > 0
    assert out.kvboost["reused_tokens"] + out.kvboost["recomputed_tokens"] == out.usage.prompt_tokens
    assert out.kvboost["recompute_budget"] == expected.recompute_budget  # None for full, the level's for cacheblend
    assert out.usage.prompt_tokens_details.cached_tokens == out.kvboost["reused_tokens"]


def test_strategy_defaults_to_the_engines_and_is_honoured(client):
    assert _chat(client).kvboost["strategy"] == "cacheblend"
    for strategy in ("naive", "prefix"):
        assert _chat(client, extra_body={"strategy": strategy}).kvboost["strategy"] == strategy


def test_max_tokens_bounds_the_answer(client):
    out = _chat(client, max_tokens=3)
    old = _chat(client, max_tokens=None, max_completion_tokens=3)  # the newer name, the same bound
    assert out.usage.completion_tokens == old.usage.completion_tokens <= 3
    assert out.choices[0].message.content == old.choices[0].message.content
    if out.choices[0].finish_reason == "length":
        assert out.usage.completion_tokens == 3


def test_stop_cuts_the_answer_as_the_engine_does(client, engine):
    full = engine.generate(QUESTION, strategy="full", max_new_tokens=12).text
    stop = full.strip()[4:7]
    assert stop, f"the tiny model's answer is too short to cut: {full!r}"
    expected = engine.generate(QUESTION, strategy="full", max_new_tokens=12, stop=[stop]).text
    assert stop not in expected and full.startswith(expected)
    for given in (stop, [stop]):  # OpenAI takes one string or a list
        out = _chat(client, max_tokens=12, stop=given, extra_body={"strategy": "full"})
        assert out.choices[0].message.content == expected
        assert out.choices[0].finish_reason == "stop"


def test_streamed_chat_is_the_whole_answer(client):
    whole = _chat(client, max_tokens=8, extra_body={"strategy": "full"})
    chunks = list(_chat(client, max_tokens=8, stream=True, stream_options={"include_usage": True},
                        extra_body={"strategy": "full"}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == [whole.choices[0].finish_reason]
    assert finish[0].kvboost["strategy"] == "full"
    # include_usage: one last chunk with no choices and the usage, null on every chunk before it
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == finish[0].kvboost["reused_tokens"]
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_sends_none(client):
    chunks = list(_chat(client, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None
    assert all(c.usage is None for c in chunks)


def test_text_completion_is_the_engines_answer(client, engine):
    prompt = "The observatory on the mountain"
    expected = engine.generate(prompt, strategy="full", max_new_tokens=6)
    out = client.completions.create(model=MODEL, prompt=prompt, extra_body={"strategy": "full"}, **GREEDY)
    assert out.object == "text_completion"
    assert out.choices[0].text == expected.text
    assert out.usage.prompt_tokens == expected.prompt_tokens
    assert out.usage.completion_tokens == expected.generated_tokens
    streamed = list(client.completions.create(model=MODEL, prompt=[prompt], stream=True,
                                              extra_body={"strategy": "full"}, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == expected.finish_reason


def test_documents_are_ingested_and_then_reused(client, engine, base_url, docs, rag_prompt):
    reply = httpx.post(f"{base_url}/v1/documents", json={"documents": docs[:2]}, timeout=60)
    assert reply.status_code == 200, reply.text
    ids = reply.json()["ids"]
    assert ids == engine.ingest(docs[:2])  # idempotent: the ids of what the server stored
    # naive reuses every ingested document found in the prompt as stored, so all their tokens count
    out = _chat(client, rag_prompt(docs[:2], "Who founded the Halvard company?"), extra_body={"strategy": "naive"})
    doc_tokens = sum(len(engine.document(text).token_ids) for text in docs[:2])
    assert out.kvboost["reused_tokens"] >= doc_tokens > 0
    # OpenAI's name for them, in every usage object: chat and text, whole and streamed
    assert out.usage.prompt_tokens_details.cached_tokens == out.kvboost["reused_tokens"]
    chunks = list(_chat(client, rag_prompt(docs[:2], "Who founded the Halvard company?"), stream=True,
                        stream_options={"include_usage": True}, extra_body={"strategy": "naive"}))
    finish = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == finish.kvboost["reused_tokens"] >= doc_tokens
    prompt = "\n\n".join(docs[:2]) + "\n\nQuestion: who founded the Halvard company?"
    text = client.completions.create(model=MODEL, prompt=prompt, extra_body={"strategy": "naive"}, **GREEDY)
    assert text.usage.prompt_tokens_details.cached_tokens == text.kvboost["reused_tokens"] >= doc_tokens
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"strategy": "naive"}, **GREEDY))
    finish = next(c for c in streamed if c.choices and c.choices[0].finish_reason)
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == finish.kvboost["reused_tokens"] >= doc_tokens


def test_client_disconnect_closes_the_engine_stream(client, engine, monkeypatch):
    real_stream, steps, closed = engine.stream, [], threading.Event()

    def spy(*args, **kwargs):
        def pieces():
            try:
                for piece in real_stream(*args, **kwargs):
                    steps.append(piece)
                    yield piece
            except GeneratorExit:
                closed.set()
                raise

        return pieces()

    monkeypatch.setattr(engine, "stream", spy)
    stream = _chat(client, max_tokens=2000, stream=True, extra_body={"strategy": "full"})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    assert closed.wait(timeout=30), "the engine stream was not closed after the client went away"
    assert len(steps) < 2000


def test_concurrent_requests_each_get_their_own_answer(client):
    # The requests decode on the engine's workers at once (batched steps); each answer stays what it is alone.
    questions = [[{"role": "user", "content": f"Name a {thing}."}] for thing in ("river", "mountain", "city")]
    alone = [_chat(client, q, extra_body={"strategy": "full"}).choices[0].message.content for q in questions]
    answers = [None] * len(questions)

    def ask(i):
        stream = _chat(client, questions[i], stream=True, extra_body={"strategy": "full"})
        answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert answers == alone


# ---- errors --------------------------------------------------------------------------------------


def test_n_above_one_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, n=2)
    assert e.value.param == "n" and "n=2" in e.value.message


def test_unknown_strategy_is_refused_listing_the_known_ones(client):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, extra_body={"strategy": "magic"})
    assert "unknown strategy 'magic'" in e.value.message
    assert all(name in e.value.message for name in ("full", "naive", "cacheblend"))
    with pytest.raises(openai.BadRequestError):  # streaming: refused before any event
        _chat(client, stream=True, extra_body={"strategy": "magic"})


def test_empty_and_too_long_prompts_are_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="", **GREEDY)
    assert "empty prompt" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 5000, stream=True, **GREEDY)
    assert "context window" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, messages=[])
    assert e.value.param == "messages"


def test_bad_sampling_values_name_the_request_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=0)
    assert e.value.param == "max_tokens" and "max_tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, top_p=0)
    assert e.value.param == "top_p"


def test_unsupported_options_are_refused_not_ignored(client):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, logprobs=True)
    assert e.value.param == "logprobs"
    assert _chat(client, logprobs=False, presence_penalty=0).choices  # their "off" values are fine


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=QUESTION, **GREEDY)
    assert e.value.code == "model_not_found" and "gpt-9" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_malformed_requests_get_openais_error_shape(base_url):
    reply = httpx.post(f"{base_url}/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    reply = httpx.post(f"{base_url}/v1/documents", json={"documents": [""]})
    assert reply.status_code == 400 and "empty document" in reply.json()["error"]["message"]
    reply = httpx.get(f"{base_url}/v1/nothing")
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"


# ---- metrics -------------------------------------------------------------------------------------


def test_metrics_count_what_was_served(client, engine, base_url, docs):
    engine.ingest(docs[:1])
    before = _metrics(base_url)
    chat = _chat(client, extra_body={"strategy": "full"})
    prompt = docs[0] + "\n\nQuestion: who founded it?"
    text = client.completions.create(model=MODEL, prompt=prompt, extra_body={"strategy": "naive"}, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    after = _metrics(base_url)

    def moved(name, **labels):
        return _sample(after, name, **labels) - _sample(before, name, **labels)

    assert moved("kvboost_requests_total", route="/v1/chat/completions", status="200") == 1
    assert moved("kvboost_requests_total", route="/v1/completions", status="200") == 1
    assert moved("kvboost_requests_total", route="/v1/models/{model:path}", status="404") == 1
    assert moved("kvboost_ttft_seconds_count") == 2
    assert moved("kvboost_ttft_seconds_sum") == pytest.approx((chat.kvboost["ttft_ms"] + text.kvboost["ttft_ms"]) / 1e3)
    assert moved("kvboost_prompt_tokens_total") == chat.usage.prompt_tokens + text.usage.prompt_tokens
    reused = chat.usage.prompt_tokens_details.cached_tokens + text.usage.prompt_tokens_details.cached_tokens
    assert moved("kvboost_reused_tokens_total") == reused > 0
    assert moved("kvboost_completion_tokens_total") == chat.usage.completion_tokens + text.usage.completion_tokens
    assert _sample(after, "kvboost_store_bytes") == engine.store.nbytes > 0
    assert _sample(after, "kvboost_requests_in_flight") == 0
    assert _sample(after, "kvboost_max_requests") == DEFAULT_MAX_REQUESTS
    assert moved("kvboost_requests_rejected_total") == 0
    # Issue 39: the found documents' tokens and those served from the store (the completion holds docs[0]).
    found = len(engine.document(docs[0]).token_ids)
    assert moved("kvboost_document_tokens_total") == found == text.kvboost["document_tokens"]
    assert moved("kvboost_document_tokens_reused_total") == text.kvboost["document_tokens_reused"] > 0.9 * found
    assert _sample(after, "kvboost_shadow_checks") == engine.shadow.figures()["checks"]  # issue 41's online checks
    # decode forwards, and the draft tokens lone streams checked in them (lookahead.py): those answers ran alone
    for key in ("batches", "rows", "drafted", "drafts_used"):
        assert _sample(after, f"kvboost_decode_{key}") == engine.batcher.counters[key]
    # every token after an answer's first came from a forward or a draft's row (a last one ends at an EOS or not)
    answered = chat.usage.completion_tokens + text.usage.completion_tokens
    assert answered - 2 <= moved("kvboost_decode_batches") + moved("kvboost_decode_drafts_used") <= answered
    engine.routes.counters["skipped"] += 3  # the ladder's steps measured not to pay (repair/routes.py)
    assert _sample(_metrics(base_url), "kvboost_ladder_skipped") == engine.routes.counters["skipped"] >= 3
    engine.shadow.counters.update(trials_held=1, trials_refused=2)  # their trials, made after their requests
    scraped = _metrics(base_url)
    for outcome in ("held", "refused", "dropped"):
        assert _sample(scraped, "kvboost_ladder_trials", outcome=outcome) == engine.shadow.figures()["trials"][outcome]
    assert engine.shadow.figures()["trials"]["refused"] >= 2
    # as checks that ran the floors count them
    engine.shadow.counters.update(order_tokens=10, order_predicted_flips=1.5, order_observed_flips=2)
    scraped, floors = _metrics(base_url), engine.shadow.figures()["floors"]
    for key in ("tokens", "predicted_flips", "observed_flips"):
        for floor in ("order", "dtype"):
            assert _sample(scraped, f"kvboost_shadow_floor_{key}", floor=floor) == floors[floor][key]
    assert floors["order"]["tokens"] >= 10 and floors["order"]["predicted_flips"] >= 1.5
    # the floor risk a level's answers lend on (fidelity.Account)
    engine.accounts["balanced"].repay(0.0, 1.0)
    assert engine.accounts["balanced"].borrow(0.2)
    scraped = _metrics(base_url)
    for key in ("credit", "loans", "borrowed"):
        for level, account in engine.accounts.items():
            assert _sample(scraped, f"kvboost_floor_credit_{key}", level=level) == account.figures()[key]
    assert _sample(scraped, "kvboost_floor_credit_loans", level="balanced") >= 1


def test_each_app_keeps_its_own_metrics(engine):
    first, second = create_app(engine), create_app(engine)  # the global registry would refuse the second
    assert first is not second


# ---- the API key ---------------------------------------------------------------------------------


def test_the_api_key_guards_v1_and_metrics_but_not_health(keyed_url):
    with openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="sk-wrong", max_retries=0, timeout=60) as wrong:
        with pytest.raises(openai.AuthenticationError) as e:
            _chat(wrong)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    with openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=KEY, max_retries=0, timeout=60) as right:
        assert [m.id for m in right.models.list()] == [MODEL]
        assert _chat(right).choices[0].finish_reason is not None
        assert "".join(c.choices[0].delta.content or "" for c in _chat(right, stream=True) if c.choices) is not None
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY[:-1]}"},
                    {"Authorization": f"Bearer {KEY}x"}):
        reply = httpx.post(f"{keyed_url}/v1/documents", json={"documents": ["x"]}, headers=headers)
        assert reply.status_code == 401, headers
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed_url}/v1/nothing").status_code == 401  # the key before the route
    assert httpx.get(f"{keyed_url}/health").status_code == 200
    assert httpx.get(f"{keyed_url}/metrics").status_code == 401
    metrics = _metrics(keyed_url, headers={"Authorization": f"Bearer {KEY}"})
    assert _sample(metrics, "kvboost_requests_total", route="/v1/chat/completions", status="401") == 1
    assert _sample(metrics, "kvboost_requests_total", route="/v1/chat/completions", status="200") == 2


def test_create_app_refuses_an_empty_key_and_a_bound_under_one(engine):
    with pytest.raises(ValueError, match="api_key"):
        create_app(engine, api_key=" ")
    with pytest.raises(ValueError, match="max_requests"):
        create_app(engine, max_requests=0)


def test_the_serve_command_takes_the_key_and_the_bound(monkeypatch):
    from kvboost_rag.cli import build_parser

    args = build_parser().parse_args(["serve", "--api-key", "k1", "--max-requests", "3"])
    assert (args.api_key, args.max_requests) == ("k1", 3)
    assert build_parser().parse_args(["serve"]).max_requests == DEFAULT_MAX_REQUESTS
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-requests", "0"])
    monkeypatch.setenv("KVBOOST_API_KEY", "from-env")
    assert serve_cli._api_key(None) == "from-env" and serve_cli._api_key("given") == "given"
    monkeypatch.setenv("KVBOOST_API_KEY", "")
    assert serve_cli._api_key(None) is None
    with pytest.raises(ValueError, match="--api-key"):
        serve_cli._api_key("")


# ---- the bound on requests in flight -------------------------------------------------------------


def test_a_request_beyond_max_requests_gets_429_until_a_slot_frees(narrow_url, engine, monkeypatch):
    real_stream, release, closed = engine.stream, threading.Event(), threading.Event()

    def held(*args, **kwargs):
        def pieces():
            try:
                for i, piece in enumerate(real_stream(*args, **kwargs)):
                    yield piece
                    if i >= 1:  # mid-decode, the stream holds its slot until released
                        release.wait(timeout=60)
            except GeneratorExit:
                closed.set()
                raise

        return pieces()

    monkeypatch.setattr(engine, "stream", held)
    with openai.OpenAI(base_url=f"{narrow_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        try:
            stream = _chat(client, max_tokens=2000, stream=True, extra_body={"strategy": "full"})
            next(iter(stream))  # the role delta: prefilled, decoding
            with pytest.raises(openai.RateLimitError) as e:
                _chat(client)
            assert e.value.status_code == 429 and e.value.code == "queue_full"
            assert e.value.response.headers["retry-after"] == "1"
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL, prompt="A second one", stream=True, **GREEDY)
            metrics = _metrics(narrow_url)
            assert _sample(metrics, "kvboost_requests_in_flight") == 1
            assert _sample(metrics, "kvboost_requests_rejected_total") == 2
            assert _sample(metrics, "kvboost_requests_total", route="/v1/completions", status="429") == 1
            stream.close()  # the client goes away mid-answer: its slot must come free
        finally:
            release.set()
        assert closed.wait(timeout=30), "the engine stream was not closed after the client went away"
        deadline = time.monotonic() + 30
        while True:
            try:
                out = _chat(client)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the slot of the client that went away was never freed"
                time.sleep(0.05)
        assert out.choices[0].finish_reason is not None
        assert _chat(client).choices and _chat(client, stream=True).response.status_code == 200  # each frees its slot
    assert _sample(_metrics(narrow_url), "kvboost_requests_in_flight") == 0


# ---- the frameworks' own OpenAI clients ---------------------------------------------------------------------


def test_langchain_chat_openai_gets_the_engines_answer(base_url, engine):
    langchain_openai = pytest.importorskip("langchain_openai", reason="pip install langchain-openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="x", temperature=0,
                                      max_tokens=GREEDY["max_tokens"], max_retries=0)
    messages = [("system", QUESTION[0]["content"]), ("human", QUESTION[1]["content"])]
    expected = engine.generate(QUESTION, max_new_tokens=GREEDY["max_tokens"])
    reply = llm.invoke(messages)
    assert reply.content == expected.text
    assert reply.usage_metadata["input_tokens"] == expected.prompt_tokens
    streamed = "".join(chunk.content for chunk in llm.stream(messages))
    assert streamed == expected.text


def test_llamaindex_openai_like_gets_the_engines_answer(base_url, engine):
    openai_like = pytest.importorskip("llama_index.llms.openai_like", reason="pip install llama-index-llms-openai-like")
    from llama_index.core.llms import ChatMessage

    llm = openai_like.OpenAILike(model=MODEL, api_base=f"{base_url}/v1", api_key="x", is_chat_model=True,
                                 temperature=0, max_tokens=GREEDY["max_tokens"], max_retries=0)
    expected = engine.generate(QUESTION, max_new_tokens=GREEDY["max_tokens"])
    reply = llm.chat([ChatMessage(role=m["role"], content=m["content"]) for m in QUESTION])
    assert reply.message.content == expected.text
    streamed = "".join(r.delta or "" for r in llm.stream_chat(
        [ChatMessage(role=m["role"], content=m["content"]) for m in QUESTION]))
    assert streamed == expected.text
