"""KVBoostLLM: a LlamaIndex LLM on a local HF decoder with document KV reuse."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt
from llama_index.core.schema import BaseNode, MetadataMode

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

# Per-call keyword arguments: `llm.complete(prompt, strategy="full")`.
_CALL_ARGS = ("strategy", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", *REPAIR_FIELDS,
              "write_back")
_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}

Chat = list[dict[str, str]]


class KVBoostLLM(CustomLLM):
    """LlamaIndex LLM on a local HuggingFace decoder that reuses precomputed document KV.

    Documents (nodes) are ingested once as KV-cache chunks, by `KVBoostPrewarm` in an
    `IngestionPipeline` or by `prewarm`. At query time the prompt LlamaIndex builds is searched
    for them by exact text, wherever the retriever put them, and their stored KV is reused; the
    `strategy` repairs the seams.

    ```python
    from llama_index.llms.kvboost import KVBoostLLM

    llm = KVBoostLLM(max_tokens=64)  # the bundled SmolLM2-135M-Instruct
    query_engine = index.as_query_engine(llm=llm)
    response = query_engine.query("...")
    ```

    Figures (ttft_ms, reused_tokens, ...) are in each response's `additional_kwargs`; `raw`
    holds the whole engine result, with `raw["usage"]` for LlamaIndex's token counting.
    """

    model: str | None = Field(
        default=None,
        description="Local folder or hub id of a HuggingFace decoder; None = the bundled SmolLM2-135M-Instruct.")
    dtype: str = Field(default="float32", description="Compute dtype: float32, bfloat16 or float16.")
    doc_context: str | None = Field(
        default=None,
        description="How documents are encoded at ingestion: \"passage\" (after a neutral paragraph, as a later "
                    "document of a prompt), \"template\" or \"none\" (alone); see kvboost_rag.config."
                    "ChunkingConfig. None = the default (\"passage\"), or the given engine's own.")
    strategy: str = Field(
        default="cacheblend",
        description="How the assembled prompt cache is repaired: one of kvboost_rag.config.STRATEGIES.")
    max_tokens: int = Field(default=256, ge=1, description="Most tokens to generate.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=0, ge=0, description="Top-k cut; 0 = none.")
    stop: list[str] = Field(default_factory=list,
                            description="Generation stops before any of these strings (not part of the output).")
    seed: int | None = Field(default=None, description="Seed of the sampler when temperature > 0.")
    recompute_ratio: float | None = Field(
        default=None, ge=0.0, le=1.0,
        description="cacheblend: fraction of reused tokens recomputed per layer, averaged (the quality dial: "
                    "1.0 is a full prefill); None = the engine's default.")
    taper: float | None = Field(
        default=None, ge=1.0,
        description="cacheblend: how many times more tokens the first repaired layer runs than the last "
                    "(1.0 = one set for all layers); None = the engine's default.")
    recency: float | None = Field(
        default=None, ge=0.0,
        description="cacheblend: exponent of the position weight on deviation (0 = none); None = the engine's "
                    "default.")
    boundary_tokens: int | None = Field(
        default=None, ge=0,
        description="selective: leading tokens of each reused chunk recomputed; None = the engine's default.")
    check_layer: int | None = Field(
        default=None, ge=0,
        description="cacheblend: layer where KV deviation is measured; None = the engine's default.")
    qa_order: str | None = Field(
        default=None,
        description="queryaware: 'prompt' (documents stay where they are) or 'relevance_last' (the documents "
                    "the question needs move after the others: a rewritten prompt, which the bundled model "
                    "answers better than the original; see docs/quality.md); None = the engine's default.")
    drift: bool | None = Field(
        default=None,
        description="cacheblend: map the reused documents' K/V with the engine's drift maps before repair "
                    "(fitted on the corpus by engine.fit_drift(); see docs/quality.md); False serves them as "
                    "stored; None = the engine's default (on once fitted).")
    drift_strength: float | None = Field(
        default=None, ge=0.0, le=1.0,
        description="cacheblend: how far the drift maps move the reused K/V, 0 (as stored) to 1 (as fitted); "
                    "None = the engine's default.")
    context_window: int | None = Field(
        default=None, gt=0, description="Context window told to LlamaIndex; None = the model's own.")

    _engine: KVBoost | None = PrivateAttr(default=None)

    def __init__(self, engine: KVBoost | None = None, **kwargs: Any) -> None:
        """`engine`: a pre-built engine; None = the process-wide one for (model, dtype, doc_context), on
        first use."""
        super().__init__(**kwargs)
        if engine is not None:
            check_engine_doc_context(engine, self.doc_context)
        self._engine = engine

    @model_validator(mode="after")
    def _settings_in_range(self) -> KVBoostLLM:
        check_llm_fields(self)  # the engine's own checks (finite numbers, seeds, stop strings)
        return self

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

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        parse_dtype(value)  # raises on an unknown name
        return value

    @classmethod
    def class_name(cls) -> str:
        return "KVBoostLLM"

    @property
    def client(self) -> KVBoost:
        """The engine this LLM runs on (loads the model on first use)."""
        if self._engine is None:
            self._engine = shared_engine(self.model, self.dtype, self.doc_context)
        return self._engine

    @property
    def model_name(self) -> str:
        if self._engine is not None:
            return self._engine.model_id
        return model_key(self.model) if self.model is None else self.model

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or self.client.adapter.max_context,
            num_output=self.max_tokens,
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=self.model_name,
        )

    def prewarm(self, items: Sequence[BaseNode | str], *, pin: bool = False, show_progress: bool = True) -> list[str]:
        """Ingest nodes (their text as the LLM sees it) or strings now; returns the doc ids ("" if empty).

        For a warm restart when an IngestionPipeline with a docstore skips unchanged documents:
        `llm.prewarm(list(index.docstore.docs.values()))`.
        """
        texts = [i if isinstance(i, str) else i.get_content(metadata_mode=MetadataMode.LLM) for i in items]
        keep = [i for i, t in enumerate(texts) if t.strip()]
        ids = self.client.ingest([texts[i] for i in keep], pin=pin, progress=show_progress)
        out = [""] * len(texts)
        for i, doc_id in zip(keep, ids, strict=True):
            out[i] = doc_id
        return out

    # ---- requests --------------------------------------------------------------------------

    def _call(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(kwargs) - set(_CALL_ARGS)
        if unknown:
            raise TypeError(f"KVBoostLLM got unexpected argument(s) {', '.join(sorted(unknown))}; "
                            f"per-call arguments are {', '.join(_CALL_ARGS)}")
        get = lambda name: kwargs.get(name, getattr(self, name, None))
        call: dict[str, Any] = {
            "strategy": self._known_strategy(get("strategy")),
            "max_new_tokens": get("max_tokens"),
            "temperature": get("temperature"),
            "top_p": get("top_p"),
            "top_k": get("top_k"),
            "seed": get("seed"),
            "stop": get("stop") or (),
        }
        if "write_back" in kwargs:
            call["write_back"] = bool(kwargs["write_back"])
        # Checked before the engine is touched: a bad value loads no model and runs no prefill.
        call = check_sampling(call)
        knobs = check_repair_knobs({name: get(name) for name in REPAIR_FIELDS})
        repair = repair_overrides(self.client, knobs)
        if repair is not None:
            call["repair"] = repair
        return call

    def _completion_prompt(self, prompt: str, formatted: bool) -> str | Chat:
        if formatted:
            return prompt
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self.completion_to_prompt(prompt)
        # An instruct model: a bare prompt is one user turn in its chat template.
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> str | Chat:
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return self.messages_to_prompt(messages)
        return [_to_chat_message(m) for m in messages]

    def _figures(self, result: Generation) -> dict[str, Any]:
        return {
            "model_name": self.client.model_id,
            "strategy": result.strategy,
            "finish_reason": result.finish_reason,
            "ttft_ms": result.ttft_ms,
            "total_ms": result.total_ms,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.generated_tokens,
            "total_tokens": result.prompt_tokens + result.generated_tokens,
            "reused_tokens": result.reused_tokens,
            "exact_tokens": result.exact_tokens,
            "recomputed_tokens": result.recomputed_tokens,
        }

    def _raw(self, result: Generation) -> dict[str, Any]:
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.generated_tokens,
                 "total_tokens": result.prompt_tokens + result.generated_tokens}
        return {**dataclasses.asdict(result), "usage": usage}

    def _completion(self, result: Generation) -> CompletionResponse:
        return CompletionResponse(text=result.text, raw=self._raw(result), additional_kwargs=self._figures(result))

    def _chat_response(self, result: Generation) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text),
                            raw=self._raw(result), additional_kwargs=self._figures(result))

    def _stream(self, prompt: str | Chat, call: dict[str, Any]):
        text = ""
        for piece in self.client.stream(prompt, **call):
            text += piece.text
            if piece.result is not None:
                yield text, piece.text, piece.result
            elif piece.text:
                yield text, piece.text, None

    async def _astream(self, prompt: str | Chat, call: dict[str, Any]):
        text, engine = "", self.client
        async for piece in astream_pieces(engine, engine.stream(prompt, **call)):
            text += piece.text
            if piece.result is not None:
                yield text, piece.text, piece.result
            elif piece.text:
                yield text, piece.text, None

    async def _agenerate(self, prompt: str | Chat, call: dict[str, Any]) -> Generation:
        # Stepped like a stream (not one long thread call), so concurrent requests interleave.
        result = None
        async for _, _, last in self._astream(prompt, call):
            result = last
        assert result is not None
        return result

    # ---- completion ------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        call = self._call(kwargs)
        return self._completion(self.client.generate(self._completion_prompt(prompt, formatted), **call))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        call = self._call(kwargs)
        full_prompt = self._completion_prompt(prompt, formatted)

        def gen() -> CompletionResponseGen:
            for text, delta, result in self._stream(full_prompt, call):
                if result is None:
                    yield CompletionResponse(text=text, delta=delta)
                else:
                    yield CompletionResponse(text=text, delta=delta, raw=self._raw(result),
                                             additional_kwargs=self._figures(result))

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        call = self._call(kwargs)
        return self._completion(await self._agenerate(self._completion_prompt(prompt, formatted), call))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        call = self._call(kwargs)
        full_prompt = self._completion_prompt(prompt, formatted)

        async def gen() -> CompletionResponseAsyncGen:
            async for text, delta, result in self._astream(full_prompt, call):
                if result is None:
                    yield CompletionResponse(text=text, delta=delta)
                else:
                    yield CompletionResponse(text=text, delta=delta, raw=self._raw(result),
                                             additional_kwargs=self._figures(result))

        return gen()

    # ---- chat ------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        call = self._call(kwargs)
        return self._chat_response(self.client.generate(self._chat_prompt(messages), **call))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        call = self._call(kwargs)
        prompt = self._chat_prompt(messages)

        def gen() -> ChatResponseGen:
            for text, delta, result in self._stream(prompt, call):
                message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
                if result is None:
                    yield ChatResponse(message=message, delta=delta)
                else:
                    yield ChatResponse(message=message, delta=delta, raw=self._raw(result),
                                       additional_kwargs=self._figures(result))

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        call = self._call(kwargs)
        return self._chat_response(await self._agenerate(self._chat_prompt(messages), call))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        call = self._call(kwargs)
        prompt = self._chat_prompt(messages)

        async def gen() -> ChatResponseAsyncGen:
            async for text, delta, result in self._astream(prompt, call):
                message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
                if result is None:
                    yield ChatResponse(message=message, delta=delta)
                else:
                    yield ChatResponse(message=message, delta=delta, raw=self._raw(result),
                                       additional_kwargs=self._figures(result))

        return gen()


def _to_chat_message(message: ChatMessage) -> dict[str, str]:
    role = _ROLES.get(message.role)
    if role is None:
        raise ValueError(f"KVBoostLLM takes system, user and assistant messages, not {message.role.value!r} "
                         "(function calling is not supported)")
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise ValueError(f"KVBoostLLM takes text only; got a {type(block).__name__}")
    return {"role": role, "content": message.content or ""}
