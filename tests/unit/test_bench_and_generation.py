"""Bench strategy specs and KL, and the text stream's stop-string handling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvboost_rag import RepairConfig
from kvboost_rag.bench.run import kl, parse_strategies
from kvboost_rag.generation import SamplingParams, TextStream, choose_token


def test_strategy_specs_carry_repair_overrides_and_full_comes_first():
    specs = parse_strategies("naive,cacheblend:recompute_ratio=0.3+taper=1,selective", RepairConfig())
    assert [s.label for s in specs][0] == "full"
    blend = next(s for s in specs if s.strategy == "cacheblend")
    assert blend.repair.recompute_ratio == 0.3 and blend.repair.taper == 1.0
    assert blend.repair.check_layer == RepairConfig().check_layer
    with pytest.raises(ValueError, match="unknown strategy"):
        parse_strategies("fast", RepairConfig())
    with pytest.raises(ValueError, match="unknown repair setting"):
        parse_strategies("cacheblend:ratio=0.2", RepairConfig())
    off = parse_strategies("cacheblend:drift=false,cacheblend:drift=True", RepairConfig())
    assert [s.repair.drift for s in off[1:]] == [False, True]
    with pytest.raises(ValueError, match="not a boolean"):
        parse_strategies("cacheblend:drift=no", RepairConfig())


def test_kl_is_zero_on_itself_and_positive_otherwise():
    a = torch.randn(3, 50)
    assert torch.allclose(kl(a, a), torch.zeros(3), atol=1e-6)
    assert (kl(a, a.flip(-1)) > 0.01).all()


class CharTokenizer:
    """One character per token id: enough to exercise the stream's bookkeeping."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def feed(stream, text):
    return "".join(stream.add(ord(c)) for c in text if not stream.stopped) + stream.flush()


def test_text_stream_holds_back_a_possible_stop_string_and_cuts_at_it():
    stream = TextStream(CharTokenizer(), ("###",))
    assert stream.add(ord("a")) == "a"
    assert stream.add(ord("#")) == ""  # could start the stop string: held back
    assert stream.add(ord("b")) == "#b"  # it did not
    assert feed(stream, "cd##") == "cd##"  # flush at the end releases what was held
    stopped = TextStream(CharTokenizer(), ("###",))
    assert feed(stopped, "hello ### world") == "hello " and stopped.stopped


def test_sampling_params_and_token_choice():
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    logits = torch.tensor([0.0, 5.0, 1.0])
    assert choose_token(logits, SamplingParams(), None) == 1
    gen = torch.Generator().manual_seed(0)
    picks = {choose_token(logits, SamplingParams(temperature=5.0, top_k=2), gen) for _ in range(50)}
    assert picks == {1, 2}  # top_k keeps the two best, temperature spreads between them


def test_the_bench_scores_a_noise_floor_row_as_it_scores_the_strategies(make_tiny_engine, bundled_tokenizer, docs):
    import copy

    from kvboost_rag import EngineConfig, KVBoost
    from kvboost_rag.bench.data import BenchItem
    from kvboost_rag.bench.run import parse_strategies, run_bench
    from kvboost_rag.models import LoadedModel

    engine = make_tiny_engine()
    weights = copy.deepcopy(engine.adapter.model).to(torch.bfloat16)  # the same tiny model in bf16
    floor = KVBoost(LoadedModel(weights, bundled_tokenizer, "tiny-random-llama", "seed0"),
                    EngineConfig(dtype="bfloat16", calibrate=False, repair=RepairConfig(fidelity="fast")))
    items = [BenchItem(f"item{i}", tuple(docs[i:] + docs[:i]), "Who founded the brewing company?") for i in range(2)]
    report = run_bench(engine, items, parse_strategies("full,naive", engine.config.repair), max_new_tokens=4,
                       progress=False, floor=floor)
    rows = report["strategies"]
    assert list(rows) == ["full", "naive", "full (bfloat16)"]
    assert rows["full"]["first_token_kl"] == 0 and rows["full"]["agreement"] == 1
    # Another dtype, the same weights: near full, but not full itself; no reuse at all.
    assert 0 < rows["full (bfloat16)"]["first_token_kl"] < 0.05
    assert rows["full (bfloat16)"]["reuse_fraction"] == 0
    # The first token's max |dlogit| against full: none for full itself, some for bf16 and naive; the max over items
    # at least their mean.
    assert rows["full"]["first_logit_gap"] == rows["full"]["max_first_logit_gap"] == 0
    for label in ("naive", "full (bfloat16)"):
        assert 0 < rows[label]["first_logit_gap"] <= rows[label]["max_first_logit_gap"]
    assert max(item["naive"]["first_logit_gap"] for item in report["per_item"]) == rows["naive"]["max_first_logit_gap"]


def test_the_bench_refuses_items_over_the_context_window_before_ingesting_anything(make_tiny_engine, docs):
    """A set from elsewhere with a few over-long items fails at once, naming each, not mid-run after the minutes of
    ingestion and calibration that long documents take."""
    from kvboost_rag.bench.data import BenchItem
    from kvboost_rag.bench.run import check_fits, parse_strategies, render_prompt, run_bench

    engine = make_tiny_engine()
    window = engine.adapter.max_context
    long_doc = " ".join(["harbour"] * window)
    items = [BenchItem("fits", tuple(docs), "Who founded the brewing company?"),
             BenchItem("too-long", (docs[0], long_doc), "Who?"),
             BenchItem("also-too-long", (long_doc,), "Who?")]
    with pytest.raises(ValueError, match=r"2 of 3 items.*too-long \(\d+ tokens\), also-too-long.*leave them out"):
        run_bench(engine, items, parse_strategies("full,naive", engine.config.repair), max_new_tokens=4,
                  progress=False)
    assert len(engine.documents) == 0  # refused before ingestion
    # The answer's room counts: a prompt that fits alone but not with its answer is refused too.
    fits = items[0]
    n = len(engine.tokenize(engine.render(render_prompt(fits))).prompt_ids)
    check_fits(engine, [fits], window - n)
    with pytest.raises(ValueError, match="1 of 1 items"):
        check_fits(engine, [fits], window - n + 1)


def test_the_bench_scores_an_order_floor_row_on_the_documents_reversed(make_tiny_engine, docs):
    from kvboost_rag.bench.data import BenchItem
    from kvboost_rag.bench.run import ORDER_FLOOR, parse_strategies, run_bench

    engine = make_tiny_engine()
    items = [BenchItem(f"item{i}", tuple(docs[i:] + docs[:i]), "Who founded the brewing company?") for i in range(2)]
    items.append(BenchItem("alone", (docs[0],), "Who founded the brewing company?"))  # one document: no other order
    report = run_bench(engine, items, parse_strategies("full,naive", engine.config.repair), max_new_tokens=4,
                       progress=False, order_floor=True)
    rows = report["strategies"]
    assert list(rows) == ["full", "naive", ORDER_FLOOR]
    assert [ORDER_FLOOR in r for r in report["per_item"]] == [True, True, False]
    # A full prefill of other tokens (the same documents reversed): no reuse, and its first token's distribution is
    # not full's (the comparison can see another order).
    assert rows[ORDER_FLOOR]["reuse_fraction"] == 0 and rows[ORDER_FLOOR]["first_token_kl"] > 0


def test_the_bench_reports_the_guards_estimates_against_the_answers_that_differed(make_tiny_engine, docs):
    """Issue 41: per guarded strategy, the guard's summed estimates against the answers that differ from full's, named
    as the shadow checks' figures are (fidelity.Observed); and the shadow checks the bench's answers led to."""
    import json

    from kvboost_rag import EngineConfig, fidelity
    from kvboost_rag.bench.data import BenchItem
    from kvboost_rag.bench.report import table
    from kvboost_rag.bench.run import run_bench

    engine = make_tiny_engine(EngineConfig(calibrate=False, shadow_share=1.0, shadow_share_young=1.0), guarded=True)
    # A curve that trusts every token: every answer served from the repaired cache (a random model's guard would
    # send them all to a full prefill), each checked in the background.
    never = fidelity.Predictor(-30.0, 0.0, budget=engine.config.repair.budget)
    engine.predictor = dataclasses.replace(never, floors=(never, never))  # and floors that never flip, checked too
    items = [BenchItem(f"item{i}", tuple(docs[i:] + docs[:i]), "Who founded the brewing company?") for i in range(2)]
    report = run_bench(engine, items, parse_strategies("full,cacheblend", engine.config.repair), max_new_tokens=4,
                       progress=False)
    report = json.loads(json.dumps(report))  # as --json writes it
    rows, answers = report["strategies"], [r["cacheblend"] for r in report["per_item"]]
    assert rows["full"]["observed_fidelity"] is None  # unguarded: nothing predicted
    observed = rows["cacheblend"]["observed_fidelity"]
    assert set(observed) == {"answers", "predicted_differ", "observed_differ", "predicted_differ_share",
                             "observed_differ_share", "differ_ratio"}
    assert observed["answers"] == 2 and observed["observed_differ"] == sum(r["differs"] for r in answers)
    assert observed["predicted_differ"] == pytest.approx(sum(r["fidelity_estimate"] for r in answers))
    # The shares are the table's P(differs) and differs columns.
    assert observed["predicted_differ_share"] == pytest.approx(rows["cacheblend"]["fidelity_estimate"])
    assert observed["observed_differ_share"] == pytest.approx(rows["cacheblend"]["differs"])
    shadow = report["shadow_checks"]  # the warm-up's answer and the two measured ones, checked once run
    assert shadow["checks"] == shadow["answers"] == 3 and 0 < shadow["tokens"] <= 3 * 4
    assert shadow == engine.shadow.observed().figures()
    assert "Shadow checks: 3;" in table(report)
    order = next(row for row in report["floors_checked"] if row["floor"] == "order")
    assert order["samples"] == shadow["tokens"] and order["expected_before"] < 1e-6  # every token trusted
    assert f"Order floor at budget {order['budget']:g}: {order['flips']} of {order['samples']} checked" in table(report)
    assert report["ladder_trials"] == engine.shadow.figures()["trials"]  # skipped steps tried after their request
    report["ladder_trials"] = {"held": 1, "refused": 2, "dropped": 0}
    assert "Ladder trials made after their request: 1 held, 2 refused, 0 dropped" in table(report)
    engine.close()


def test_accuracy_is_paired_with_fulls_on_the_same_items_with_a_sign_test():
    """Issue 41's accuracy rule is on pairs (items lost against full minus items won), and "within noise" is a
    sign test's p on the items that changed: both in the bench's summary and its table."""
    from kvboost_rag.bench.report import table
    from kvboost_rag.bench.run import sign_test, summarize

    def row(accuracy: float) -> dict:
        return {"ttft_ms": 1.0, "speedup": 1.0, "total_ms": 1.0, "accuracy": accuracy}

    full, other = [1, 1, 1, 1, 1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1, 1, 0, 1, 0]  # lost 5, won 1
    per_item = [{"full": row(f), "cacheblend": row(o)} for f, o in zip(full, other, strict=True)]
    summary = summarize(per_item, ["full", "cacheblend"])
    assert "lost" not in summary["full"]
    assert (summary["cacheblend"]["lost"], summary["cacheblend"]["won"]) == (5, 1)
    assert summary["cacheblend"]["sign_test_p"] == pytest.approx(2 * 7 / 64)  # P(<= 1 of 6) both ways
    assert sign_test(0, 0) == 1.0 and sign_test(3, 3) == 1.0 and sign_test(8, 0) == pytest.approx(2 / 256)
    report = {"strategies": summary, "model": "m", "dtype": "float32", "kv_bits": 16, "items": 10, "seconds": 1}
    header, _, full_line, blend_line = table(report).split("\n\n")[1].split("\n")[:4]
    assert "lost / won (sign test p)" in header and "| 5 / 1 (0.22) |" in blend_line and "| - |" in full_line
