"""Frozen configuration: everything that is fixed for the life of an engine.

Per-request state (the prompt, the strategy chosen for it) lives in the engine's call arguments,
never here. Anything that changes the numbers in a stored KV chunk is part of `ChunkingConfig` and
so of the model fingerprint (see `keys.model_fingerprint`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DOC_CONTEXTS = ("none", "template", "passage")
STRATEGIES = ("full", "prefix", "naive", "selective", "cacheblend", "queryaware")
# queryaware: documents in the prompt's order, or the ones the question needs moved last.
QA_ORDERS = ("prompt", "relevance_last")


def check_strategy(strategy: str) -> str:
    """The strategy name, or a ValueError listing the known ones."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    return strategy


def check_doc_context(doc_context: str) -> str:
    """The ingestion context's name (ChunkingConfig.doc_context), or a ValueError listing the known ones."""
    if doc_context not in DOC_CONTEXTS:
        raise ValueError(f"unknown doc_context {doc_context!r}; use one of {', '.join(DOC_CONTEXTS)}")
    return doc_context


def check_order(order: str) -> str:
    """The queryaware document order, or a ValueError listing the known ones."""
    if order not in QA_ORDERS:
        raise ValueError(f"unknown qa_order {order!r}; use one of {', '.join(QA_ORDERS)}")
    return order


@dataclass(frozen=True)
class ChunkingConfig:
    # A document longer than this is split at paragraph, then sentence, then word boundaries.
    max_chunk_tokens: int = 512
    # What a document is encoded after at ingestion: "none" (alone, from position 0), "template" (after
    # the opening of the model's chat template, up to a user message's content) or "passage" (after that
    # opening, a neutral paragraph and a blank line: as a later document of a prompt). With anything
    # but "none" the document's first token is not an attention sink; with "passage" its KV does not look
    # like a prompt's first document either, which every reused document otherwise claims to be.
    doc_context: str = "passage"


@dataclass(frozen=True)
class RepairConfig:
    # selective: how many leading tokens of every reused chunk are recomputed.
    boundary_tokens: int = 16
    # cacheblend: all tokens run through layers [0, check_layer]; deviation is measured there.
    check_layer: int = 1
    # cacheblend: fraction of reused tokens recomputed per layer after the check layer, averaged over
    # those layers (the repair's cost; 1.0 recomputes everything).
    recompute_ratio: float = 0.15
    # cacheblend: the set is filtered again at every layer by that layer's deviation, shrinking
    # geometrically so that the first layer after the check runs `taper` times more tokens than the
    # last (1.0: one set for all layers, the original CacheBlend).
    taper: float = 8.0
    # cacheblend: deviation is weighted by ((position + 1) / n) ** recency before ranking (0: unweighted).
    recency: float = 1.0
    # cacheblend: round each layer's set to a multiple of this many tokens (0: exact counts), so that the
    # shrinking sets repeat a few matrix shapes across layers and requests: kernels that set up per
    # shape (oneDNN's bf16 on CPU) then reuse their setup. 16: bf16 1.46x -> 2.29x at the same KL; 64
    # is as fast but too coarse for the deep layers' small sets (KL 0.28 -> 0.31 of naive's; docs/quality.md).
    # -1 (auto): 16 when the model computes in a 16-bit float type, else exact (fp32 gains nothing
    # measurable from rounding).
    size_multiple: int = -1
    # cacheblend (and relevance_last's repair): before repair, map the reused documents' K/V with the engine's
    # drift maps (affine per layer and KV head from stale to true K/V, fitted on the corpus by
    # `KVBoost.fit_drift`; see drift.py) when it has some. False: the K/V as stored.
    drift: bool = True
    # cacheblend: how far the drift maps move the K/V, from 0 (as stored) to 1 (as fitted): each map is
    # blended with the identity (drift.blend).
    drift_strength: float = 1.0
    # cacheblend: how tokens are ranked, "deviation" (the method) or "random" (the control).
    select: str = "deviation"
    # cacheblend: seed of the random control, so a bench run is repeatable.
    seed: int = 0
    # queryaware: how many calibrated retrieval heads (best first) rank the documents for the question.
    qa_heads: int = 3
    # queryaware: tuning-split items the retrieval heads are calibrated on (once per model, cached on disk;
    # a saved calibration on at least this many items is reused).
    qa_calib_items: int = 24
    # queryaware: how many documents, the question's top ones at the retrieval heads, are recomputed.
    qa_docs: int = 1
    # queryaware: what of the reused documents after the first chosen one is also recomputed:
    # "none", "all", or "attn" (the qa_after_ratio fraction of their tokens the question attends to most).
    qa_after: str = "none"
    # queryaware: with qa_after="attn", the fraction of those later documents' tokens recomputed.
    qa_after_ratio: float = 0.15
    # queryaware: logit bias subtracted from the question's attention to the reused documents not chosen
    # (0 = off): damps stale look-alikes against the recomputed document.
    qa_damp: float = 0.0
    # queryaware: "prompt" keeps the documents in place; "relevance_last" moves the chosen documents after
    # the others before recomputing them (changes the prompt: no stale distractor follows the answer).
    qa_order: str = "prompt"


@dataclass(frozen=True)
class StoreConfig:
    # Bytes the in-memory tier may hold (tensors, scales and zero points all counted); None = no limit.
    memory_budget_bytes: int | None = None
    # Persistent tier; evicted and newly computed chunks are written here when set.
    disk_dir: Path | None = None
    # 16 keeps the compute dtype; 8 and 4 quantize (keys per channel, values per token).
    kv_bits: int = 16
    # Quantization group size along the quantized axis.
    group_size: int = 64


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    repair: RepairConfig = field(default_factory=RepairConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
