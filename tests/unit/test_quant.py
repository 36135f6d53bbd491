"""KIVI-style quantization: error bounds, the right axes, byte counts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvboost_rag.store.quant import (
    QuantizedKV,
    StoredEntry,
    decode_entry,
    dequantize_kv,
    encode_entry,
    quantize_kv,
)


def _group_bounds(x: torch.Tensor, axis: int, group: int, bits: int) -> torch.Tensor:
    """Per element: half a quantization step of its group, plus the float16 rounding of the group's
    zero point and scale (both rounded outward; 2**-24 is float16's smallest step) and float32
    arithmetic."""
    qmax = 2**bits - 1
    bound = torch.empty_like(x)
    n = x.shape[axis]
    for g0 in range(0, n, group):
        part = x.narrow(axis, g0, min(group, n - g0))
        lo, hi = part.amin(axis, keepdim=True), part.amax(axis, keepdim=True)
        step = (hi - lo + lo.abs() * 2**-10) / qmax * (1 + 2**-9)
        bound.narrow(axis, g0, part.shape[axis]).copy_(
            (0.5 * step + 2**-25 + 1e-6 * (hi.abs() + lo.abs())).expand_as(part)
        )
    return bound


def _check_error_bound(keys, values, bits, group):
    q = quantize_kv(keys, values, bits, group)
    k2, v2 = dequantize_kv(q, torch.float32)
    assert k2.shape == keys.shape and v2.shape == values.shape
    k_bound = _group_bounds(keys, axis=2, group=group, bits=bits)  # groups of tokens, per channel
    v_bound = _group_bounds(values, axis=3, group=min(group, values.shape[-1]), bits=bits)  # of channels
    assert ((k2 - keys).abs() <= k_bound).all()
    assert ((v2 - values).abs() <= v_bound).all()
    return q, k2, v2


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    ("shape", "group"),
    [
        ((4, 2, 37, 16), 16),  # S not a multiple of the group: a partial last token group
        ((4, 2, 37, 16), 64),  # group wider than S and D: one token group, D used for values
        ((2, 3, 20, 20), 8),  # D not a multiple of the group: a partial last channel group
        ((1, 1, 1, 1), 4),
    ],
)
def test_round_trip_within_half_a_step(bits, shape, group):
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(*shape, generator=g) * 3 + 1, torch.randn(*shape, generator=g)
    _check_error_bound(keys, values, bits, group)


@settings(max_examples=60, deadline=None)
@given(
    L=st.integers(1, 3),
    H=st.integers(1, 2),
    S=st.integers(1, 40),
    D=st.integers(1, 24),
    group=st.sampled_from([1, 3, 8, 16, 64]),
    bits=st.sampled_from([8, 4]),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_bound_holds_for_any_shape(L, H, S, D, group, bits, scale, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, H, S, D, generator=g) * scale
    values = torch.randn(L, H, S, D, generator=g) * scale + scale
    _check_error_bound(keys, values, bits, group)


def test_constant_groups_are_exact():
    keys = torch.full((2, 2, 10, 8), 0.375)
    values = torch.full((2, 2, 10, 8), -2.5)
    k2, v2 = dequantize_kv(quantize_kv(keys, values, 4, 4), torch.float32)
    assert torch.equal(k2, keys) and torch.equal(v2, values)


@pytest.mark.parametrize("bits", [8, 4])
def test_key_outlier_channel_leaves_other_channels_alone(bits):
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(4, 2, 37, 16, generator=g), torch.randn(4, 2, 37, 16, generator=g)
    spiked = keys.clone()
    spiked[..., 5] *= 100  # one channel 100x larger, for every token (what RoPE'd keys look like)
    k_plain, _ = dequantize_kv(quantize_kv(keys, values, bits, 16), torch.float32)
    k_spiked, _ = dequantize_kv(quantize_kv(spiked, values, bits, 16), torch.float32)
    others = [c for c in range(16) if c != 5]
    # Per-channel groups: the other channels are quantized exactly as if the outlier were absent ...
    assert torch.equal(k_spiked[..., others], k_plain[..., others])
    # ... and stay within half a step of their own range, far below the outlier's step.
    step = (keys.amax() - keys.amin()) / (2**bits - 1)
    assert (k_spiked[..., others] - keys[..., others]).abs().max() <= 0.51 * step


@pytest.mark.parametrize("bits", [8, 4])
def test_value_outlier_token_leaves_other_tokens_alone(bits):
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(4, 2, 37, 16, generator=g), torch.randn(4, 2, 37, 16, generator=g)
    spiked = values.clone()
    spiked[:, :, 7, :] *= 100  # one token 100x larger in every channel
    _, v_plain = dequantize_kv(quantize_kv(keys, values, bits, 16), torch.float32)
    _, v_spiked = dequantize_kv(quantize_kv(keys, spiked, bits, 16), torch.float32)
    others = [t for t in range(37) if t != 7]
    assert torch.equal(v_spiked[:, :, others], v_plain[:, :, others])
    step = (values.amax() - values.amin()) / (2**bits - 1)
    assert (v_spiked[:, :, others] - values[:, :, others]).abs().max() <= 0.51 * step


@pytest.mark.parametrize("bits", [8, 4])
def test_nbytes_counts_codes_scales_and_zeros(bits):
    L, H, S, D, G = 4, 2, 37, 16, 16
    q = quantize_kv(torch.randn(L, H, S, D), torch.randn(L, H, S, D), bits, G)
    numel = L * H * S * D
    codes = numel if bits == 8 else math.ceil(numel / 2)
    key_params = L * H * D * math.ceil(S / G)
    value_params = L * H * S * math.ceil(D / G)
    expected = 2 * codes + 2 * 2 * (key_params + value_params)  # float16 scale + zero per group
    assert q.nbytes == expected == sum(t.numel() * t.element_size() for t in q.tensors().values())
    assert all(t.dtype == torch.float16 for n, t in q.tensors().items() if not n.endswith("codes"))


@pytest.mark.parametrize(("bits", "max_ratio"), [(8, 0.54), (4, 0.29)])
def test_bytes_ratio_against_bf16(bits, max_ratio):
    keys = torch.randn(2, 3, 256, 64, dtype=torch.bfloat16)  # [30, 3, 256, 64] but fewer layers: same ratio
    values = torch.randn(2, 3, 256, 64, dtype=torch.bfloat16)
    q = quantize_kv(keys, values, bits, 64)
    assert q.nbytes / (2 * keys.numel() * keys.element_size()) <= max_ratio


def test_int4_with_an_odd_number_of_codes():
    keys, values = torch.randn(1, 1, 3, 5), torch.randn(1, 1, 3, 5)
    q = quantize_kv(keys, values, 4, 2)
    assert q.key_codes.numel() == 8  # ceil(15 / 2)
    _check_error_bound(keys, values, 4, 2)


def test_dequantize_returns_the_requested_dtype():
    keys = torch.randn(2, 2, 9, 8, dtype=torch.bfloat16)
    q = quantize_kv(keys, keys, 8, 4)
    k2, v2 = dequantize_kv(q, torch.bfloat16)
    assert k2.dtype == v2.dtype == torch.bfloat16 and k2.is_contiguous()
    assert (k2.float() - keys.float()).abs().max() < 0.05


def test_rejects_what_it_cannot_represent():
    x = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="kv_bits"):
        quantize_kv(x, x, 2, 4)
    with pytest.raises(ValueError, match="group_size"):
        quantize_kv(x, x, 8, 0)
    with pytest.raises(ValueError, match="float16 range"):
        quantize_kv(x * 1e6, x, 8, 4)


def test_from_tensors_rejects_a_wrong_layout():
    q = quantize_kv(torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8), 4, 4)
    tensors = q.tensors()
    rebuilt = QuantizedKV.from_tensors(tensors, q.key_shape, q.value_shape, q.bits, q.group_size)
    assert torch.equal(dequantize_kv(rebuilt, torch.float32)[0], dequantize_kv(q, torch.float32)[0])
    with pytest.raises(ValueError, match="key_scales"):
        QuantizedKV.from_tensors(tensors, q.key_shape, q.value_shape, q.bits, 2)
    with pytest.raises(ValueError, match="key_codes"):
        QuantizedKV.from_tensors(tensors, q.key_shape, q.value_shape, 8, q.group_size)


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_encode_decode_entry(store_make_entry, bits):
    entry = store_make_entry(1, dtype=torch.bfloat16, start=5)
    stored = encode_entry(entry, bits, 16)
    assert isinstance(stored, StoredEntry) and stored.bits == bits and stored.num_layers == 4
    back = decode_entry(stored)
    assert back.keys.dtype == torch.bfloat16 and back.keys.shape == entry.keys.shape
    assert (back.token_ids, back.start, back.prefix_key, back.content_key) == (
        entry.token_ids,
        entry.start,
        entry.prefix_key,
        entry.content_key,
    )
    if bits == 16:
        assert stored.nbytes == entry.nbytes and torch.equal(back.values, entry.values)
    else:
        assert stored.nbytes < entry.nbytes


def test_encode_copies_views_of_a_larger_cache(store_make_entry):
    entry = store_make_entry(2)
    big = torch.randn(4, 2, 1000, 16)
    view = type(entry)(big[:, :, 10:47], big[:, :, 10:47], entry.token_ids, 0, entry.prefix_key, b"c" * 16)
    raw_keys, _ = encode_entry(view, 16, 64).raw
    # The stored tensor owns exactly its bytes: the 1000-token buffer is not kept alive uncounted.
    assert raw_keys.untyped_storage().nbytes() == raw_keys.numel() * raw_keys.element_size()
    assert torch.equal(raw_keys, big[:, :, 10:47])
