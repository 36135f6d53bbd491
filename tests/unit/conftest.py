"""Shared fixtures of the storage-layer tests (prefixed `store_`)."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvboost_rag.store.base import KVEntry


def _make_entry(
    seed: int = 0,
    *,
    L: int = 4,
    H: int = 2,
    S: int = 37,
    D: int = 16,
    dtype: torch.dtype = torch.float32,
    start: int = 0,
    content: int | None = None,
) -> KVEntry:
    """A random entry; `seed` decides the tensors and the prefix key, `content` the content key."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, H, S, D, generator=g).to(dtype)
    values = torch.randn(L, H, S, D, generator=g).to(dtype)
    token_ids = tuple(torch.randint(0, 50_000, (S,), generator=g).tolist())
    content = seed if content is None else content
    return KVEntry(
        keys=keys,
        values=values,
        token_ids=token_ids,
        start=start,
        prefix_key=xxhash.xxh3_128(f"prefix:{seed}:{start}".encode()).digest(),
        content_key=xxhash.xxh3_128(f"content:{content}".encode()).digest(),
    )


@pytest.fixture(scope="session")
def store_make_entry():
    """Factory of random KVEntry objects: store_make_entry(seed, L=, H=, S=, D=, dtype=, start=, content=)."""
    return _make_entry
