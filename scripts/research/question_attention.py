"""Research harness (issue #6, round 6): where the question's attention goes, full prefill against reuse.

For each item of DATA (the items with the answer document first, say), each strategy's cache is built as
served, then the prompt's tail is run over it once more with every layer probed: the share of the
question's attention (its tokens less the chat template's closing; mean over heads and those tokens) that
lands on the answer document, on the other documents, and on the documents' first tokens, per group of
layers. STORE holds the documents and the drift maps. Results: docs/quality.md.

    python scripts/research/question_attention.py out/t300_first.jsonl out/store_t300_first \
        [full,naive,cacheblend,cacheblend:drift=false]   # the bench's strategy syntax; these three by default
"""

import statistics
import sys
from pathlib import Path

import torch

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import StrategySpec, parse_strategies, render_prompt
from kvboost_rag.calibration import document_spans, question_rows, template_suffix_tokens
from kvboost_rag.config import RepairConfig, StoreConfig

GROUPS = ((0, 10), (10, 20), (20, 30))


@torch.inference_mode()
def shares(engine: KVBoost, item, spec: StrategySpec, suffix_tokens: int) -> dict[str, list[float]]:
    pre = engine.prefill(render_prompt(item), spec.strategy, write_back=False, repair=spec.repair)
    plan, adapter = pre.plan, engine.adapter
    spans = document_spans(plan)
    # full: its cache holds everything, so the question alone is rerun (the same K/V it wrote)
    run = plan.computed_positions() if spec.strategy != "full" else torch.arange(spans[-1][1], plan.num_tokens)
    rows = question_rows(plan, run, suffix_tokens)  # the question, without the template's closing
    layers = range(adapter.num_layers)
    _, probes = adapter.run_layers_probed(adapter.embed(plan.token_ids[run]), run, pre.cache, layers,
                                          plan.num_tokens, set(layers), rows)
    answer = item.answer_doc
    out = {"answer": [], "others": [], "first tokens": []}
    for layer in layers:
        attention = probes[layer].mean(dim=(0, 1))  # [S]
        per_doc = [float(attention[s:e].sum()) for s, e in spans]
        out["answer"].append(per_doc[answer])
        out["others"].append(sum(per_doc) - per_doc[answer])
        out["first tokens"].append(float(sum(attention[s] for s, _ in spans)))
    return out


def main() -> None:
    data, store = sys.argv[1], sys.argv[2]
    specs = parse_strategies(sys.argv[3] if len(sys.argv) > 3 else "full,naive,cacheblend", RepairConfig())
    engine = KVBoost.from_pretrained(config=EngineConfig(dtype="float32", store=StoreConfig(disk_dir=Path(store))))
    items = load_items(data)
    engine.ingest([d for item in items for d in item.documents], progress=False)
    suffix = template_suffix_tokens(engine)
    results = {spec.label: [shares(engine, item, spec, suffix) for item in items] for spec in specs}
    print(f"{len(items)} items; share of the question's attention, mean over heads, question tokens, items")
    print("| strategy | on | " + " | ".join(f"layers {a}-{b - 1}" for a, b in GROUPS) + " |")
    print("|---|---|" + "---|" * len(GROUPS))
    for strategy, per_item in results.items():
        for key in ("answer", "others", "first tokens"):
            cells = [statistics.fmean(statistics.fmean(r[key][a:b]) for r in per_item) for a, b in GROUPS]
            print(f"| {strategy} | {key} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
