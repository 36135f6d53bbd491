"""Research harness (issue #6, round 4): the directions not measured before, against the shipped cacheblend.

- `mass<p>`: an adaptive budget. At every layer the set keeps the fewest reused tokens that hold a fraction p
  of the set's weighted deviation (top-p over deviation mass) instead of a fixed per-layer count: a prompt
  whose staleness is concentrated recomputes less, a diffuse one more.
- `temp<T>`: APE-style temperature on the reused spans. The stale K of the reused tokens is divided by T
  (T < 1 sharpens every query's attention over them) at every layer after the check layer; the fresh K/V
  that repair writes are left alone, and deviation is measured against the unscaled stored K.
- `pin<r>`: query-aware pinning in the prompt's order. The retrieval heads name the answer document, which
  runs every layer (like relevance_last, but not moved), and the others get cacheblend at recompute_ratio r.
- `sink<k>`: the first k tokens of every reused chunk run every layer (outside the budget), on top of cacheblend.
- `drift<r>`: cacheblend at recompute_ratio r with drift correction (kvboost_rag/drift.py, on by default since
  this round once maps are fitted): the reused K/V mapped by affine maps per layer and KV head, fitted from
  stale to true K/V. Fitted here, before the items, on 24 prompts of the tuning split's documents
  (synthetic_calib.jsonl items 0-23: the same generator as synthetic_k8, none of its documents), not saved.
- `driftsys<r>`: as `drift<r>`, the maps fitted with the documents laid out as the bench lays them out (its
  system text before them, `KVBoost.fit_drift(layout=...)`) instead of as one bare user message.
- `driftoff<r>`, `driftcoarse<r>` (measured at c1a4385, removed since): one map per bucket of the token's
  offset in its document (0, 1-3, 4-15, 16-63, 64+; or 0-15, 16+).
- `driftmore<r>`: as `drift<r>`, fitted on 48 prompts instead of 24.
- `cacheblend:<setting>=<value>+...`: the bench's strategy syntax, with the `drift` maps (e.g.
  `cacheblend:taper=4`: the schedule retuned now that the maps take out the shared drift).
- `r<x>`: cacheblend at recompute_ratio x without drift correction (the previous default; the reference curve).
  Every variant but the `drift...` ones runs without drift correction.

For items START..END of DATA: continuation KL (16 teacher-forced tokens of full's greedy output), first-token
KL, accuracy of a 32-token greedy answer, recompute fraction and TTFT. The variants patch the library's
module functions for their run only. Results: docs/quality.md.

    python scripts/research/round4_variants.py 100 130 out/r4_dev.json kvboost_rag/bench/synthetic_k8.jsonl \
        out/store_none naive,full,r0.1,r0.15,r0.2,mass0.8,mass0.9,temp1.1,temp0.95,pin0.05,pin0.1
    python scripts/research/round4_variants.py 100 130 out/r4_drift.json kvboost_rag/bench/synthetic_k8.jsonl \
        out/store_none naive,r0.15,drift0,drift0.15,temp1.05,sink4
"""

import contextlib
import sys
from dataclasses import replace
from pathlib import Path

import torch
from scoring import full_reference, score, summarize

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag import engine as engine_module
from kvboost_rag.assembly import APPROX
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import correct, parse_strategies, render_prompt
from kvboost_rag.calibration import CALIB_DATA, document_spans, template_suffix_tokens
from kvboost_rag.config import StoreConfig
from kvboost_rag.generation import SamplingParams
from kvboost_rag.repair import cacheblend
from kvboost_rag.repair.queryaware import rank_documents, top_documents

BASE = RepairConfig(drift=False)
BLEND, CHOOSE, DEVIATION = cacheblend.cacheblend_prefill, cacheblend.choose, cacheblend.kv_deviation


def by_mass(mass: float):
    """choose() that ignores the count and keeps the top-deviation tokens holding `mass` of the candidates'."""
    def choose(deviation, candidates, count, mode, seed):
        if candidates.numel() == 0:
            return candidates
        scores, order = torch.sort(deviation[candidates], descending=True)
        cumulative = scores.cumsum(0) / scores.sum().clamp_min(1e-12)
        keep = int(torch.searchsorted(cumulative, torch.tensor(mass))) + 1
        return candidates[order[:keep]]
    return choose


def with_temperature(temperature: float):
    """cacheblend_prefill over a cache whose reused keys are divided by T after the check layer."""
    def blend(adapter, cache, plan, config, pinned=None):
        reused = plan.positions(APPROX)
        for layer in range(config.check_layer + 1, adapter.num_layers):
            cache.keys[layer][:, :, reused] /= temperature
        cacheblend.kv_deviation = lambda fresh, stale: DEVIATION(fresh, (stale[0] * temperature, stale[1]))
        try:
            return BLEND(adapter, cache, plan, config, pinned)
        finally:
            cacheblend.kv_deviation = DEVIATION
    return blend


def pinning_answer_document(engine: KVBoost):
    """cacheblend_prefill with the document the retrieval heads pick run through every layer."""
    def blend(adapter, cache, plan, config, pinned=None):
        heads = list(engine._retrieval_heads(config).heads[:max(config.qa_heads, 1)])
        spans = document_spans(plan, APPROX)
        scores, _, _ = rank_documents(adapter, cache, plan, spans, heads, template_suffix_tokens(engine))
        chosen = top_documents(scores, config.qa_docs)
        pinned = torch.cat([torch.arange(*spans[i]) for i in chosen])
        return BLEND(adapter, cache, plan, config, pinned)
    return blend


def pinning_chunk_starts(count: int):
    """cacheblend_prefill with the first `count` tokens of every reused chunk (their own attention sinks when
    encoded alone) run through every layer."""
    def blend(adapter, cache, plan, config, pinned=None):
        starts = [torch.arange(c.start, min(c.start + count, c.end)) for c in plan.chunks if c.source == APPROX]
        return BLEND(adapter, cache, plan, config, torch.cat(starts) if starts else None)
    return blend


@contextlib.contextmanager
def variant(name: str, engine: KVBoost):
    """(strategy, repair config) for `name`, with its patches in place while the block runs."""
    if name in ("naive", "full"):
        yield name, None
        return
    if ":" in name:
        engine.drift = engine.maps["drift"]
        spec = next(s for s in parse_strategies(name, RepairConfig()) if s.label == name)
        yield spec.strategy, spec.repair
        return
    try:
        if name.startswith("mass"):
            cacheblend.choose = by_mass(float(name[4:]))
            yield "cacheblend", BASE
        elif name.startswith("temp"):
            engine_module.cacheblend_prefill = with_temperature(float(name[4:]))
            yield "cacheblend", BASE
        elif name.startswith("sink"):
            engine_module.cacheblend_prefill = pinning_chunk_starts(int(name[4:]))
            yield "cacheblend", BASE
        elif name.startswith("drift"):
            fitted = name.rstrip("0123456789.")
            engine.drift = engine.maps[fitted]
            yield "cacheblend", RepairConfig(recompute_ratio=float(name[len(fitted):]))
        elif name.startswith("pin"):
            engine_module.cacheblend_prefill = pinning_answer_document(engine)
            yield "cacheblend", replace(BASE, recompute_ratio=float(name[3:]))
        elif name.startswith("r"):
            yield "cacheblend", replace(BASE, recompute_ratio=float(name[1:]))
        else:
            raise ValueError(f"unknown variant {name!r}")
    finally:
        cacheblend.choose, engine_module.cacheblend_prefill = CHOOSE, BLEND


def main() -> None:
    start, end, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    data, store, names = sys.argv[4], sys.argv[5], sys.argv[6].split(",")
    engine = KVBoost.from_pretrained(config=EngineConfig(store=StoreConfig(disk_dir=Path(store))))
    engine.drift_path, engine.maps = None, {}  # keep the store's own maps, if any, on disk
    calib = load_items(CALIB_DATA)[:24]
    pool = [d for item in calib for d in item.documents]
    system = [{"role": "system", "content": calib[0].system}]
    fits = {"drift": {}, "driftmore": {"prompts": 48},
            "driftsys": {"layout": lambda docs: system + [{"role": "user", "content": "\n\n".join(docs)}]}}
    fitted_names = {name.rstrip("0123456789.") for name in names if name.startswith("drift")}
    for fitted in fitted_names | ({"drift"} if any(":" in name for name in names) else set()):
        engine.maps[fitted] = engine.fit_drift(pool, **{"prompts": 24, **fits[fitted]})
    tokens, answer_tokens = 16, 32
    rows = []
    for item in load_items(data)[start:end]:
        engine.ingest(list(item.documents), progress=False)
        prompt = render_prompt(item)
        with torch.inference_mode():
            reference, distributions = full_reference(engine, prompt, tokens, room=answer_tokens)
            row = {"id": item.id}
            for name in names:
                with variant(name, engine) as (strategy, repair):
                    pre = engine.prefill(prompt, strategy, max_new_tokens=answer_tokens, write_back=False,
                                         repair=repair)
                # Decoding and teacher forcing both write from the prompt's end on; each step sees only its past.
                text = list(engine.stream_from(pre, SamplingParams(answer_tokens)))[-1].result.text
                row[name] = {**score(reference, distributions, pre), "acc": correct(text, item.answers)}
        rows.append(row)
        print(item.id, {name: (round(row[name]["cont"], 3), int(row[name]["acc"])) for name in names}, flush=True)
    summarize(rows, names, ("first", "cont", "rec", "ms", "acc"), out)


if __name__ == "__main__":
    main()
