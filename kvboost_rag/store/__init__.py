"""Where document KV lives between requests: memory (budgeted, optionally quantized), disk, and Redis
(shared by processes and machines; its client is imported only when a RedisStore is made)."""

from kvboost_rag.store.base import KVEntry, KVStore
from kvboost_rag.store.disk import DiskStore, StoreIntegrityWarning
from kvboost_rag.store.files import StoreWriteWarning
from kvboost_rag.store.folder import PruneReport, VerifyReport, prune_dir, verify_dir
from kvboost_rag.store.memory import MemoryStore, eviction_score
from kvboost_rag.store.quant import QuantizedKV, StoredEntry, dequantize_kv, quantize_kv
from kvboost_rag.store.redis import RedisStore, StoreUnavailableWarning
from kvboost_rag.store.tiered import TieredStore, make_index, make_store

__all__ = [
    "DiskStore",
    "KVEntry",
    "KVStore",
    "MemoryStore",
    "PruneReport",
    "QuantizedKV",
    "RedisStore",
    "StoreIntegrityWarning",
    "StoreUnavailableWarning",
    "StoreWriteWarning",
    "StoredEntry",
    "TieredStore",
    "VerifyReport",
    "dequantize_kv",
    "eviction_score",
    "make_index",
    "make_store",
    "prune_dir",
    "quantize_kv",
    "verify_dir",
]
