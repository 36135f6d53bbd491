"""What a framework's LLM class needs from the engine, framework-neutral: both integrations (LangChain's
ChatKVBoost, LlamaIndex's KVBoostLLM) are thin adapters over these functions, and the server reports the same
request figures (`request_figures`).

An LLM class holds the fields named in `LLMFields` (the same names in both frameworks) and a `client`
property that returns its engine, loaded on first use (`serving.shared_engine`). Everything is checked
before that engine is touched, so a bad setting fails when the object is made (`check_fields`) or when a
call is made (`stream_kwargs`), and loads no model.

The repair settings are RepairConfig's own fields, by name: an LLM's `repair` field is a RepairConfig (used
as it is) or a dict of some of its fields (laid over the engine's config at each call), and every field
can be given per call (`invoke(..., recompute_ratio=0.3)`); None anywhere means "not set".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from . import repair as repair_registry
from .config import ConfigError, EngineConfig, RepairConfig, check_doc_context, check_for_model
from .engine import Generation, KVBoost
from .generation import SamplingParams
from .models import parse_dtype, resolve_device
from .serving import model_key

REPAIR_FIELDS = tuple(f.name for f in dataclasses.fields(RepairConfig))
# SamplingParams' fields under the LLM classes' names: both frameworks call max_new_tokens max_tokens.
SAMPLING_FIELDS = tuple("max_tokens" if f.name == "max_new_tokens" else f.name
                        for f in dataclasses.fields(SamplingParams))
# What a call may override: `invoke(msgs, strategy="full", recompute_ratio=0.3)`, `complete(p, max_tokens=8)`.
CALL_ARGS = ("strategy", *SAMPLING_FIELDS, *REPAIR_FIELDS, "write_back")

# Field descriptions both classes show.
STRATEGY_HELP = (f"How the assembled prompt cache is repaired: one of {', '.join(repair_registry.names())} "
                 "(kvboost_rag.repair.names()).")
REPAIR_HELP = (f"Repair settings: a kvboost_rag.config.RepairConfig (used as it is), or a dict of some of its "
               f"fields ({', '.join(REPAIR_FIELDS)}) laid over the engine's own config; None = the engine's. "
               "Any of these fields can also be given per call.")
DEVICE_HELP = next(f.metadata["help"] for f in dataclasses.fields(EngineConfig) if f.name == "device") + (
    "; the same device as a given engine's, or left 'auto'")
DOC_CONTEXT_HELP = ("How documents are encoded at ingestion: \"passage\" (after a neutral paragraph, as a later "
                    "document of a prompt), \"template\" or \"none\" (alone); see kvboost_rag.config.ChunkingConfig. "
                    "None = the default (\"passage\"), or the given engine's own.")


class LLMFields(Protocol):
    """The fields an LLM class holds under these names, and its engine."""

    model: str | None
    dtype: str
    device: str
    doc_context: str | None
    strategy: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: Sequence[str] | None
    seed: int | None
    repair: RepairConfig | Mapping[str, Any] | None

    @property
    def client(self) -> KVBoost: ...


# ---- construction -----------------------------------------------------------------------------------


def repair_overrides(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """The RepairConfig fields in `values` given a value (None = not set), each checked against RepairConfig's
    ranges: a ConfigError naming the field, its value and its range, or naming an unknown field."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ConfigError("repair", f"repair must be a RepairConfig, a dict of its fields or None, got "
                                    f"{type(values).__name__}")
    unknown = sorted(set(values) - set(REPAIR_FIELDS), key=str)
    if unknown:
        raise ConfigError("repair", f"unknown repair setting(s) {', '.join(map(repr, unknown))}; RepairConfig's "
                                    f"fields are {', '.join(REPAIR_FIELDS)}")
    given = {name: value for name, value in values.items() if value is not None}
    if given:
        dataclasses.replace(RepairConfig(), **given)  # __post_init__ checks every field
    return given


def check_sampling(call: dict[str, Any]) -> dict[str, Any]:
    """`call` (`KVBoost.stream` keyword arguments) with its sampling values checked as SamplingParams checks
    them, and its stop strings as a tuple (a bare string is refused, not split)."""
    params = SamplingParams(**{f.name: call[f.name] for f in dataclasses.fields(SamplingParams) if f.name in call})
    return {**call, "stop": params.stop} if "stop" in call else call


def check_fields(llm: LLMFields) -> None:
    """An LLM object's settings checked as a call would check them, so that a bad one fails when the object is
    made, not at its first call: the strategy, dtype and doc_context by name, the device by name and by what the
    machine has, sampling and repair values by the ranges of SamplingParams and RepairConfig."""
    repair_registry.get_strategy(llm.strategy)
    parse_dtype(llm.dtype)
    resolve_device(llm.device)
    if llm.doc_context is not None:
        check_doc_context(llm.doc_context)
    check_sampling({"max_new_tokens": llm.max_tokens, "temperature": llm.temperature, "top_p": llm.top_p,
                    "top_k": llm.top_k, "stop": llm.stop, "seed": llm.seed})
    if not isinstance(llm.repair, RepairConfig):
        repair_overrides(llm.repair)


def check_engine(engine: KVBoost, llm: LLMFields) -> None:
    """An LLM object given a pre-built engine, checked against it: the same doc_context (documents are encoded
    once, by the engine, so the field cannot change how), the same device unless "auto", and a repair that fits
    the engine's model."""
    if llm.device != "auto" and resolve_device(llm.device) != engine.adapter.device:
        raise ValueError(f"device {llm.device!r} differs from the given engine's ({engine.adapter.device}); leave "
                         f"device 'auto' to use the engine's, or build the engine with EngineConfig(device="
                         f"{llm.device!r})")
    if llm.doc_context is not None and llm.doc_context != engine.config.chunking.doc_context:
        raise ValueError(f"doc_context {llm.doc_context!r} differs from the given engine's "
                         f"{engine.config.chunking.doc_context!r}; leave doc_context unset (None) to use the "
                         f"engine's, or build the engine with ChunkingConfig(doc_context={llm.doc_context!r})")
    resolve_repair(engine, llm.repair)


def model_name(model: str | None, engine: KVBoost | None) -> str:
    """The name an LLM object reports without loading anything: its engine's model, else what it will load."""
    if engine is not None:
        return engine.model_id
    return model_key(model) if model is None else model


# ---- calls ------------------------------------------------------------------------------------------


def resolve_repair(engine: KVBoost, repair: RepairConfig | Mapping[str, Any] | None,
                   overrides: Mapping[str, Any] | None = None) -> RepairConfig | None:
    """The RepairConfig a call runs with: `repair` (a RepairConfig, or a dict laid over the engine's config)
    with `overrides` laid over it, checked against the engine's model; None = the engine's own, unchanged."""
    given = repair_overrides(overrides)
    if isinstance(repair, RepairConfig):
        base = repair
    else:
        given = {**repair_overrides(repair), **given}
        if not given:
            return None
        base = engine.config.repair
    return check_for_model(dataclasses.replace(base, **given), engine.adapter.num_layers)


def stream_kwargs(llm: LLMFields, kwargs: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """`KVBoost.stream` keyword arguments for one call: the object's fields, with the call's keyword arguments
    (any of CALL_ARGS; a TypeError naming `owner` for others) laid over them. Everything is checked before
    the engine is touched: a bad value loads no model and runs no prefill."""
    unknown = sorted(set(kwargs) - set(CALL_ARGS))
    if unknown:
        raise TypeError(f"{owner} got unexpected argument(s) {', '.join(unknown)}; per-call arguments are "
                        f"{', '.join(CALL_ARGS)}")

    def get(name: str) -> Any:
        return kwargs.get(name, getattr(llm, name))

    call: dict[str, Any] = {"strategy": repair_registry.get_strategy(get("strategy")).name,
                            "max_new_tokens": get("max_tokens"), "temperature": get("temperature"),
                            "top_p": get("top_p"), "top_k": get("top_k"), "seed": get("seed"),
                            "stop": get("stop") or ()}
    if "write_back" in kwargs:
        call["write_back"] = bool(kwargs["write_back"])
    call = check_sampling(call)
    overrides = repair_overrides({name: kwargs[name] for name in REPAIR_FIELDS if name in kwargs})
    repair = resolve_repair(llm.client, llm.repair, overrides)  # the first use of the engine
    if repair is not None:
        call["repair"] = repair
    return call


# ---- results ----------------------------------------------------------------------------------------


def ingest(engine: KVBoost, texts: Sequence[str], *, pin: bool = False, progress: bool = True,
           layout: str | None = None) -> list[str]:
    """The doc id of each text once its KV is stored; "" for a text with nothing but whitespace (it can't
    appear in a prompt, so nothing is stored). Idempotent: a text already stored costs a lookup. `layout`: how
    the framework lays out its RAG prompts (prompts.LAYOUTS), for the calibration ingestion runs."""
    keep = [i for i, text in enumerate(texts) if text.strip()]
    ids = engine.ingest([texts[i] for i in keep], pin=pin, progress=progress, layout=layout)
    out = [""] * len(texts)
    for i, doc_id in zip(keep, ids, strict=True):
        out[i] = doc_id
    return out


def figures(engine: KVBoost, result: Generation) -> dict[str, Any]:
    """What a response reports besides its text (LangChain's response_metadata, LlamaIndex's additional_kwargs):
    the model, why it stopped, and `request_figures`."""
    return {"model_name": engine.model_id, "finish_reason": result.finish_reason, **request_figures(result)}


def request_figures(result: Generation) -> dict[str, Any]:
    """The request's own figures, the same in every interface (the server's `kvboost` object too): the strategy,
    the timings, the prompt tokens reused, of which exact, and recomputed, and the fidelity guard's figures: the
    level the answer was held to, the predicted chance it differs from a full prefill's, the recompute budget its
    cache was repaired at (1.0: it fell back to a full prefill), whether it fell back, from which token on it came
    from an exact cache; and the own tokens of the ingested documents found in the prompt, and how many of them came
    from the store."""
    return {"strategy": result.strategy, "ttft_ms": result.ttft_ms, "total_ms": result.total_ms,
            "reused_tokens": result.reused_tokens, "exact_tokens": result.exact_tokens,
            "document_tokens": result.document_tokens, "document_tokens_reused": result.document_tokens_reused,
            # which step of the guard's ladder served which tokens: [{first_token, step, budget, ...}, ...]
            "served": [dataclasses.asdict(step) for step in result.served],
            "recomputed_tokens": result.recomputed_tokens, "fidelity_estimate": result.fidelity_estimate,
            "recompute_budget": result.recompute_budget, "fell_back": result.fell_back, "exact_from": result.exact_from,
            "fidelity": result.fidelity}


def token_counts(result: Generation) -> dict[str, int]:
    """The OpenAI-style usage of a response."""
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.generated_tokens,
            "total_tokens": result.prompt_tokens + result.generated_tokens}
