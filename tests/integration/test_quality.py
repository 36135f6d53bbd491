"""Quality of the repairs on the bundled model (fp32): the properties that make them work.

- The calibrated retrieval heads find the answer-bearing document among look-alikes (on prompts
  built here, not from the tuning split), wherever it sits.
- Recomputing what they point at brings the first-token distribution closer to a full prefill than
  reusing every document as stored (naive), on average over a few prompts.
- Progressive selection beats one fixed set at the same budget; drift correction moves unseen
  documents' stored K/V towards a full prefill's, alone and under repair.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
import torch

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.bench.run import kl
from kvboost_rag.calibration import head_doc_scores, naive_pass, retrieval_heads
from kvboost_rag.config import RepairConfig

pytestmark = pytest.mark.real_model

# Look-alike facts about look-alike entities: only one document holds the asked value.
TOWNS = ["Brekkvik", "Brekkholm", "Brekkstad", "Brekkvale"]
MAYORS = ["Ingrid Solberg", "Tomas Halvard", "Mira Castellane", "Edda Holloway"]


def town_doc(town: str, mayor: str) -> str:
    return (f"{town} is a small harbour town on the northern coast, known for its fish market and its old "
            f"stone bridge. The mayor of {town} is {mayor}. The town has a population of about twelve "
            f"thousand people and a railway station that reopened after a local campaign.")


def case(answer_at: int) -> tuple[list[str], str, str]:
    """Four look-alike town documents; the question asks about the one at `answer_at`."""
    docs = [town_doc(town, mayor) for town, mayor in zip(TOWNS, MAYORS, strict=True)]
    return docs, f"Who is the mayor of {TOWNS[answer_at]}?", MAYORS[answer_at]


# Calibrating on this many tuning items (or reusing a saved calibration on at least as many) keeps
# the test short on a machine that has none saved yet.
CALIB_ITEMS = 8
REPAIR = RepairConfig(qa_calib_items=CALIB_ITEMS)


@pytest.fixture(scope="module")
def heads_engine(real_loaded):
    engine = KVBoost(real_loaded, EngineConfig())
    return engine, retrieval_heads(engine, items=CALIB_ITEMS)


def test_retrieval_heads_pick_the_answer_document(heads_engine, rag_prompt):
    engine, heads = heads_engine
    assert heads.heads and all(0 <= layer < engine.adapter.num_layers for layer, _ in heads.heads)
    hits = 0
    for answer_at in range(4):
        docs, question, _ = case(answer_at)
        engine.ingest(docs)
        _, probes, spans = naive_pass(engine, rag_prompt(docs, question), range(max(heads.layers) + 1),
                                      heads.layers)
        scores = head_doc_scores(probes, heads.heads[:RepairConfig.qa_heads], spans)
        hits += int(scores.argmax()) == answer_at
    assert hits >= 3, f"retrieval heads found the answer document in {hits}/4 prompts"


def test_queryaware_first_token_closer_to_full_than_naive(heads_engine, rag_prompt):
    engine, _ = heads_engine
    naive_kl, qa_kl = [], []
    for answer_at in (0, 1, 2):
        docs, question, _ = case(answer_at)
        engine.ingest(docs)
        prompt = rag_prompt(docs, question)
        full = engine.prefill(prompt, "full", write_back=False).logits[None]
        naive = engine.prefill(prompt, "naive", write_back=False)
        qa = engine.prefill(prompt, "queryaware", write_back=False, repair=REPAIR)
        assert qa.recomputed_tokens < 0.75 * qa.prompt_tokens
        naive_kl.append(float(kl(full, naive.logits[None])[0]))
        qa_kl.append(float(kl(full, qa.logits[None])[0]))
    assert statistics.fmean(qa_kl) < statistics.fmean(naive_kl), (qa_kl, naive_kl)
    assert torch.isfinite(torch.tensor(qa_kl)).all()


def test_relevance_last_moves_the_answer_document_last_and_repairs_the_others(heads_engine, rag_prompt):
    """qa_order="relevance_last" answers a rewritten prompt: the answer document last, run through every
    layer; CacheBlend's repair of the documents before it brings it closer to a full prefill of that
    rewritten prompt (the fair reference) than recomputing the chosen document alone."""
    engine, _ = heads_engine
    docs, question, _ = case(0)
    engine.ingest(docs)
    prompt = rag_prompt(docs, question)
    kls = {}
    for ratio in (0.0, 0.3):
        repair = RepairConfig(qa_calib_items=CALIB_ITEMS, qa_order="relevance_last", recompute_ratio=ratio)
        pre = engine.prefill(prompt, "queryaware", write_back=False, repair=repair)
        text = engine.tokenizer.decode(pre.plan.token_ids)
        assert text.index(TOWNS[0]) > max(text.index(town) for town in TOWNS[1:])  # moved after the others
        truth = engine.reference_prefill(pre.plan)
        assert torch.equal(truth.plan.token_ids, pre.plan.token_ids)
        kls[ratio] = float(kl(truth.logits[None], pre.logits[None])[0])
    assert kls[0.3] < kls[0.0], kls


def test_bench_scores_a_reordered_answer_against_a_full_prefill_of_its_own_prompt(heads_engine):
    from kvboost_rag.bench.data import BenchItem
    from kvboost_rag.bench.run import parse_strategies, run_item, score

    engine, _ = heads_engine
    docs, question, answer = case(0)
    item = BenchItem("towns", tuple(docs), question, system="Answer the question using only the documents.",
                     answers=(answer,))
    engine.ingest(docs)
    specs = parse_strategies(f"naive,queryaware:qa_order=relevance_last+qa_calib_items={CALIB_ITEMS}", REPAIR)
    samples = run_item(engine, item, specs, max_new_tokens=4, rotate=0)
    score(samples, item, agree_tokens=4)
    moved = samples[specs[-1].label]
    assert samples["full"].reference is None and samples["naive"].metrics["reordered"] == 0.0
    assert moved.reference is not None and moved.metrics["reordered"] == 1.0
    assert moved.reference.prompt_tokens == moved.prompt_tokens
    # Teacher-forced on the reference's own greedy tokens, not on full's (of the original order).
    assert len(moved.distributions) == len(moved.reference.distributions) == max(len(moved.reference.token_ids), 1)


# ---- progressive CacheBlend (the default strategy) -------------------------------------------------

def distributions(engine, pre, tokens) -> torch.Tensor:
    """Next-token logits after the prompt, then after each of `tokens` teacher-forced: [T, V]."""
    return torch.cat([pre.logits[None], engine.continuation_logits(pre, tokens[:-1])])


def kl_against_full(engine, items, runs: dict) -> tuple[dict, dict]:
    """Continuation and first-token KL from a full prefill of each item's bench prompt (teacher-forced on full's
    8 greedy tokens), averaged over the items, for each run: name -> (strategy, repair)."""
    from kvboost_rag.bench.run import render_prompt
    from kvboost_rag.generation import SamplingParams

    cont, first = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0.0)
    for item in items:
        engine.ingest(list(item.documents))
        prompt = render_prompt(item)
        full = engine.prefill(prompt, "full", max_new_tokens=8, write_back=False)
        tokens = list(list(engine.stream_from(full, SamplingParams(8)))[-1].result.token_ids) or [0]
        full = distributions(engine, engine.prefill(prompt, "full", max_new_tokens=8, write_back=False), tokens)
        for name, (strategy, repair) in runs.items():
            pre = engine.prefill(prompt, strategy, max_new_tokens=8, write_back=False, repair=repair)
            per_token = kl(full, distributions(engine, pre, tokens))
            cont[name] += float(per_token.mean()) / len(items)
            first[name] += float(per_token[0]) / len(items)
    return cont, first


def test_progressive_selection_beats_one_fixed_set_at_the_same_budget(real_engine):
    """What makes the default work: at the same per-layer budget, filtering the set again at every
    layer (and weighting deviation towards later tokens) lands closer to a full prefill than
    CacheBlend's one set chosen at the check layer; and the budget is a dial down to exactness."""
    from kvboost_rag.bench.data import load_items
    from kvboost_rag.calibration import CALIB_DATA

    plain = RepairConfig(drift=False)  # selection alone; drift correction has its own test below
    runs = {"naive": ("naive", None), "one set": ("cacheblend", replace(plain, taper=1.0, recency=0.0)),
            "progressive": ("cacheblend", plain),
            "r=0.05": ("cacheblend", replace(plain, recompute_ratio=0.05)),
            "r=0.5": ("cacheblend", replace(plain, recompute_ratio=0.5))}
    # The tuning split: k = 8 look-alike documents, ~1.6k tokens.
    totals, _ = kl_against_full(real_engine, load_items(CALIB_DATA, limit=4), runs)
    assert totals["progressive"] < totals["one set"] < totals["naive"], totals
    assert totals["r=0.5"] < totals["progressive"] < totals["r=0.05"], totals


def test_drift_correction_brings_reused_documents_closer_to_a_full_prefill(real_engine):
    """What makes drift correction work: affine maps fitted on prompts of other documents of the same corpus
    move the stored K/V of documents they never saw towards a full prefill's: at naive reuse's cost, and
    under cacheblend's repair at the same budget on the first token (the continuation's gain is the bench's
    to show: on 4 items it is within noise)."""
    from kvboost_rag.bench.data import load_items
    from kvboost_rag.calibration import CALIB_DATA

    engine = real_engine
    items = load_items(CALIB_DATA)
    engine.fit_drift([d for item in items[:24] for d in item.documents], prompts=24)  # as the bench does
    runs = {"naive": RepairConfig(recompute_ratio=0.0, drift=False), "mapped": RepairConfig(recompute_ratio=0.0),
            "cacheblend": RepairConfig(drift=False), "cacheblend+drift": RepairConfig()}
    # Held out: none of their documents is in the fit.
    cont, first = kl_against_full(engine, items[24:28], {name: ("cacheblend", r) for name, r in runs.items()})
    # Measured here: continuation 0.440 -> 0.402 at naive's cost; first token 0.114 -> 0.061 under cacheblend.
    assert cont["mapped"] < cont["naive"], (cont, first)
    assert first["cacheblend+drift"] < 0.8 * first["cacheblend"], (cont, first)
