"""MemoryStore: round trips, a byte budget that always holds, pins, eviction by score."""

from __future__ import annotations

import logging
import random
import sys
import threading
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvboost_rag.store.memory import MemoryStore, eviction_score
from kvboost_rag.store.quant import encode_entry

# A pool of entries of several sizes, shared by the property tests (made once: they are slow-ish).
POOL_SIZES = [5, 12, 37, 37, 64, 3]


@pytest.fixture(scope="module")
def store_pool(store_make_entry):
    return [store_make_entry(i, S=s, content=i % 4) for i, s in enumerate(POOL_SIZES)]


_SIZES: dict[tuple[bytes, int], int] = {}


def _stored_size(entry, bits, group=16):
    key = (entry.prefix_key, bits)
    if key not in _SIZES:
        _SIZES[key] = encode_entry(entry, bits, group).nbytes
    return _SIZES[key]


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_round_trip(store_make_entry, bits):
    store = MemoryStore(kv_bits=bits, group_size=16)
    entry = store_make_entry(1, dtype=torch.bfloat16, start=3)
    store.put(entry)
    got = store.get(entry.prefix_key)
    assert got.keys.dtype == torch.bfloat16 and got.keys.shape == entry.keys.shape
    assert (got.token_ids, got.start, got.content_key) == (entry.token_ids, 3, entry.content_key)
    tol = {16: 0.0, 8: 0.05, 4: 0.8}[bits]
    assert (got.keys.float() - entry.keys.float()).abs().max() <= tol
    assert (got.values.float() - entry.values.float()).abs().max() <= tol
    assert store.nbytes == _stored_size(entry, bits) and len(store) == 1
    assert store.get(b"\0" * 16) is None


def test_find_content_and_remove_keep_the_index_right(store_make_entry):
    store = MemoryStore()
    a, b = store_make_entry(1, content=7), store_make_entry(2, content=7)  # same tokens, two contexts
    store.put(a)
    store.put(b)
    assert store.find_content(a.content_key).prefix_key in {a.prefix_key, b.prefix_key}
    store.remove(a.prefix_key)
    assert store.find_content(a.content_key).prefix_key == b.prefix_key
    store.remove(b.prefix_key)
    store.remove(b.prefix_key)  # absent: no-op
    assert store.find_content(a.content_key) is None and not store.contains(b.prefix_key)
    assert store.nbytes == 0 and len(store) == 0


def test_budget_evicts_and_rejects_oversized_entries(store_make_entry):
    entries = [store_make_entry(i) for i in range(5)]
    size = entries[0].nbytes
    store = MemoryStore(3 * size)
    for e in entries:
        store.put(e)
        assert store.nbytes <= 3 * size
    assert len(store) == 3 and store.stats()["evictions"] == 2
    huge = store_make_entry(9, S=200)
    with pytest.warns(RuntimeWarning, match="does not fit"):
        store.put(huge)  # larger than the whole budget: not kept, no exception, nothing evicted for it
    assert not store.contains(huge.prefix_key) and len(store) == 3
    assert store.stats()["rejected"] == 1


def test_a_budget_below_one_chunk_warns_once_with_the_budget_that_would_work(store_make_entry, caplog):
    small, chunk = store_make_entry(1, S=5), store_make_entry(2, S=64)
    store = MemoryStore(small.nbytes + chunk.nbytes // 2)
    store.put(small, pin=True)
    with pytest.warns(RuntimeWarning) as caught:
        store.put(chunk)  # never fits beside the pinned entry: reused from memory never
    assert len(caught) == 1
    needed = chunk.nbytes + small.nbytes  # the chunk plus what is pinned
    assert f"set memory_budget_bytes to at least {needed:,}" in str(caught[0].message)
    assert f"{small.nbytes:,} bytes of it pinned" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next rejections are logged, not warned again
        with caplog.at_level(logging.INFO, logger="kvboost_rag.store.memory"):
            store.put(store_make_entry(3, S=64))
            store.put(chunk)
    assert store.stats()["rejected"] == 3 and caplog.text.count("not kept in memory") == 2
    store = MemoryStore(needed)
    store.put(small, pin=True)
    assert store.put_stored(encode_entry(chunk, 16, 64))  # the budget the warning named keeps it


def test_a_zero_budget_keeps_nothing_without_warning(store_make_entry):
    store = MemoryStore(0)  # on purpose: a disk tier alone
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.put(store_make_entry(1))
    assert len(store) == 0 and store.stats()["rejected"] == 1


def test_pins_are_never_evicted_and_overpinning_raises(store_make_entry):
    entries = [store_make_entry(i) for i in range(5)]
    size = entries[0].nbytes
    store = MemoryStore(3 * size)
    store.put(entries[0], pin=True)
    store.put(entries[1], pin=True)
    for e in entries[2:]:
        store.put(e)  # only one unpinned slot left: they evict each other, never the pins
    assert store.contains(entries[0].prefix_key) and store.contains(entries[1].prefix_key)
    assert len(store) == 3 and store.contains(entries[4].prefix_key)
    big = store_make_entry(9, S=60)  # ~1.6 slots
    with pytest.raises(ValueError, match="raise memory_budget_bytes or pin fewer"):
        store.put(big, pin=True)
    assert not store.contains(big.prefix_key) and store.stats()["pinned_bytes"] == 2 * size
    with pytest.raises(ValueError, match="pin"):
        store.put(store_make_entry(10, S=200), pin=True)  # bigger than the whole budget
    store.unpin(entries[0].prefix_key)
    store.put(big, pin=True)  # now fits: entries[0] and entries[4] make room
    assert store.contains(entries[1].prefix_key) and store.contains(big.prefix_key)
    assert store.stats()["pinned_entries"] == 2 and store.nbytes <= 3 * size
    store.put(entries[1], pin=True)  # already pinned: no-op


def test_pin_and_is_pinned_on_stored_entries(store_make_entry):
    a, b, c = store_make_entry(1), store_make_entry(2), store_make_entry(3)
    store = MemoryStore(2 * a.nbytes)
    store.put(a)
    store.put(b, pin=True)
    assert not store.is_pinned(a.prefix_key) and store.is_pinned(b.prefix_key)
    assert store.pin(a.prefix_key) and store.is_pinned(a.prefix_key) and store.pin(a.prefix_key)  # twice: no-op
    assert store.stats()["pinned_bytes"] == a.nbytes + b.nbytes
    assert not store.pin(c.prefix_key) and not store.is_pinned(c.prefix_key)  # absent
    with pytest.warns(RuntimeWarning, match="at least"):
        store.put(c)  # both pinned: no room
    assert store.contains(a.prefix_key) and not store.contains(c.prefix_key)
    store.unpin(a.prefix_key)
    assert not store.is_pinned(a.prefix_key) and store.stats()["pinned_bytes"] == b.nbytes


def test_eviction_score_formula():
    base = eviction_score(10, 4, hits=0, age=0, nbytes=100, half_life=8)
    assert base == pytest.approx(0.4)
    assert eviction_score(10, 4, hits=1, age=0, nbytes=100, half_life=8) == pytest.approx(2 * base)
    assert eviction_score(10, 4, hits=0, age=8, nbytes=100, half_life=8) == pytest.approx(base / 2)
    assert eviction_score(10, 4, hits=0, age=0, nbytes=200, half_life=8) == pytest.approx(base / 2)
    assert eviction_score(20, 4, hits=0, age=0, nbytes=100, half_life=8) == pytest.approx(2 * base)


def test_eviction_prefers_cold_old_entries(store_make_entry):
    a, b, c, d = (store_make_entry(i) for i in range(4))
    store = MemoryStore(3 * a.nbytes, half_life=1000)
    for e in (a, b, c):
        store.put(e)
    store.get(a.prefix_key)
    store.get(c.prefix_key)
    store.put(d)  # b: no hits -> evicted
    assert not store.contains(b.prefix_key)
    store = MemoryStore(3 * a.nbytes, half_life=2)
    for e in (a, b, c):
        store.put(e)
    for _ in range(3):
        store.get(a.prefix_key)  # a: hit most, but long ago
    for _ in range(6):
        store.get(b.prefix_key)
        store.get(c.prefix_key)
    store.put(d)  # recency dominates with a short half-life
    assert not store.contains(a.prefix_key)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_eviction_follows_the_score(store_pool, data):
    """An independent model of clock, hits and ages predicts exactly which entries go."""
    half_life = data.draw(st.sampled_from([1.0, 4.0, 64.0]))
    first = data.draw(st.lists(st.integers(0, len(store_pool) - 1), min_size=2, max_size=5, unique=True))
    sizes = {i: store_pool[i].nbytes for i in range(len(store_pool))}
    budget = sum(sizes[i] for i in first)
    store = MemoryStore(budget, half_life=half_life)
    clock, model = 0, {}  # index -> [hits, last_access]
    for i in first:
        store.put(store_pool[i])
        clock += 1
        model[i] = [0, clock]
    for i in data.draw(st.lists(st.sampled_from(first), max_size=12)):
        store.get(store_pool[i].prefix_key)
        clock += 1
        model[i][0] += 1
        model[i][1] = clock
    new = data.draw(st.sampled_from([i for i in range(len(store_pool)) if i not in first]))
    if sizes[new] > budget:
        return
    clock += 1
    order = sorted(
        model,
        key=lambda i: (
            eviction_score(
                len(store_pool[i].token_ids), 4, model[i][0], clock - model[i][1], sizes[i], half_life
            ),
            model[i][1],
        ),
    )
    used, expected_gone = budget, set()
    for i in order:
        if used + sizes[new] <= budget:
            break
        used -= sizes[i]
        expected_gone.add(i)
    store.put(store_pool[new])
    gone = {i for i in first if not store.contains(store_pool[i].prefix_key)}
    assert gone == expected_gone


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "pin", "get", "find", "remove", "unpin"]), st.integers(0, len(POOL_SIZES) - 1)
    ),
    max_size=30,
)


@pytest.mark.filterwarnings("ignore:kvboost-rag. a .*-byte KV chunk does not fit:RuntimeWarning")
@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), budget_frac=st.floats(0.0, 1.2), ops=OPS)
def test_budget_and_pins_hold_for_any_sequence(store_pool, bits, budget_frac, ops):
    sizes = [_stored_size(e, bits) for e in store_pool]
    budget = int(budget_frac * sum(sizes))
    pinned: set[int] = set()
    evicted_pins = []

    def on_evict(stored):
        if stored.prefix_key in {store_pool[j].prefix_key for j in pinned}:
            evicted_pins.append(stored.prefix_key)

    store = MemoryStore(budget, kv_bits=bits, group_size=16, on_evict=on_evict)
    for op, i in ops:
        entry = store_pool[i]
        if op in ("put", "pin"):
            pin_bytes = sum(sizes[j] for j in pinned)
            must_raise = op == "pin" and i not in pinned and pin_bytes + sizes[i] > budget
            if must_raise:
                with pytest.raises(ValueError):
                    store.put(entry, pin=True)
            else:
                was_there = store.contains(entry.prefix_key)
                store.put(entry, pin=op == "pin")
                if op == "pin":
                    pinned.add(i)
                elif not was_there and sizes[i] > budget - pin_bytes:
                    assert not store.contains(entry.prefix_key)  # could never fit: not kept
        elif op == "get":
            got = store.get(entry.prefix_key)
            assert got is None or got.token_ids == entry.token_ids
        elif op == "find":
            got = store.find_content(entry.content_key)
            assert got is None or got.content_key == entry.content_key
        elif op == "remove":
            store.remove(entry.prefix_key)
            pinned.discard(i)
        else:
            store.unpin(entry.prefix_key)
            pinned.discard(i)
        present = [j for j in range(len(store_pool)) if store.contains(store_pool[j].prefix_key)]
        assert store.nbytes <= budget
        assert store.nbytes == sum(sizes[j] for j in present) and len(store) == len(present)
        assert pinned <= set(present)
        assert store.stats()["pinned_bytes"] == sum(sizes[j] for j in pinned)
        assert not evicted_pins


@settings(max_examples=6, deadline=None)
@given(
    bits=st.sampled_from([16, 4]),
    seeds=st.lists(st.integers(0, 2**16), min_size=4, max_size=4),
)
def test_budget_holds_under_threads(store_pool, bits, seeds):
    sizes = [_stored_size(e, bits) for e in store_pool]
    budget = sizes[2] + sizes[4] + sizes[0]
    seen_over, errors = [], []
    evicted = []

    def on_evict(stored):
        store.contains(stored.prefix_key)  # runs outside the lock: calling back must not deadlock
        evicted.append(stored.prefix_key)

    store = MemoryStore(budget, kv_bits=bits, group_size=16, on_evict=on_evict)
    store.put(store_pool[5], pin=True)  # pinned by the test, never removed by the workers

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(150):
                entry = store_pool[rng.randrange(len(store_pool) - 1)]  # never touches the pinned one
                op = rng.random()
                if op < 0.5:
                    store.put(entry)
                elif op < 0.85:
                    got = store.get(entry.prefix_key)
                    assert got is None or got.token_ids == entry.token_ids
                else:
                    store.remove(entry.prefix_key)
                if store.nbytes > budget:
                    seen_over.append(store.nbytes)
        except Exception as e:  # surfaced below; an exception in a thread would vanish otherwise
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in seeds]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to make races likely
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors and not seen_over
    present = [j for j in range(len(store_pool)) if store.contains(store_pool[j].prefix_key)]
    assert store.contains(store_pool[5].prefix_key)
    assert store.nbytes == sum(sizes[j] for j in present) <= budget
    assert store.stats()["evictions"] == len(evicted)


def test_stats_counts(store_make_entry):
    store = MemoryStore(kv_bits=8, group_size=16)
    entry = store_make_entry(1)
    store.put(entry)
    store.get(entry.prefix_key)
    store.get(b"x" * 16)
    s = store.stats()
    assert (s["entries"], s["hits"], s["misses"], s["puts"], s["kv_bits"]) == (1, 1, 1, 1, 8)
    assert s["nbytes"] == store.nbytes < entry.nbytes


def test_rejects_bad_settings():
    with pytest.raises(ValueError):
        MemoryStore(-1)
    with pytest.raises(ValueError):
        MemoryStore(10, half_life=0)
