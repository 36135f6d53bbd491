"""ChatKVBoost: a LangChain chat model on a local HF decoder with document KV reuse."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kvboost_rag import Generation, KVBoost
from kvboost_rag.config import check_doc_context, check_order, check_strategy
from kvboost_rag.models import parse_dtype
from kvboost_rag.serving import (
    REPAIR_FIELDS,
    astream_pieces,
    check_engine_doc_context,
    check_llm_fields,
    check_repair_knobs,
    check_sampling,
    model_key,
    repair_overrides,
    shared_engine,
)

# Per-call keyword arguments (`invoke(..., strategy="full")`, `.bind(max_tokens=8)`).
_CALL_ARGS = ("strategy", "max_tokens", "temperature", "top_p", "top_k", "seed", *REPAIR_FIELDS,
              "write_back")
# Keyword arguments LangChain itself may pass down; they need nothing from us.
_IGNORED_ARGS = ("stream",)


class ChatKVBoost(BaseChatModel):
    """Chat model on a local HuggingFace decoder that reuses precomputed document KV.

    Documents are ingested once (`prewarm`), as KV-cache chunks. At query time the rendered
    prompt is searched for ingested documents by their exact text, wherever the retriever put
    them, and their stored KV is reused; the chosen `strategy` repairs the seams.

    Setup:
        ```bash
        pip install langchain-kvboost
        ```

    Instantiate:
        ```python
        from langchain_kvboost import ChatKVBoost

        llm = ChatKVBoost(max_tokens=64)  # the bundled SmolLM2-135M-Instruct, on the CPU
        llm.prewarm(docs)  # LangChain Documents or strings
        ```

    Invoke:
        ```python
        msg = llm.invoke([("system", "Context:\\n\\n" + context), ("human", question)])
        msg.usage_metadata["input_token_details"]["cache_read"]  # prompt tokens reused
        msg.response_metadata["ttft_ms"]
        ```

    Per call, `strategy`, `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
    `recompute_ratio`, `taper`, `recency`, `boundary_tokens`, `check_layer`, `qa_order`, `drift`, `drift_strength`
    and `write_back`
    can be overridden:
    `llm.invoke(msgs, strategy="full")` or `llm.bind(strategy="full")`.

    Tool calling and structured output are not supported.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model: str | None = None
    """Local folder or hub id of a HuggingFace decoder; None = the bundled SmolLM2-135M-Instruct."""
    dtype: str = "float32"
    """Compute dtype: "float32", "bfloat16" or "float16"."""
    doc_context: str | None = None
    """How documents are encoded at ingestion: "passage" (after a neutral paragraph, as a later document of
    a prompt), "template" or "none" (alone); see kvboost_rag.config.ChunkingConfig. None = the default
    ("passage"), or the given `engine`'s own."""
    strategy: str = "cacheblend"
    """How the assembled prompt cache is repaired: one of kvboost_rag.config.STRATEGIES."""
    max_tokens: int = Field(default=256, alias="max_new_tokens", ge=1)
    """Most tokens to generate."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 = greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    """0 = no top-k cut."""
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Generation stops before any of these strings; they are not part of the output."""
    seed: int | None = None
    """Seed of the sampler (with temperature > 0); None = not seeded."""
    recompute_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    """cacheblend: fraction of reused tokens recomputed per layer, averaged (the quality dial: 1.0 is
    a full prefill); None = the engine's default."""
    taper: float | None = Field(default=None, ge=1.0)
    """cacheblend: how many times more tokens the first repaired layer runs than the last (1.0 = one
    set for all layers); None = the engine's default."""
    recency: float | None = Field(default=None, ge=0.0)
    """cacheblend: exponent of the position weight on deviation (0 = none); None = the engine's default."""
    boundary_tokens: int | None = Field(default=None, ge=0)
    """selective: leading tokens of every reused chunk recomputed; None = the engine's default."""
    check_layer: int | None = Field(default=None, ge=0)
    """cacheblend: the layer where KV deviation is measured; None = the engine's default."""
    qa_order: str | None = None
    """queryaware: "prompt" (documents stay where they are) or "relevance_last" (the documents the
    question needs move after the others: a rewritten prompt, which the bundled model answers better
    than the original; see docs/quality.md); None = the engine's default."""
    drift: bool | None = None
    """cacheblend: map the reused documents' K/V with the engine's drift maps before repair (fitted on the
    corpus by `engine.fit_drift()`; see docs/quality.md); False serves them as stored; None = the engine's
    default (on once fitted)."""
    drift_strength: float | None = Field(default=None, ge=0.0, le=1.0)
    """cacheblend: how far the drift maps move the reused K/V, 0 (as stored) to 1 (as fitted); None = the
    engine's default."""
    streaming: bool = False
    """Whether `invoke` streams internally (for callback handlers); results are the same."""
    engine: KVBoost | None = Field(default=None, exclude=True)
    """A pre-built engine; None = the process-wide engine for (model, dtype, doc_context), loaded on first
    use."""

    _engine: KVBoost | None = PrivateAttr(default=None)

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        return check_strategy(value)

    @field_validator("qa_order")
    @classmethod
    def _known_order(cls, value: str | None) -> str | None:
        return value if value is None else check_order(value)

    @field_validator("doc_context")
    @classmethod
    def _known_doc_context(cls, value: str | None) -> str | None:
        return value if value is None else check_doc_context(value)

    @model_validator(mode="after")
    def _settings_in_range(self) -> ChatKVBoost:
        check_llm_fields(self)  # the engine's own checks (finite numbers, seeds, stop strings)
        return self

    @model_validator(mode="after")
    def _engine_encodes_as_asked(self) -> ChatKVBoost:
        if self.engine is not None:
            check_engine_doc_context(self.engine, self.doc_context)
        return self

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        parse_dtype(value)  # raises on an unknown name
        return value

    # ---- the engine ------------------------------------------------------------------------

    @property
    def client(self) -> KVBoost:
        """The engine this model runs on (loads the model on first use)."""
        if self.engine is not None:
            return self.engine
        if self._engine is None:
            self._engine = shared_engine(self.model, self.dtype, self.doc_context)
        return self._engine

    @property
    def model_name(self) -> str:
        if self.engine is not None:
            return self.engine.model_id
        return model_key(self.model) if self.model is None else self.model

    def prewarm(self, documents: Sequence[Document | str], *, pin: bool = False,
                show_progress: bool = True) -> list[str]:
        """Precompute and store the KV of each document's `page_content`; returns the doc ids.

        Idempotent: a document already stored costs a lookup. Empty documents are skipped (their
        id is ""), since they can't appear in a prompt.
        """
        texts = [d.page_content if isinstance(d, Document) else d for d in documents]
        keep = [i for i, t in enumerate(texts) if t.strip()]
        ids = self.client.ingest([texts[i] for i in keep], pin=pin, progress=show_progress)
        out = [""] * len(texts)
        for i, doc_id in zip(keep, ids, strict=True):
            out[i] = doc_id
        return out

    # ---- LangChain plumbing ----------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "kvboost-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "dtype": self.dtype,
            "strategy": self.strategy,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "seed": self.seed,
            "recompute_ratio": self.recompute_ratio,
            "taper": self.taper,
            "recency": self.recency,
            "boundary_tokens": self.boundary_tokens,
            "check_layer": self.check_layer,
            "qa_order": self.qa_order,
            "drift": self.drift,
            "drift_strength": self.drift_strength,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kvboost",
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # ---- requests --------------------------------------------------------------------------

    def _request(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """The chat for the engine, and `KVBoost.stream` keyword arguments for this call."""
        unknown = set(kwargs) - set(_CALL_ARGS) - set(_IGNORED_ARGS)
        if unknown:
            hint = " (tool calling is not supported)" if {"tools", "tool_choice"} & unknown else ""
            raise TypeError(f"ChatKVBoost got unexpected argument(s) {', '.join(sorted(unknown))}{hint}; "
                            f"per-call arguments are {', '.join(_CALL_ARGS)}")
        get = lambda name: kwargs.get(name, getattr(self, name, None))
        strategy = self._known_strategy(get("strategy"))
        call: dict[str, Any] = {
            "strategy": strategy,
            "max_new_tokens": get("max_tokens"),
            "temperature": get("temperature"),
            "top_p": get("top_p"),
            "top_k": get("top_k"),
            "seed": get("seed"),
            "stop": stop if stop is not None else (self.stop or ()),
        }
        if "write_back" in kwargs:
            call["write_back"] = bool(kwargs["write_back"])
        # Checked before the engine is touched: a bad value loads no model and runs no prefill.
        call = check_sampling(call)
        knobs = check_repair_knobs({name: get(name) for name in REPAIR_FIELDS})
        chat = [_to_chat_message(m) for m in messages]
        repair = repair_overrides(self.client, knobs)
        if repair is not None:
            call["repair"] = repair
        return chat, call

    def _response_metadata(self, result: Generation) -> dict[str, Any]:
        return {
            "model_name": self.client.model_id,
            "finish_reason": result.finish_reason,
            "strategy": result.strategy,
            "ttft_ms": result.ttft_ms,
            "total_ms": result.total_ms,
            "reused_tokens": result.reused_tokens,
            "exact_tokens": result.exact_tokens,
            "recomputed_tokens": result.recomputed_tokens,
        }

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        chat, call = self._request(messages, stop, kwargs)
        result = self.client.generate(chat, **call)
        message = AIMessage(content=result.text, usage_metadata=_usage(result),
                            response_metadata=self._response_metadata(result))
        return ChatResult(generations=[ChatGeneration(message=message,
                                                      generation_info={"finish_reason": result.finish_reason})])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        chat, call = self._request(messages, stop, kwargs)
        for piece in self.client.stream(chat, **call):
            chunk = self._chunk(piece.text, piece.result)
            if chunk is None:
                continue
            if run_manager and piece.text:
                run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        chat, call = self._request(messages, stop, kwargs)
        engine = self.client
        async for piece in astream_pieces(engine, engine.stream(chat, **call)):
            chunk = self._chunk(piece.text, piece.result)
            if chunk is None:
                continue
            if run_manager and piece.text:
                await run_manager.on_llm_new_token(piece.text, chunk=chunk)
            yield chunk

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        # Stepped like a stream (not one long thread call), so concurrent requests interleave.
        chat, call = self._request(messages, stop, kwargs)
        engine = self.client
        result = None
        async for piece in astream_pieces(engine, engine.stream(chat, **call)):
            result = piece.result or result
        assert result is not None
        message = AIMessage(content=result.text, usage_metadata=_usage(result),
                            response_metadata=self._response_metadata(result))
        return ChatResult(generations=[ChatGeneration(message=message,
                                                      generation_info={"finish_reason": result.finish_reason})])

    def _chunk(self, text: str, result: Generation | None) -> ChatGenerationChunk | None:
        if result is None:
            # Empty deltas happen while text is held back (a possible stop string, partial UTF-8).
            return ChatGenerationChunk(message=AIMessageChunk(content=text)) if text else None
        # The last chunk carries the usage and figures, once, so aggregation doesn't double them.
        message = AIMessageChunk(content=text, usage_metadata=_usage(result),
                                 response_metadata=self._response_metadata(result), chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": result.finish_reason})


def _usage(result: Generation) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=result.prompt_tokens,
        output_tokens=result.generated_tokens,
        total_tokens=result.prompt_tokens + result.generated_tokens,
        input_token_details={"cache_read": result.reused_tokens},
    )


def _to_chat_message(message: BaseMessage) -> dict[str, str]:
    if isinstance(message, SystemMessage):
        role = "system"
    elif isinstance(message, HumanMessage):
        role = "user"
    elif isinstance(message, AIMessage):
        if message.tool_calls:
            raise ValueError("ChatKVBoost does not support tool calling: got an AIMessage with tool calls")
        role = "assistant"
    elif isinstance(message, ChatMessage):
        role = message.role
    else:
        raise ValueError(f"ChatKVBoost takes system, human, ai and chat messages, not {type(message).__name__} "
                         "(tool calling is not supported)")
    return {"role": role, "content": _text(message)}


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block["text"])
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatKVBoost takes text only; got a {kind!r} content block")
    return "".join(parts)
