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
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from kvboost_rag import Generation, KVBoost, RepairConfig
from kvboost_rag import llm as kvboost_llm
from kvboost_rag.models import MODEL_HELP
from kvboost_rag.serving import astream_pieces, shared_engine

# Keyword arguments LangChain itself may pass down; they need nothing from us.
_IGNORED_ARGS = ("stream",)


class ChatKVBoost(BaseChatModel):
    """Chat model on a local HuggingFace decoder that reuses precomputed document KV.

    Documents are ingested once (`prewarm`), as KV-cache chunks. At query time the rendered
    prompt is searched for ingested documents by their exact text, wherever the retriever put
    them, and their stored KV is reused; the chosen `strategy` repairs the seams.

    Setup:
        ```bash
        pip install -e integrations/langchain  # from a kvboost-rag checkout
        ```

    Instantiate:
        ```python
        from langchain_kvboost import ChatKVBoost

        llm = ChatKVBoost(max_tokens=64)  # the bundled SmolLM2-135M-Instruct, on CUDA if there is one
        llm.prewarm(docs)  # LangChain Documents or strings
        ```

    Invoke:
        ```python
        msg = llm.invoke([("system", "Context:\\n\\n" + context), ("human", question)])
        msg.usage_metadata["input_token_details"]["cache_read"]  # prompt tokens reused
        msg.response_metadata["ttft_ms"]
        ```

    Repair settings: `repair` holds a `kvboost_rag.RepairConfig`, or a dict of some of its fields laid
    over the engine's own config (`ChatKVBoost(repair={"recompute_ratio": 0.3})`). Per call, `strategy`,
    the sampling fields (`max_tokens`, `temperature`, `top_p`, `top_k`, `stop`, `seed`), any RepairConfig
    field and `write_back` can be overridden: `llm.invoke(msgs, strategy="full")`,
    `llm.bind(recompute_ratio=1.0)`.

    Tool calling and structured output are not supported.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model: str | None = Field(default=None, description=MODEL_HELP)
    dtype: str = "float32"
    """Compute dtype: "float32", "bfloat16" or "float16"."""
    device: str = Field(default="auto", description=kvboost_llm.DEVICE_HELP)
    doc_context: str | None = Field(default=None, description=kvboost_llm.DOC_CONTEXT_HELP)
    strategy: str = Field(default="cacheblend", description=kvboost_llm.STRATEGY_HELP)
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
    # A dict first: pydantic would otherwise turn {"recompute_ratio": 0.3} into a whole RepairConfig.
    repair: dict[str, Any] | RepairConfig | None = Field(default=None, union_mode="left_to_right",
                                                         description=kvboost_llm.REPAIR_HELP)
    streaming: bool = False
    """Whether `invoke` streams internally (for callback handlers); results are the same."""
    engine: KVBoost | None = Field(default=None, exclude=True)
    """A pre-built engine; None = the process-wide engine for (model, dtype, doc_context, device), loaded on
    first use."""

    _engine: KVBoost | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_settings(self) -> ChatKVBoost:
        kvboost_llm.check_fields(self)  # the engine's own checks: names, ranges, stop strings, repair settings
        if self.engine is not None:
            kvboost_llm.check_engine(self.engine, self)
        return self

    # ---- the engine ------------------------------------------------------------------------

    @property
    def client(self) -> KVBoost:
        """The engine this model runs on (loads the model on first use)."""
        if self.engine is not None:
            return self.engine
        if self._engine is None:
            self._engine = shared_engine(self.model, self.dtype, self.doc_context, self.device)
        return self._engine

    @property
    def model_name(self) -> str:
        return kvboost_llm.model_name(self.model, self.engine)

    def prewarm(self, documents: Sequence[Document | str], *, pin: bool = False,
                show_progress: bool = True) -> list[str]:
        """Precompute and store the KV of each document's `page_content`; returns the doc ids.

        Idempotent: a document already stored costs a lookup. Empty documents are skipped (their
        id is ""), since they can't appear in a prompt.
        """
        texts = [d.page_content if isinstance(d, Document) else d for d in documents]
        # Calibrated on LangChain's usual RAG prompt: the guard is fitted on prompts like the ones it will watch.
        return kvboost_llm.ingest(self.client, texts, pin=pin, progress=show_progress, layout="langchain")

    # ---- LangChain plumbing ----------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "kvboost-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "dtype": self.dtype,
            "device": self.device,
            "strategy": self.strategy,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "seed": self.seed,
            "repair": self.repair,
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
        kwargs = {name: value for name, value in kwargs.items() if name not in _IGNORED_ARGS}
        if {"tools", "tool_choice"} & set(kwargs):
            raise TypeError("ChatKVBoost does not support tool calling: got tools or tool_choice")
        if stop is not None:
            kwargs["stop"] = stop
        call = kvboost_llm.stream_kwargs(self, kwargs, "ChatKVBoost")
        return [_to_chat_message(m) for m in messages], call

    def _response_metadata(self, result: Generation) -> dict[str, Any]:
        return kvboost_llm.figures(self.client, result)

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
