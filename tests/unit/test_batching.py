"""Batched decoding (batching.py, adapter.decode_rows, kvcache.RowsCache) on tiny random-weight models.

(a) one batched step over sequences of different lengths gives each row the logits (and K/V) of its own decode
    step, on every family of the architecture matrix (sliding windows shorter than the prompts, Gemma 2's eager
    soft-capped attention, Gemma 3's per-layer RoPE tables, NoPE layers, partial rotary), each row attending over
    its own cache (our kernel) or over all rows' K/V padded to one length (eager attention);
(b) concurrent greedy streams give exactly the tokens each gives alone, and really were batched (also through
    serving.astream_pieces);
(c) an error in a batch's forward reaches its callers, and the batcher goes on;
(d) a caller holding the engine lock (calibration) does not deadlock against a leader.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from test_architectures import FAMILIES, WINDOW, build, engine_on

from kvboost_rag import batching
from kvboost_rag.adapter import ModelAdapter
from kvboost_rag.serving import astream_pieces

LENGTHS = (3 * WINDOW + 11, WINDOW // 2 + 7, 2 * WINDOW + 5)  # crossing the windows, one inside them
# fp32. Usually 2-4e-6; under pytest the first family's step has come out 1.2e-4 from its lone step one run in six
# (before rows in place as after: a CPU kernel path). A wrong position or window moves the logits by 0.8-5.
ATOL = 1e-3


@pytest.fixture(scope="module", params=FAMILIES, ids=str)
def family(request):
    return request.param


def prefilled(adapter: ModelAdapter, ids: torch.Tensor, room: int = 4):
    """A full prefill of `ids` [N] into a cache with `room` more positions, left NaN: a row whose padding read
    its buffer's unwritten tail would turn NaN."""
    n = ids.shape[0]
    cache = adapter.new_buffers(n + room)
    cache.all_keys.fill_(float("nan"))
    cache.all_values.fill_(float("nan"))
    with torch.inference_mode():
        adapter.run_layers(adapter.embed(ids), torch.arange(n), cache, range(adapter.num_layers), n)
    return cache


def sequences(adapter: ModelAdapter) -> list[torch.Tensor]:
    vocab = adapter.config.vocab_size
    return [(vocab // (3 + i) + torch.arange(n) * (i + 1)) % vocab for i, n in enumerate(LENGTHS)]


def batched_gap(engine, break_positions: bool = False, break_windows: bool = False) -> float:
    """The largest difference between a batched step's rows and each sequence's own decode step (logits, and the
    K/V written at the new position). The breaks, for the batched step only: every row at the shortest one's
    position, or no sliding windows."""
    adapter = engine.adapter
    seqs = sequences(adapter)
    tokens = [int(s[-1]) + 1 for s in seqs]
    positions = [s.shape[0] for s in seqs]
    alone, together = [prefilled(adapter, s) for s in seqs], [prefilled(adapter, s) for s in seqs]
    with torch.inference_mode():
        expected = torch.stack([engine.decode_step(c, t, p)
                                for c, t, p in zip(alone, tokens, positions, strict=True)])
        given = [min(positions)] * len(seqs) if break_positions else positions
        windows = adapter.windows
        if break_windows:
            adapter.windows = dict.fromkeys(windows)  # every layer attends to everything before it
        rows = torch.stack([own[0] for own in batching.decode(adapter, together, tokens, given)])
        adapter.windows = windows
    assert rows.shape == expected.shape and torch.isfinite(rows).all()
    gap = (rows - expected).abs().max().item()
    for a, b, p in zip(alone, together, positions, strict=True):
        for layer in range(adapter.num_layers):
            gap = max(gap, (a.keys[layer][:, :, p] - b.keys[layer][:, :, p]).abs().max().item(),
                      (a.values[layer][:, :, p] - b.values[layer][:, :, p]).abs().max().item())
    return gap


# ---- (a) each row is its own decode step ------------------------------------------------------------


@pytest.mark.parametrize("in_place", [True, False], ids=["rows_in_place", "padded"])
def test_a_batched_step_gives_each_row_its_own_decode_step(family, in_place, bundled_tokenizer):
    engine = engine_on(build(family.config, family.settings), bundled_tokenizer, family.model_type)
    # Our sdpa kernel on the CPU attends each row over its own cache (kvcache.RowsCache); eager attention (Gemma 2's
    # soft-capping) cannot, and keeps the padded copy whatever is asked.
    assert engine.adapter.rows_in_place == (family.model_type != "gemma2")
    engine.adapter.rows_in_place = in_place and engine.adapter.rows_in_place
    assert batched_gap(engine) < ATOL


# Gemma 2: sliding and global layers, soft-capped (eager attention, the padded copy); Gemma 3: sliding and global
# layers through our kernel, each row over its own cache.
@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_the_batched_check_can_see_wrong_positions_or_windows(model_type, bundled_tokenizer):
    family = next(f for f in FAMILIES if f.model_type == model_type)
    engine = engine_on(build(family.config, family.settings), bundled_tokenizer, family.model_type)
    assert batched_gap(engine, break_positions=True) > 100 * ATOL
    assert batched_gap(engine, break_windows=True) > 100 * ATOL
    assert batched_gap(engine) < ATOL


def test_a_lone_step_is_todays_decode_step_bit_for_bit(make_tiny_engine):
    engine = make_tiny_engine()
    ids = torch.arange(100, 180)
    alone, batched = prefilled(engine.adapter, ids), prefilled(engine.adapter, ids)
    with torch.inference_mode():
        expected = engine.decode_step(alone, 7, 80)
    assert torch.equal(engine.batcher.step(batched, 7, 80), expected)
    assert engine.batcher.counters["batches"] == 1 and engine.batcher.counters["largest"] == 1


# ---- (b) concurrent streams -------------------------------------------------------------------------

PROMPTS = [f"Write a long story about a {thing} and its travels." for thing in ("river", "fox", "lamp", "ship")]


def alone_then_together(engine, run) -> tuple[list, list]:
    alone = [run(p) for p in PROMPTS]
    together = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def one(i):
        start.wait()
        together[i] = run(PROMPTS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return alone, together


def test_concurrent_greedy_streams_give_the_tokens_each_gives_alone(make_tiny_engine):
    engine = make_tiny_engine()
    engine.batcher.window_s = 0.1  # a slow shared CPU must not split the rounds
    alone, together = alone_then_together(
        engine, lambda p: engine.generate(p, strategy="full", max_new_tokens=16).token_ids)
    assert all(len(a) > 4 for a in alone)
    assert together == alone
    assert engine.batcher.counters["largest"] > 1, engine.batcher.counters


def test_streams_served_from_asyncio_are_batched(make_tiny_engine):
    engine = make_tiny_engine()
    engine.batcher.window_s = 0.1

    async def tokens(prompt):
        stream = engine.stream(prompt, strategy="full", max_new_tokens=12)
        return [piece.token_id async for piece in astream_pieces(engine, stream) if piece.token_id is not None]

    async def all_at_once():
        return await asyncio.gather(*(tokens(p) for p in PROMPTS))

    alone = [asyncio.run(tokens(p)) for p in PROMPTS]
    before = engine.batcher.counters["largest"]
    assert asyncio.run(all_at_once()) == alone
    assert before == 1 and engine.batcher.counters["largest"] > 1, engine.batcher.counters


# ---- (c) errors -------------------------------------------------------------------------------------


def test_an_error_in_a_batch_reaches_its_callers_and_the_batcher_goes_on(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine()
    batcher = engine.batcher
    batcher.window_s = 5.0  # the leader waits for both registered streams
    ids = [torch.arange(100, 140), torch.arange(200, 260)]
    caches = [prefilled(engine.adapter, s) for s in ids]
    real, calls = batching.decode, []

    def failing_once(adapter, caches, tokens, positions, drafts=()):
        calls.append(len(caches))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(adapter, caches, tokens, positions, drafts)

    monkeypatch.setattr(batching, "decode", failing_once)
    outcomes = [[], []]
    start = threading.Barrier(2)

    def stream(i):
        with batcher.decoding():
            start.wait()
            for position in (ids[i].shape[0],) * 2:  # the failed step again
                try:
                    outcomes[i].append(batcher.step(caches[i], 5, position))
                except RuntimeError as e:
                    outcomes[i].append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert calls == [2, 2]  # both steps in one batch, twice
    assert [str(o[0]) for o in outcomes] == ["boom", "boom"]
    # Tried again, the same steps decode for both.
    assert all(isinstance(o[1], torch.Tensor) and torch.isfinite(o[1]).all() for o in outcomes)
    assert batcher.counters["batches"] == 2 and not batcher._leading and not batcher._pending


# ---- (d) the engine lock ----------------------------------------------------------------------------


def test_a_caller_holding_the_engine_lock_does_not_wait_for_a_leader(make_tiny_engine):
    engine = make_tiny_engine()
    batcher = engine.batcher
    batcher.window_s = 1.0
    caches = [prefilled(engine.adapter, torch.arange(100, 140)) for _ in range(2)]
    registered, results = threading.Barrier(2), []

    def stream(i, locked):
        with batcher.decoding():
            registered.wait()
            if not locked:
                results.append(batcher.step(caches[i], 5, 40))  # leads, waiting for the other stream
                return
            while not batcher._leading:
                time.sleep(0.001)
            with engine.lock:  # as calibration decodes, under the lock, while another thread leads
                results.append(batcher.step(caches[i], 5, 40))

    threads = [threading.Thread(target=stream, args=(i, i == 1), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "deadlock: the leader waits for the lock its follower holds"
    assert len(results) == 2 and torch.equal(results[0], results[1])


def test_the_engine_lock_knows_whether_this_thread_holds_it():
    import threading

    from kvboost_rag.batching import EngineLock

    lock, seen = EngineLock(), []
    assert not lock.held_here()
    with lock:
        with lock:  # re-entrant
            assert lock.held_here()
        assert lock.held_here()
        other = threading.Thread(target=lambda: seen.append(lock.held_here()))
        other.start()
        other.join()
    assert seen == [False] and not lock.held_here()
