"""What a request to the OpenAI-compatible server (server.py) may hold, checked before the engine sees any of it.

- The body: JSON read by a schema of strict types, as OpenAI reads it ("5" is no number, 1.5 no whole number).
- Its size (`Limits`): a body over max_body_bytes gets 413 before it is read (server_gate.py), and a request whose
  text is over max_prompt_bytes gets 413 before any tokenizing. Both follow the model's context window by default:
  a prompt that fits it is PROMPT_BYTES_PER_TOKEN bytes a token at most, and its body JSON_BYTES_PER_TEXT_BYTE
  bytes a byte of text at most. Tokenizing the largest prompt allowed takes tens of milliseconds, so no request
  can hold the server for longer than that before it is refused (issue 40).
- Messages as OpenAI takes them (`chat_messages`): a role of system, developer, user or assistant and a content
  that is a string or a list of text parts; anything else is a 400 naming messages[i] and the field.
- The engine's per-request settings (`make_call`): OpenAI's sampling fields, `strategy`, `write_back` and every
  RepairConfig field (`recompute_ratio`, `taper`, `fidelity`, ... as the CLI and the LLM classes take them), each
  honoured after the engine's own checks (a 400 naming the field and its range). A field that would change the
  answer and is not implemented here is refused by name; so is an unknown one that looks like one of ours (a typo).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from . import repair as repair_registry
from .config import ConfigError, check_for_model
from .engine import KVBoost
from .llm import REPAIR_FIELDS, check_sampling, repair_overrides

# OpenAI's default is "up to the context window"; the engine reserves room for the answer before the
# prefill, so a bound is needed. A request over the window is refused saying so.
DEFAULT_MAX_TOKENS = 256
# OpenAI's default sampling (temperature 1); send temperature=0 for greedy answers.
DEFAULT_TEMPERATURE = 1.0
# Prose runs 3-5 UTF-8 bytes a token on the tokenizers kvboost-rag serves, code and tables fewer, so a prompt that
# fits the context window holds at most this many bytes a token of it, unless it is mostly long runs of spaces or
# symbols (which --max-prompt-bytes admits). Emoji and CJK text run under 2 bytes a token.
PROMPT_BYTES_PER_TOKEN = 8
# What a chat template adds around each message, at least (SmolLM2's "<|im_start|>user\n...<|im_end|>\n" is 27).
MESSAGE_OVERHEAD_BYTES = 16
# JSON escapes a byte of text in 6 bytes at most (\u001f); the rest of a request (settings, names) fits the slack.
JSON_BYTES_PER_TEXT_BYTE = 6
BODY_SLACK_BYTES = 64 * 1024
# OpenAI takes up to 4 stop sequences; each is compared with the answer at every token.
MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant")
# Message fields only tool calling uses, which this server does not implement: refused unless null.
_TOOL_FIELDS = ("tool_calls", "function_call", "tool_call_id", "audio")
_MESSAGE_FIELDS = ("role", "content", "name", "refusal", *_TOOL_FIELDS)


@dataclass(frozen=True)
class Limits:
    max_prompt_bytes: int  # UTF-8 bytes of a request's text (a chat's messages, a prompt, one document)
    max_body_bytes: int  # bytes of a request's body
    max_context: int  # the model's context window, in tokens


def limits_for(max_context: int, max_prompt_bytes: int | None = None, max_body_bytes: int | None = None) -> Limits:
    """The server's bounds for a model of `max_context` tokens: given ones, else defaults that follow that window."""
    for name, value in (("max_prompt_bytes", max_prompt_bytes), ("max_body_bytes", max_body_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a whole number of bytes >= 1, got {value!r}")
    prompt = max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_context
    return Limits(prompt, max_body_bytes or JSON_BYTES_PER_TEXT_BYTE * prompt + BODY_SLACK_BYTES, max_context)


# ---- the schema ------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class Sampling(BaseModel):
    """What both completion routes take. Unknown fields are kept: the engine's repair settings are among them
    (RepairConfig's fields, by name), and so are the fields that would change the answer, unsupported here, which
    are refused by name instead of silently ignored (see _UNSUPPORTED)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's, but a common extension
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    strategy: str | None = None  # kvboost: how the prompt's KV is reused (kvboost_rag.repair.names())
    write_back: bool | None = None  # kvboost: store the chunks this request computes (KVBoost.stream's write_back)


class ChatRequest(Sampling):
    messages: list[dict[str, Any]]  # checked by chat_messages, which names the message and field it refuses
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given


class CompletionRequest(Sampling):
    prompt: str | list[str]


class DocumentsRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    documents: list[str]
    pin: bool = False


# Request fields that would change the answer and that this server does not implement, with the value
# each may have anyway (their "off" value, as clients often send it explicitly).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
    "response_format": (None, {"type": "text"}),
}
# The names this server acts on: an unknown field close to one of them is taken for a typo of it.
_OURS = (*Sampling.model_fields, "messages", "max_completion_tokens", "prompt", *REPAIR_FIELDS)


class APIError(Exception):
    """A request refused with OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def too_large(what: str, size: int, limit: int, param: str | None, hint: str) -> APIError:
    return APIError(413, f"{what} holds {size} bytes, more than this server takes ({limit}); {hint}", param=param,
                    code="request_too_large")


# ---- messages and prompts --------------------------------------------------------------------------


def chat_messages(messages: list[dict[str, Any]], limits: Limits) -> list[dict]:
    """The request's messages as the chat template takes them (text content only), each checked as OpenAI checks
    it, and their text bounded by limits.max_prompt_bytes."""
    if not messages:
        raise APIError(400, "messages is empty: send at least one message", param="messages")
    chat, size = [], 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        for name, value in message.items():
            if name not in _MESSAGE_FIELDS:
                raise APIError(400, f"{where}: unknown field {_shown(name)}; a message holds role, content and name",
                               param=f"{where}.{_shown(name, quote=False)}")
            if name in _TOOL_FIELDS and value is not None:
                raise APIError(400, f"{where}.{name} is not supported: this server does not call tools",
                               param=f"{where}.{name}")
        role = message.get("role")
        if role not in ROLES:
            shown = "no role" if role is None else f"the role {_shown(role)}"
            raise APIError(400, f"{where} has {shown}; use one of {', '.join(map(repr, ROLES))}",
                           param=f"{where}.role")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise APIError(400, f"{where}.name must be a string, got {_type(name)}", param=f"{where}.name")
        text = _content_text(message.get("content"), where)
        size += _utf8_size(text, f"{where}.content") + MESSAGE_OVERHEAD_BYTES
        if size > limits.max_prompt_bytes:  # said at once, before the rest is looked at
            raise too_large("messages", size, limits.max_prompt_bytes, "messages",
                            "shorten them or retrieve fewer documents (the server's --max-prompt-bytes)")
        # Chat templates know "system"; OpenAI's newer "developer" role means the same.
        chat.append({"role": "system" if role == "developer" else role, "content": text})
    return chat


def _content_text(content: Any, where: str) -> str:
    """A message's text: its content string, or the texts of its list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts, got {_type(content)}",
                       param=f"{where}.content")
    if not content:
        raise APIError(400, f"{where}.content is an empty list: send at least one text part",
                       param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        here = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else _type(part)
            raise APIError(400, f"{here}: only text content parts are supported, got {_shown(kind)}", param=here)
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{here}.text must be a string, got {_type(part.get('text'))}", param=f"{here}.text")
        texts.append(part["text"])
    return "".join(texts)


def _shown(value: Any, *, quote: bool = True, limit: int = 80) -> str:
    """A value of the request's, quoted in a message: never more than `limit` characters of it (a field's name or
    value may be as long as the body)."""
    text = repr(value) if quote or not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit] + "..."


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _utf8_size(text: str, param: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:  # JSON's \ud800 escapes make lone surrogates, which no tokenizer takes
        raise APIError(400, f"{param} holds a lone surrogate at character {e.start}, which is not valid Unicode",
                       param=param) from None


def prompt_text(prompt: str | list[str], limits: Limits) -> str:
    text = prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, f"prompt holds {len(prompt)} prompts: send one prompt per request", param="prompt")
        text = prompt[0]
    if not text:  # refused here rather than by the engine, so that it never takes a slot
        raise APIError(400, "empty prompt: give some text to answer", param="prompt")
    size = _utf8_size(text, "prompt")
    if size > limits.max_prompt_bytes:
        raise too_large("prompt", size, limits.max_prompt_bytes, "prompt",
                        "shorten it or retrieve fewer documents (the server's --max-prompt-bytes)")
    return text


def check_documents(documents: list[str], limits: Limits) -> None:
    for i, text in enumerate(documents):
        if not text.strip():  # refused here rather than by the engine, so that it never takes a slot
            raise APIError(400, f"empty document: documents[{i}] has no text; drop empty ones before ingesting",
                           param=f"documents[{i}]")
        size = _utf8_size(text, f"documents[{i}]")
        if size > limits.max_prompt_bytes:
            raise too_large(f"documents[{i}]", size, limits.max_prompt_bytes, f"documents[{i}]",
                            "split it into smaller documents (the server's --max-prompt-bytes)")


# ---- the engine's settings -------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One request, checked: what to send `KVBoost.stream` and how to answer."""

    prompt: str | list[dict]
    options: dict  # KVBoost.stream keyword arguments
    stream: bool
    include_usage: bool


def make_call(request: Sampling, prompt: str | list[dict], engine: KVBoost, limits: Limits, *,
              max_tokens: int | None, max_tokens_name: str = "max_tokens") -> Call:
    """The request's settings checked as the engine checks them (a ConfigError names the field, in the request's
    words: server._describe), and the fields this server does not act on refused."""
    extra = dict(request.model_extra or {})
    repair = {name: extra.pop(name) for name in REPAIR_FIELDS if name in extra}
    _refuse_unsupported(request, extra)
    if max_tokens is not None and max_tokens >= limits.max_context:  # refused before the prompt is tokenized
        raise APIError(400, f"{max_tokens_name}={max_tokens} leaves no room for a prompt in the model's context "
                            f"window ({limits.max_context} tokens)", param=max_tokens_name)
    stop = () if request.stop is None else (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop holds {len(stop)} sequences; send at most {MAX_STOP}", param="stop")
    options = dict(max_new_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                   temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
                   top_p=1.0 if request.top_p is None else request.top_p, top_k=request.top_k or 0,
                   stop=stop, seed=request.seed)
    try:
        check_sampling(options)
    except ConfigError as e:
        raise ConfigError(max_tokens_name if e.field == "max_new_tokens" else e.field, str(e)) from None
    if request.strategy is not None:  # else the engine's default
        try:
            repair_registry.get_strategy(request.strategy)
        except ValueError as e:
            raise APIError(400, str(e), param="strategy") from None
        options["strategy"] = request.strategy
    if request.write_back is not None:
        options["write_back"] = request.write_back
    given = repair_overrides(repair)  # each field's range, as RepairConfig checks it
    if given:
        settings = dataclasses.replace(engine.config.repair, **given)
        options["repair"] = check_for_model(settings, engine.adapter.num_layers)
    include_usage = bool(request.stream and request.stream_options and request.stream_options.include_usage)
    return Call(prompt, options, bool(request.stream), include_usage)


def _refuse_unsupported(request: Sampling, extra: dict[str, Any]) -> None:
    if request.n not in (None, 1):
        raise APIError(400, f"n={request.n} is not supported: this server returns one choice per request; "
                            "send n=1 (or leave it out) and make several requests", param="n")
    for name, value in extra.items():
        allowed = _UNSUPPORTED.get(name)
        if allowed is not None and value not in allowed:
            raise APIError(400, f"{name}={_shown(value, quote=False)} is not supported by kvboost-rag's server; "
                                "leave it out",
                           param=name)
        if allowed is None:
            near = difflib.get_close_matches(name, _OURS, n=1, cutoff=0.8)
            if near:
                raise APIError(400, f"unknown field {_shown(name)}: did you mean {near[0]!r}?",
                               param=_shown(name, quote=False))
