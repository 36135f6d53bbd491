"""Prompt lookup (lookahead.py): drafts from the text's n-grams, checked in one forward, the answer unchanged.

(a) the drafter proposes what followed the longest n-gram ending the text, where it occurred last;
(b) a forward over a token and its drafts gives each row the logits (and K/V) of decoding them one at a time, on
    every family of the architecture matrix;
(c) a batched step over several streams, each with its own number of drafts, gives each row its own one-token
    steps' logits and K/V and writes none of its padding, on every family;
(d) a greedy stream with drafts gives the tokens one-token decoding gives, in fewer forwards; a sampled one takes
    one token per forward; a stream batched with another checks its drafts in the shared forward;
(e) rows checked in a cache the guard has since replaced are never served.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from test_architectures import FAMILIES, build, engine_on
from test_batching import prefilled, sequences

from kvboost_rag import batching, lookahead
from kvboost_rag.cli import build_parser
from kvboost_rag.config import ConfigError, EngineConfig

ATOL = 1e-5  # fp32
ROWS_ATOL = 1e-3  # a forward over several rows against forwards over one (see its test)


def test_the_drafter_proposes_what_followed_the_longest_ngram_where_it_occurred_last():
    drafter = lookahead.Drafter([1, 2, 3, 4, 9, 2, 3, 5, 6, 7])
    for token in (8, 2, 3):
        drafter.add(token)
    assert drafter.draft(2) == [5, 6]  # "2 3" last followed by 5 (not by 4, earlier)
    drafter.add(5)
    assert drafter.draft(3) == [6, 7, 8]  # "2 3 5" beats "3 5" and "5": the same place here
    drafter.add(1)
    assert drafter.draft(2) == [2, 3]  # only "1" matches, at the start
    drafter.add(42)
    assert drafter.draft(2) == []  # never seen
    assert drafter.draft(0) == []


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_a_step_with_drafts_gives_each_row_the_logits_of_decoding_them_one_at_a_time(family, bundled_tokenizer):
    engine = engine_on(build(family.config, family.settings), bundled_tokenizer, family.model_type)
    adapter = engine.adapter
    ids = sequences(adapter)[0]  # longer than the sliding windows
    n, tokens = ids.shape[0], [5, 17, 29]
    alone, together, shifted = prefilled(adapter, ids), prefilled(adapter, ids), prefilled(adapter, ids)
    with torch.inference_mode():
        expected = torch.stack([engine.decode_step(alone, t, n + i) for i, t in enumerate(tokens)])
        (rows,) = batching.decode(adapter, [together], tokens[:1], [n], [tokens[1:]])
        (wrong,) = batching.decode(adapter, [shifted], tokens[:1], [n - 1], [tokens[1:]])  # one place early
    # A forward over 3 rows sums in other orders than 3 over one: 3e-6 apart, and 1.5e-4 in about one run of 20
    # (logits up to ~4); one place off moves them by far more.
    assert rows.shape == expected.shape and (rows - expected).abs().max().item() < ROWS_ATOL
    assert (wrong - expected).abs().max().item() > 100 * ROWS_ATOL
    for layer in range(adapter.num_layers):
        assert (alone.keys[layer][:, :, n:n + 3] - together.keys[layer][:, :, n:n + 3]).abs().max() < ROWS_ATOL
        assert (alone.values[layer][:, :, n:n + 3] - together.values[layer][:, :, n:n + 3]).abs().max() < ROWS_ATOL


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_a_batched_step_with_drafts_gives_each_stream_its_own_rows(family, bundled_tokenizer):
    engine = engine_on(build(family.config, family.settings), bundled_tokenizer, family.model_type)
    adapter = engine.adapter
    seqs = sequences(adapter)  # three lengths, across and inside the sliding windows
    steps = [[5, 17, 29], [41], [7, 8]]  # each stream's token and drafts: 2, 0 and 1 drafts, padded to 3 rows
    positions = [s.shape[0] for s in seqs]
    alone, together = [prefilled(adapter, s) for s in seqs], [prefilled(adapter, s) for s in seqs]
    with torch.inference_mode():
        expected = [torch.stack([engine.decode_step(cache, t, p + i) for i, t in enumerate(step)])
                    for cache, step, p in zip(alone, steps, positions, strict=True)]
        rows = batching.decode(adapter, together, [step[0] for step in steps], positions,
                               [step[1:] for step in steps])
    for got, want, a, b, p in zip(rows, expected, alone, together, positions, strict=True):
        assert got.shape == want.shape and (got - want).abs().max().item() < ROWS_ATOL
        n = want.shape[0]
        for layer in range(adapter.num_layers):
            assert (a.keys[layer][:, :, p:p + n] - b.keys[layer][:, :, p:p + n]).abs().max() < ROWS_ATOL
            assert (a.values[layer][:, :, p:p + n] - b.values[layer][:, :, p:p + n]).abs().max() < ROWS_ATOL
            assert b.keys[layer][:, :, p + n:].isnan().all()  # the padding was written nowhere


def _answer(engine, prompt: str, **params):
    before = engine.batcher.counters["batches"]
    result = engine.generate(prompt, strategy="full", max_new_tokens=60, **params)
    return result.token_ids, engine.batcher.counters["batches"] - before


def test_a_greedy_stream_with_drafts_gives_the_same_tokens_in_fewer_forwards(make_tiny_engine):
    # This tiny random model's answer falls into repeating one token after 20: its own n-grams to copy.
    engine = make_tiny_engine(seed=1)
    prompt = "The red fox ran over the red hill. The red fox ran over the red hill. The red fox"
    with_drafts, forwards = _answer(engine, prompt)
    engine.config = dataclasses.replace(engine.config, lookahead=0)
    without, forwards_without = _answer(engine, prompt)
    assert with_drafts == without
    assert forwards_without == len(without) - 1  # one forward per token after the prefill's
    assert forwards < forwards_without * 0.8
    assert engine.batcher.counters["drafts_used"] == len(without) - 1 - forwards  # each saved one forward


def test_sampled_answers_take_one_token_per_forward(make_tiny_engine):
    engine = make_tiny_engine(EngineConfig(lookahead=4))
    tokens, forwards = _answer(engine, "The red fox ran over the red hill. The red fox", temperature=0.8, seed=3)
    assert forwards == len(tokens) - 1


@pytest.mark.parametrize("drafting_leads", [True, False])
def test_a_step_batched_with_another_streams_checks_its_drafts_there(make_tiny_engine, drafting_leads):
    engine = make_tiny_engine()
    adapter, batcher = engine.adapter, engine.batcher
    batcher.window_s = 10.0  # the leader waits for the other stream's step, however late (it stops when it comes)
    ids = torch.arange(100, 160)
    caches = [prefilled(adapter, ids), prefilled(adapter, ids)]
    results: list = [None, None]
    entered, first_in = threading.Barrier(2), threading.Event()

    def run(i: int) -> None:
        drafting = i == 0
        with batcher.decoding():
            entered.wait()  # both registered: the leader waits for the other's step
            if drafting != drafting_leads:
                first_in.wait()
                time.sleep(0.05)  # the leader is waiting for this step by now
            else:
                first_in.set()
            results[i] = batcher.step(caches[i], 7, 60, [8, 9] if drafting else ())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert batcher.counters["batches"] == 1 and batcher.counters["largest"] == 2
    assert batcher.counters["drafted"] == 2
    vocab = adapter.config.vocab_size
    assert results[0].shape == (3, vocab)  # its token's row and its two drafts', from the shared forward
    assert results[1].shape == (vocab,)  # a step without drafts gets its row, led or not
    assert (results[0][0] - results[1]).abs().max() < ROWS_ATOL  # the same token after the same prefix
    alone = prefilled(adapter, ids)
    with torch.inference_mode():
        (expected,) = batching.decode(adapter, [alone], [7], [60], [[8, 9]])
    assert (results[0] - expected).abs().max() < ROWS_ATOL


class _Forwards:
    """A batcher's `step` that records its calls (no model: the order of calls is what is checked here)."""

    def __init__(self):
        self.calls = []

    def used_draft(self):
        pass

    def step(self, cache, token, position, drafts=()):
        self.calls.append((cache, token, position, tuple(drafts)))
        return torch.zeros(1 + len(drafts), 4) if drafts else torch.zeros(4)


def test_rows_checked_in_a_cache_the_guard_replaced_are_never_served():
    ahead, forwards = lookahead.Lookahead(torch.tensor([1, 2, 3, 1, 2, 3]), drafts=2), _Forwards()
    old, new = object(), object()
    ahead.next(forwards, old, 1, 6, room=10)  # "1" -> drafts 2, 3
    assert forwards.calls[-1][3] == (2, 3)
    ahead.next(forwards, old, 2, 7, room=10)  # the draft's row: no forward
    assert len(forwards.calls) == 1
    ahead.next(forwards, new, 3, 8, room=10)  # "3" was checked too, but in the cache left behind
    assert len(forwards.calls) == 2 and forwards.calls[-1][:3] == (new, 3, 8)
    ahead.next(forwards, new, 9, 9, room=0)  # no room: no drafts
    assert forwards.calls[-1][3] == ()


def test_a_negative_lookahead_is_refused_with_what_to_give(capsys):
    with pytest.raises(ConfigError, match="lookahead.*0 decodes one token per forward"):
        EngineConfig(lookahead=-1)
    assert build_parser().parse_args(["ask", "hi", "--docs", "a.txt", "--lookahead", "0"]).lookahead == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ask", "hi", "--docs", "a.txt", "--lookahead", "-1"])
    assert "--lookahead: must be an integer >= 0" in capsys.readouterr().err
