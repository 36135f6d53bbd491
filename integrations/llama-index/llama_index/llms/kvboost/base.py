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
from llama_index.core.bridge.pydantic import Field, PrivateAttr, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt
from llama_index.core.schema import BaseNode, MetadataMode

from kvboost_rag import Generation, KVBoost, RepairConfig
from kvboost_rag import llm as kvboost_llm
from kvboost_rag.models import MODEL_HELP
from kvboost_rag.serving import astream_pieces, shared_engine

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

    model: str | None = Field(default=None, description=MODEL_HELP)
    dtype: str = Field(default="float32", description="Compute dtype: float32, bfloat16 or float16.")
    device: str = Field(default="auto", description=kvboost_llm.DEVICE_HELP)
    doc_context: str | None = Field(default=None, description=kvboost_llm.DOC_CONTEXT_HELP)
    strategy: str = Field(default="cacheblend", description=kvboost_llm.STRATEGY_HELP)
    max_tokens: int = Field(default=256, ge=1, description="Most tokens to generate.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=0, ge=0, description="Top-k cut; 0 = none.")
    stop: list[str] = Field(default_factory=list,
                            description="Generation stops before any of these strings (not part of the output).")
    seed: int | None = Field(default=None, description="Seed of the sampler when temperature > 0.")
    # A dict first: pydantic would otherwise turn {"recompute_ratio": 0.3} into a whole RepairConfig.
    repair: dict[str, Any] | RepairConfig | None = Field(default=None, union_mode="left_to_right",
                                                         description=kvboost_llm.REPAIR_HELP)
    context_window: int | None = Field(
        default=None, gt=0, description="Context window told to LlamaIndex; None = the model's own.")

    _engine: KVBoost | None = PrivateAttr(default=None)

    def __init__(self, engine: KVBoost | None = None, **kwargs: Any) -> None:
        """`engine`: a pre-built engine; None = the process-wide one for (model, dtype, doc_context, device),
        on first use."""
        super().__init__(**kwargs)
        if engine is not None:
            kvboost_llm.check_engine(engine, self)
        self._engine = engine

    @model_validator(mode="after")
    def _check_settings(self) -> KVBoostLLM:
        kvboost_llm.check_fields(self)  # the engine's own checks: names, ranges, stop strings, repair settings
        return self

    @classmethod
    def class_name(cls) -> str:
        return "KVBoostLLM"

    @property
    def client(self) -> KVBoost:
        """The engine this LLM runs on (loads the model on first use)."""
        if self._engine is None:
            self._engine = shared_engine(self.model, self.dtype, self.doc_context, self.device)
        return self._engine

    @property
    def model_name(self) -> str:
        return kvboost_llm.model_name(self.model, self._engine)

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
        # Calibrated on LlamaIndex's default text_qa_template: the guard is fitted on prompts like the ones it watches.
        return kvboost_llm.ingest(self.client, texts, pin=pin, progress=show_progress, layout="llamaindex")

    # ---- requests --------------------------------------------------------------------------

    def _call(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kvboost_llm.stream_kwargs(self, kwargs, "KVBoostLLM")

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
        return {**kvboost_llm.figures(self.client, result), **kvboost_llm.token_counts(result)}

    def _raw(self, result: Generation) -> dict[str, Any]:
        return {**dataclasses.asdict(result), "usage": kvboost_llm.token_counts(result)}

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
