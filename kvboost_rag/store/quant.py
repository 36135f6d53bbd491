"""KIVI-style asymmetric quantization of stored KV, and the form in which every tier keeps an entry.

Keys are quantized per channel: a few channels carry outliers that are large for every token, so
each channel gets its own scale and zero point, shared by `group_size` consecutive tokens. Values
have no such channels but vary per token, so each token gets its own, shared by `group_size`
consecutive channels. Codes are uint8 (int4: two codes a byte); scales and zero points are float16.

Error: every element is within half a quantization step of its original, where the step of a group
is (max - min) / (2**bits - 1). The float16 zero point is rounded down and the scale up, so the
group's range is always covered and no code is clipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvboost_rag.store.base import KVEntry, KVStore

SUPPORTED_BITS = (16, 8, 4)
# float16 scales and zero points cannot describe values beyond this.
_FP16_MAX = 65504.0

Shape4 = tuple[int, int, int, int]


@dataclass(frozen=True, eq=False)
class QuantizedKV:
    """Quantized keys and values of one chunk.

    key_codes: uint8 [L, H_kv, D, S] (channel-major: groups run along tokens); flat when 4-bit.
    key_scales, key_zeros: float16 [L, H_kv, D, ceil(S / group_size)].
    value_codes: uint8 [L, H_kv, S, D]; flat when 4-bit.
    value_scales, value_zeros: float16 [L, H_kv, S, ceil(D / min(group_size, D))].
    """

    key_codes: torch.Tensor
    key_scales: torch.Tensor
    key_zeros: torch.Tensor
    value_codes: torch.Tensor
    value_scales: torch.Tensor
    value_zeros: torch.Tensor
    key_shape: Shape4  # [L, H_kv, S, D] of the original keys
    value_shape: Shape4
    bits: int
    group_size: int

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name: what `nbytes` counts and what the disk tier writes."""
        return {
            "key_codes": self.key_codes,
            "key_scales": self.key_scales,
            "key_zeros": self.key_zeros,
            "value_codes": self.value_codes,
            "value_scales": self.value_scales,
            "value_zeros": self.value_zeros,
        }

    @property
    def nbytes(self) -> int:
        return sum(_tensor_bytes(t) for t in self.tensors().values())

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, torch.Tensor],
        key_shape: Shape4,
        value_shape: Shape4,
        bits: int,
        group_size: int,
    ) -> QuantizedKV:
        """Rebuild from `tensors()`; raises ValueError when a tensor does not fit the shapes."""
        q = cls(
            **{name: tensors[name] for name in _TENSOR_NAMES},
            key_shape=tuple(key_shape),
            value_shape=tuple(value_shape),
            bits=bits,
            group_size=group_size,
        )
        _check_layout(q)
        return q


_TENSOR_NAMES = ("key_codes", "key_scales", "key_zeros", "value_codes", "value_scales", "value_zeros")


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def quantize_kv(keys: torch.Tensor, values: torch.Tensor, bits: int, group_size: int) -> QuantizedKV:
    """keys, values: [L, H_kv, S, D], any float dtype. bits: 8 or 4."""
    if bits not in (8, 4):
        raise ValueError(f"kv_bits must be 8 or 4 to quantize, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if keys.dim() != 4 or values.dim() != 4:
        shapes = f"{tuple(keys.shape)} and {tuple(values.shape)}"
        raise ValueError(f"keys and values must be [L, H_kv, S, D], got {shapes}")
    for name, t in (("keys", keys), ("values", values)):
        if t.numel() and t.detach().abs().amax().item() > _FP16_MAX:
            raise ValueError(f"{name} exceed the float16 range of quantization scales; use kv_bits=16")
    # keys: [L, H, S, D] -> [L, H, D, S] so that groups run along tokens, per channel.
    k_codes, k_scales, k_zeros = _quantize_groups(keys.detach().float().transpose(-1, -2), group_size, bits)
    v_group = min(group_size, values.shape[-1]) or 1
    v_codes, v_scales, v_zeros = _quantize_groups(values.detach().float(), v_group, bits)
    return QuantizedKV(
        key_codes=_pack(k_codes, bits),
        key_scales=k_scales,
        key_zeros=k_zeros,
        value_codes=_pack(v_codes, bits),
        value_scales=v_scales,
        value_zeros=v_zeros,
        key_shape=tuple(keys.shape),
        value_shape=tuple(values.shape),
        bits=bits,
        group_size=group_size,
    )


def dequantize_kv(q: QuantizedKV, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values), each [L, H_kv, S, D] in `dtype`."""
    L, H, S, D = q.key_shape
    k_codes = _unpack(q.key_codes, q.bits, (L, H, D, S))
    keys = _dequantize_groups(k_codes, q.key_scales, q.key_zeros, q.group_size)
    keys = keys.transpose(-1, -2).contiguous().to(dtype)
    v_codes = _unpack(q.value_codes, q.bits, q.value_shape)
    v_group = min(q.group_size, q.value_shape[-1]) or 1
    values = _dequantize_groups(v_codes, q.value_scales, q.value_zeros, v_group).to(dtype)
    return keys, values


def _quantize_groups(
    x: torch.Tensor, group: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., N] float32, groups of `group` along the last axis (the last one may be partial).

    Returns codes uint8 [..., N], scales and zeros float16 [..., ceil(N / group)].
    """
    n = x.shape[-1]
    n_groups = -(-n // group)
    pad = n_groups * group - n
    if pad:
        # Repeat the last element: padding must not widen the partial group's min / max.
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    grouped = x.reshape(*x.shape[:-1], n_groups, group)  # [..., G, group]
    qmax = 2**bits - 1
    zeros = _fp16_toward(grouped.amin(-1), down=True)
    scales = _fp16_toward((grouped.amax(-1) - zeros.float()) / qmax, down=False)
    safe = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
    codes = ((grouped - zeros.float().unsqueeze(-1)) / safe.unsqueeze(-1)).round_().clamp_(0, qmax)
    codes = codes.to(torch.uint8).reshape(*x.shape[:-1], n_groups * group)[..., :n]
    return codes.contiguous(), scales, zeros


def _dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """codes: uint8 [..., N]; scales, zeros: [..., ceil(N / group)]. Returns float32 [..., N]."""
    n = codes.shape[-1]
    scale = scales.float().repeat_interleave(group, dim=-1)[..., :n]
    zero = zeros.float().repeat_interleave(group, dim=-1)[..., :n]
    return codes.float() * scale + zero


def _fp16_toward(x: torch.Tensor, *, down: bool) -> torch.Tensor:
    """x (float32) as float16, rounded down or up instead of to nearest."""
    h = x.half()
    limit = torch.full_like(h, float("-inf") if down else float("inf"))
    wrong_side = h.float() > x if down else h.float() < x
    return torch.where(wrong_side, torch.nextafter(h, limit), h)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return (flat[0::2] | (flat[1::2] << 4)).contiguous()  # [ceil(numel / 2)]


def _unpack(packed: torch.Tensor, bits: int, shape: tuple[int, ...]) -> torch.Tensor:
    if bits == 8:
        return packed.reshape(shape)
    numel = 1
    for n in shape:
        numel *= n
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1)[:numel]
    return codes.reshape(shape)


def _check_layout(q: QuantizedKV) -> None:
    """Shapes and dtypes that `dequantize_kv` relies on; a mismatch means a damaged or foreign file."""
    L, H, S, D = q.key_shape
    v_group = min(q.group_size, q.value_shape[-1]) or 1
    k_params = (L, H, D, -(-S // q.group_size))
    v_params = (*q.value_shape[:3], -(-q.value_shape[-1] // v_group))

    def codes_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        numel = 1
        for n in shape:
            numel *= n
        return tuple(shape) if q.bits == 8 else ((numel + 1) // 2,)

    expected = {
        "key_codes": (codes_shape((L, H, D, S)), torch.uint8),
        "key_scales": (k_params, torch.float16),
        "key_zeros": (k_params, torch.float16),
        "value_codes": (codes_shape(q.value_shape), torch.uint8),
        "value_scales": (v_params, torch.float16),
        "value_zeros": (v_params, torch.float16),
    }
    if q.bits not in (8, 4) or q.group_size < 1:
        raise ValueError(f"bad quantization settings: bits={q.bits}, group_size={q.group_size}")
    for name, (shape, dtype) in expected.items():
        t = q.tensors()[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}")


@dataclass(frozen=True, eq=False)
class StoredEntry:
    """An entry as a tier keeps it: raw tensors (kv_bits 16) or quantized, plus what addresses it.

    Tiers hand these to each other unchanged, so an entry is quantized once and never re-quantized
    (which would compound the error) when it moves between memory and disk.
    """

    token_ids: tuple[int, ...]
    start: int
    prefix_key: bytes
    content_key: bytes
    dtype: torch.dtype  # the compute dtype `decode` returns
    raw: tuple[torch.Tensor, torch.Tensor] | None = None  # (keys, values) [L, H_kv, S, D] when kv_bits is 16
    quantized: QuantizedKV | None = None

    def __post_init__(self) -> None:
        if (self.raw is None) == (self.quantized is None):
            raise ValueError("a StoredEntry holds exactly one of raw or quantized")

    @property
    def bits(self) -> int:
        return 16 if self.quantized is None else self.quantized.bits

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return self.raw[0].shape[0] if self.raw is not None else self.quantized.key_shape[0]

    @property
    def nbytes(self) -> int:
        if self.raw is not None:
            return sum(_tensor_bytes(t) for t in self.raw)
        return self.quantized.nbytes


def encode_entry(entry: KVEntry, bits: int, group_size: int) -> StoredEntry:
    """The stored form of `entry` at `bits` (16 keeps the tensors as they are)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"kv_bits must be one of {SUPPORTED_BITS}, got {bits}")
    common = dict(
        token_ids=tuple(entry.token_ids),
        start=entry.start,
        prefix_key=entry.prefix_key,
        content_key=entry.content_key,
        dtype=entry.keys.dtype,
    )
    # Stored KV lives in host memory whatever device computed it (a GPU's memory is for the requests);
    # assembly copies a request's chunks to the device.
    keys, values = entry.keys.cpu(), entry.values.cpu()
    if bits == 16:
        return StoredEntry(**common, raw=(_own(keys), _own(values)))
    return StoredEntry(**common, quantized=quantize_kv(keys, values, bits, group_size))


def decode_entry(stored: StoredEntry) -> KVEntry:
    """The KVEntry in its compute dtype. Raw tensors are shared, not copied: treat them as read-only."""
    if stored.raw is not None:
        keys, values = stored.raw
    else:
        keys, values = dequantize_kv(stored.quantized, stored.dtype)
    return KVEntry(
        keys=keys,
        values=values,
        token_ids=stored.token_ids,
        start=stored.start,
        prefix_key=stored.prefix_key,
        content_key=stored.content_key,
    )


def _own(t: torch.Tensor) -> torch.Tensor:
    """t, copied when it is a view into a larger buffer (a slice of a whole-prompt cache), which
    would otherwise stay alive, uncounted, for as long as the entry is stored."""
    t = t.detach()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != _tensor_bytes(t):
        return t.clone(memory_format=torch.contiguous_format)
    return t


class StoredFormStore(KVStore):
    """A tier that keeps entries in their stored form (memory, disk, Redis): reads are its `get_stored` and
    `find_content_stored`, decoded here once for all of them."""

    def get_stored(self, prefix_key: bytes) -> StoredEntry | None:
        raise NotImplementedError

    def find_content_stored(self, content_key: bytes) -> StoredEntry | None:
        raise NotImplementedError

    def get(self, prefix_key: bytes) -> KVEntry | None:
        stored = self.get_stored(prefix_key)
        return None if stored is None else decode_entry(stored)

    def find_content(self, content_key: bytes) -> KVEntry | None:
        stored = self.find_content_stored(content_key)
        return None if stored is None else decode_entry(stored)
