"""Our KV cache: preallocated per-layer buffers that are written at chosen positions.

transformers' DynamicCache only appends. Assembling a prompt from stored chunks, and repairing
some of its tokens in place, needs K/V written at arbitrary positions while the other positions
keep what was assembled there. The model's attention modules call `update(k, v, layer_idx, ...)`
on whatever cache they are given; this class answers that call by scattering the new K/V to
`write_positions` and handing back the buffer up to `attend_len` to attend over.

`RowsCache` answers the same call for a batched decode step (batching.py): B requests, a few new tokens each
(the token and its drafts), every request in its own KVBuffers at its own position.
"""

from __future__ import annotations

import torch

from .attention import PerRow


class KVBuffers:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", batch: int = 1):
        # One allocation per K and V, all layers; `keys[i]` is layer i's view [B, H_kv, capacity, D].
        # B is 1 for a prompt; ingestion encodes B documents side by side (one row each, same positions).
        # Uninitialized on purpose: every position is written (assembled or computed) before any
        # query can attend to it, and zero-filling costs more than the naive prefill's compute.
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.all_keys = torch.empty(shape, dtype=dtype, device=device)
        self.all_values = torch.empty(shape, dtype=dtype, device=device)
        self.keys = list(self.all_keys.unbind(0))
        self.values = list(self.all_values.unbind(0))
        self.capacity = capacity
        # Set by the driver before each forward: where the new K/V go, how far attention reaches.
        self.write_positions: torch.Tensor | None = None  # [Q] long, or None for a contiguous run
        self.write_start = 0
        self.attend_len = 0

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def span(self, start: int, end: int, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers' K/V for positions start .. end - 1 of one row: [L, H_kv, S, D] each (views, to write into)."""
        return self.all_keys[:, row, :, start:end], self.all_values[:, row, :, start:end]

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """All layers at once, every row. keys, values: [L, H_kv, S, D] placed at start .. start + S - 1."""
        end = start + keys.shape[-2]
        self.all_keys[:, :, :, start:end] = keys[:, None]
        self.all_values[:, :, :, start:end] = values[:, None]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The call transformers' attention makes. key_states, value_states: [B, H_kv, Q, D]."""
        layer_keys, layer_values = self.keys[layer_idx], self.values[layer_idx]
        if self.write_positions is None:
            q = key_states.shape[2]
            window = slice(self.write_start, self.write_start + q)
            layer_keys[:, :, window] = key_states
            layer_values[:, :, window] = value_states
        else:
            layer_keys.index_copy_(2, self.write_positions, key_states)
            layer_values.index_copy_(2, self.write_positions, value_states)
        return layer_keys[:, :, :self.attend_len], layer_values[:, :, :self.attend_len]

    def read(self, start: int, end: int, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers' K/V for positions start .. end - 1 of one row: [L, H_kv, S, D] each (copies)."""
        return tuple(t.clone() for t in self.span(start, end, row))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.all_keys, self.all_values))


class RowsCache:
    """B sequences decoding a few tokens each, every one in its own KVBuffers (batch 1) at its own position. (A lone
    sequence decodes through its own KVBuffers: batching.decode.)

    Row b's first counts[b] tokens are its own, at positions[b] onwards; the rest of its Q only pad it to the
    batch's width (a stream with fewer drafts than another's) and are written nowhere. Each layer's update writes
    row b's own new K/V into its buffers and hands back what the rows attend to. `in_place` (our sdpa kernel on the
    CPU, architectures._sdpa_gqa_masked): each row's own buffers up to its end (attention.PerRow), attended row by
    row. Otherwise (eager attention, CUDA): all rows' K/V padded to one length, K_max = the furthest row's end, for
    the attention to mask (adapter.decode_rows), a copy of every row's K/V per layer: 18 of a 4-stream step's ~137
    ms (~1.2k tokens each, SmolLM2 in float32), which the rows in place save. Separate per-request buffers keep the
    prefill path and the fidelity guard's switch to a fresh exact cache (a stream swapping its KVBuffers
    mid-answer) untouched.
    """

    def __init__(self, caches: list[KVBuffers], positions: list[int], counts: list[int] | None = None,
                 in_place: bool = False):
        self.caches, self.positions, self.in_place = caches, positions, in_place
        self.counts = counts or [1] * len(caches)
        self.attend_len = max(p + n for p, n in zip(positions, self.counts, strict=True))  # K_max
        self._padded: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, H_kv, K_max, D] each, reused by layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: [B, H_kv, Q, D] -> keys, values: [B, H_kv, K_max, D], or per row (in place)."""
        rows = list(zip(self.caches, self.positions, self.counts, strict=True))
        own = [(cache.keys[layer_idx][0], cache.values[layer_idx][0]) for cache, _, _ in rows]  # [H_kv, capacity, D]
        for row, ((_, start, n), (own_keys, own_values)) in enumerate(zip(rows, own, strict=True)):
            own_keys[:, start:start + n] = key_states[row, :, :n]
            own_values[:, start:start + n] = value_states[row, :, :n]
        if self.in_place:
            ends = [start + n for _, start, n in rows]
            return (PerRow(tuple(k[None, :, :end] for (k, _), end in zip(own, ends, strict=True))),
                    PerRow(tuple(v[None, :, :end] for (_, v), end in zip(own, ends, strict=True))))
        b, heads, _, d = key_states.shape
        # One pair of padded tensors for every layer of the forward (a layer's attention is done with them before
        # the next layer's update): fresh ones per layer cost 3-6% of a 4-stream step (their fill, page faults).
        # Zeros past each row's own end, which no layer writes: the buffers' unwritten tail may hold NaN, and a
        # masked NaN still poisons the softmax (NaN + min is NaN). The mask gives the zeros no weight.
        shape = (b, heads, self.attend_len, d)
        if self._padded is None or self._padded[0].shape != shape or self._padded[0].dtype != key_states.dtype:
            self._padded = key_states.new_zeros(shape), value_states.new_zeros(shape)
        keys, values = self._padded
        for row, ((_, start, n), (own_keys, own_values)) in enumerate(zip(rows, own, strict=True)):
            keys[row, :, :start + n] = own_keys[:, :start + n]
            values[row, :, :start + n] = own_values[:, :start + n]
        return keys, values
