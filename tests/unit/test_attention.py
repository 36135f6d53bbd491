"""attention.py's causal pieces against one dense mask: the same attention, on every layout of queries, with and
without a sliding window."""

import pytest
import torch
import torch.nn.functional as F

from kvboost_rag.attention import GROUP_ROWS, MIN_RUN, CausalRows, causal_attention, runs


def dense_attention(query, key, value, mask: CausalRows, scale):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.dense(query.dtype, query.device),
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


LAYOUTS = {
    "a suffix after a cached prefix": lambda k: torch.arange(30, k),
    "the whole prompt": lambda k: torch.arange(k),
    "scattered": lambda k: torch.sort(torch.randperm(k)[:40]).values,
    "many scattered, in groups": lambda k: torch.sort(torch.randperm(k)[:3 * GROUP_ROWS]).values,
    "runs and scattered": lambda k: torch.cat([torch.tensor([3, 9, 17]), torch.arange(40, 40 + MIN_RUN),
                                               torch.tensor([120, 121, 150]), torch.arange(k - 50, k)]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("window", [None, 40, 150])  # sliding layers: windows that cut in, shorter than a band or not
def test_causal_pieces_equal_one_dense_mask(layout, batch, window):
    torch.manual_seed(0)
    k = 1400 if layout == "many scattered, in groups" else 200 if window is None else 400
    positions = LAYOUTS[layout](k)
    query = torch.randn(batch, 6, positions.numel(), 16)
    key, value = torch.randn(batch, 2, k, 16), torch.randn(batch, 2, k, 16)
    mask = CausalRows(positions, k, window)
    got = causal_attention(query, key, value, mask, 0.3)
    want = dense_attention(query, key, value, mask, 0.3)
    assert got.shape == want.shape == (batch, positions.numel(), 6, 16)
    assert (got - want).abs().max() < 1e-5


def test_a_wrong_merge_is_caught():
    """The check above can fail: dropping the prefix's share of the softmax (the run's block alone) is far off."""
    torch.manual_seed(0)
    positions = torch.arange(30, 200)
    query, key, value = torch.randn(1, 6, 170, 16), torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16)
    own_only = dense_attention(query, key[:, :, 30:], value[:, :, 30:], CausalRows(positions - 30, 170), 0.3)
    got = causal_attention(query, key, value, CausalRows(positions, 200), 0.3)
    assert (got - own_only).abs().max() > 0.1


def test_a_window_left_out_is_caught():
    """The windowed check can fail: the bands attending to every earlier key (no window) is far off."""
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 6, 400, 16), torch.randn(1, 2, 400, 16), torch.randn(1, 2, 400, 16)
    windowed = causal_attention(query, key, value, CausalRows(torch.arange(400), 400, 40), 0.3)
    assert (windowed - dense_attention(query, key, value, CausalRows(torch.arange(400), 400), 0.3)).abs().max() > 0.1


def test_bf16_stays_within_bf16_rounding():
    torch.manual_seed(0)
    positions = torch.arange(30, 300)
    query = torch.randn(1, 6, 270, 16, dtype=torch.bfloat16)
    key, value = torch.randn(1, 2, 300, 16, dtype=torch.bfloat16), torch.randn(1, 2, 300, 16, dtype=torch.bfloat16)
    mask = CausalRows(positions, 300)
    got = causal_attention(query, key, value, mask, 0.25).float()
    want = dense_attention(query.float(), key.float(), value.float(), mask, 0.25)
    assert (got - want).abs().max() < 2e-2


def test_runs_finds_maximal_consecutive_runs():
    assert runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (3, 4), (4, 6)]
    assert runs([]) == []


def test_the_adapter_describes_cpu_masks_windows_included():
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from kvboost_rag.adapter import ModelAdapter

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    masks = ModelAdapter(LlamaForCausalLM(LlamaConfig(**sizes))).causal_mask(torch.arange(5, 20), 20, torch.float32)
    (mask,) = masks.by_kind.values()
    assert isinstance(mask, CausalRows) and torch.equal(masks.rows(torch.tensor([0, 3])).by_kind[
        next(iter(masks.by_kind))].positions, torch.tensor([5, 8]))
    sliding = ModelAdapter(MistralForCausalLM(MistralConfig(**sizes, sliding_window=8)))
    (cut,) = sliding.causal_mask(torch.arange(5, 20), 20, torch.float32).by_kind.values()
    (within,) = sliding.causal_mask(torch.arange(2, 6), 6, torch.float32).by_kind.values()
    (step,) = sliding.causal_mask(torch.tensor([19]), 20, torch.float32).by_kind.values()
    assert isinstance(cut, CausalRows) and cut.window == 8 and isinstance(within, CausalRows) and within.window is None
    # A decode step's one query keeps a dense row (a 16-bit step runs it without the flash kernel).
    assert isinstance(step, torch.Tensor) and step.shape == (1, 1, 1, 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_one_query_per_row_equals_the_kernel(dtype, masked):
    """A decode step's attention without the flash kernel: the same attention, B rows each at its own length."""
    from kvboost_rag.attention import one_query_per_row

    torch.manual_seed(0)
    query, key, value = torch.randn(3, 6, 1, 16), torch.randn(3, 2, 90, 16), torch.randn(3, 2, 90, 16)
    mask = None
    if masked:  # rows of different lengths, padded (as a batched decode step pads them)
        lengths = torch.tensor([90, 41, 7])
        mask = torch.zeros(3, 1, 1, 90).masked_fill_(torch.arange(90) >= lengths[:, None, None, None],
                                                     torch.finfo(torch.float32).min)
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True).transpose(1, 2)
    got = one_query_per_row(query.to(dtype), key.to(dtype), value.to(dtype),
                            None if mask is None else mask.to(dtype), 0.3)
    assert got.shape == want.shape == (3, 1, 6, 16) and got.dtype == dtype
    assert (got.float() - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)
    # and the test can fail: a wrong pairing of query heads with K/V heads is far off
    swapped = one_query_per_row(query.flip(1), key, value, mask, 0.3).flip(2)
    assert (swapped - want).abs().max() > 0.1
