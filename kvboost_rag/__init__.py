"""kvboost-rag: RAG that answers sooner, with document KV computed once and reused in any order."""

from .config import ChunkingConfig, EngineConfig, RepairConfig, StoreConfig
from .engine import Generation, KVBoost, Prefill, StreamPiece

__all__ = ["KVBoost", "Generation", "Prefill", "StreamPiece", "EngineConfig", "ChunkingConfig", "RepairConfig",
           "StoreConfig"]
__version__ = "0.1.0"
