"""Research harness (issue #6, round 8): a few items' answers under any strategies, side by side.

Maps per place are fitted on every document of DATA (24 prompts, as `fit_drift` does), so they are the maps
the (since deleted) drift_places.py fitted on the same set; then for each item whose id's number is in IDS,
every strategy of STRATEGIES (the bench's syntax; `full` is added first) answers greedily, and the answer's
correctness and opening are printed.

    python research/variants_on_items.py out/tune100.jsonl out/store_tune 0433,0434,0443,0450,0456 \
      'cacheblend:recompute_ratio=0.6+taper=1.0,cacheblend:recompute_ratio=0.6+drift=false,cacheblend:recompute_ratio=1.0'
"""

import json
import sys
from pathlib import Path

import torch

from kvboost_rag import EngineConfig, KVBoost, RepairConfig, StoreConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import correct, parse_strategies, render_prompt


def main() -> None:
    data, store, ids, names = sys.argv[1], Path(sys.argv[2]), set(sys.argv[3].split(",")), sys.argv[4]
    every = load_items(data)
    engine = KVBoost.from_pretrained(config=EngineConfig(store=StoreConfig(disk_dir=store),
                                                         repair=RepairConfig(fidelity="fast")))
    engine.drift_path = None  # keep the store's own maps as they are
    engine.fit_drift([d for item in every for d in item.documents], prompts=24)
    specs = parse_strategies(names, RepairConfig(fidelity="fast"))
    for item in (item for item in every if item.id.split("-")[1] in ids):
        answers = {}
        with torch.inference_mode():
            for spec in specs:
                text = engine.generate(render_prompt(item), strategy=spec.strategy, max_new_tokens=24,
                                       write_back=False, repair=spec.repair).text
                answers[spec.label] = (int(correct(text, item.answers)), text[:50])
        print(item.id, item.answer_doc, item.answers[0], json.dumps(answers), flush=True)


if __name__ == "__main__":
    main()
