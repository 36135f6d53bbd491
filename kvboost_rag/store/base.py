"""What a stored KV chunk is, and the small protocol every storage tier speaks.

An entry is addressed by its *prefix key* (exact: same model, same tokens, same everything before
it) and indexed by its *content key* (same model, same tokens, anywhere). See `keys.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVEntry:
    """The KV of one chunk, all layers.

    keys, values: [L, H_kv, S, D] in the compute dtype; keys carry RoPE for positions
    start .. start + S - 1 (re-rotate with `positions.rerotate` to use them elsewhere).
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: tuple[int, ...]
    start: int
    prefix_key: bytes
    content_key: bytes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def slice(self, offset: int, count: int) -> KVEntry:
        """The entry of tokens [offset, offset + count): views of its K/V, keys still rotated for their positions."""
        if offset == 0 and count == self.num_tokens:
            return self
        end = offset + count
        return KVEntry(self.keys[:, :, offset:end], self.values[:, :, offset:end], self.token_ids[offset:end],
                       self.start + offset, self.prefix_key, self.content_key)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class KVStore(ABC):
    """A tier of stored chunks. Implementations are thread-safe."""

    @abstractmethod
    def contains(self, prefix_key: bytes) -> bool: ...

    @abstractmethod
    def get(self, prefix_key: bytes) -> KVEntry | None:
        """The entry stored under this exact prefix key, or None."""

    @abstractmethod
    def find_content(self, content_key: bytes) -> KVEntry | None:
        """Any entry with these tokens (computed in some context), or None."""

    @abstractmethod
    def put(self, entry: KVEntry, *, pin: bool = False) -> None: ...

    @abstractmethod
    def remove(self, prefix_key: bytes) -> None: ...

    def is_pinned(self, prefix_key: bytes) -> bool:
        """Whether the entry is pinned (kept whatever the budget); tiers that do not pin say False."""
        return False

    def pin(self, prefix_key: bytes) -> bool:
        """Pin an entry already stored, as it is stored; False when this tier cannot (then put it with
        pin=True). Raises ValueError when the pin does not fit the budget."""
        return False

    def unpin(self, prefix_key: bytes) -> None:  # noqa: B027 - optional for tiers that do not pin
        """Make a pinned entry evictable again; no-op when absent or not pinned."""

    def close(self) -> None:  # noqa: B027 - optional for tiers that hold no resources
        pass
