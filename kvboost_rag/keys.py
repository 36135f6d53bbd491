"""Dual-hash chunk keys (xxh3_128).

- content key = H(model fingerprint, the chunk's token ids): the same tokens anywhere. A hit is
  approximate: the stored KV was computed in another context and at another position.
- prefix key = H(parent's prefix key, content key): the same tokens after exactly the same tokens.
  A hit is exact and is reused as it is (vLLM's automatic prefix caching, at chunk granularity).

The fingerprint is folded into every key, so two models (or dtypes, tokenizers, chunking settings)
can share one store and never hit each other's entries.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import xxhash

KEY_BYTES = 16
# Bumped whenever the way a chunk is computed or keyed changes, so no store of an older release is hit.
FORMAT_VERSION = 2


def model_fingerprint(*, model_id: str, weights_digest: str, config_digest: str, dtype: str,
                      tokenizer_digest: str, encoding: dict) -> str:
    """Everything that changes the numbers in a stored chunk, hashed to a hex string: the weights, the
    model's config, the compute dtype, the tokenizer, and how documents are encoded at ingestion."""
    blob = json.dumps(
        {"format": FORMAT_VERSION, "model": model_id, "weights": weights_digest, "config": config_digest,
         "dtype": dtype, "tokenizer": tokenizer_digest, "encoding": encoding},
        sort_keys=True,
    )
    return xxhash.xxh3_128_hexdigest(blob.encode())


def root_key(fingerprint: str) -> bytes:
    """The prefix key of the empty prompt: the parent of a prompt's first chunk."""
    return xxhash.xxh3_128_digest(b"root:" + fingerprint.encode())


def content_key(fingerprint: str, token_ids: Sequence[int]) -> bytes:
    tokens = np.asarray(token_ids, dtype=np.int64).tobytes()
    return xxhash.xxh3_128_digest(b"content:" + fingerprint.encode() + b":" + tokens)


def prefix_key(parent: bytes, content: bytes) -> bytes:
    return xxhash.xxh3_128_digest(b"prefix:" + parent + content)


def chain(fingerprint: str, chunks: Sequence[Sequence[int]]) -> list[tuple[bytes, bytes]]:
    """(prefix key, content key) for consecutive chunks of one prompt."""
    keys, parent = [], root_key(fingerprint)
    for token_ids in chunks:
        ck = content_key(fingerprint, token_ids)
        parent = prefix_key(parent, ck)
        keys.append((parent, ck))
    return keys
