"""Does the deviation the repair measures see documents that interact? A statistic declared before it was run.

The guard's estimate reads margins only, and on `interacting_docs.py`'s prompts it did not follow the truth
(first-token KL 3-7x higher when document two means nothing without document one). What could see it is the
deviation cacheblend measures anyway: at every repaired layer, each reused token in the set has fresh K/V
(projected from its in-prompt input) and cached ones. Declared before running, the statistic is

    D = mean over repaired layers of  sum_t w_t |fresh_t - cached_t|^2 / sum_t w_t |cached_t|^2

over the reused tokens t in that layer's set, w_t the repair's own recency weight (`BlendResult.deviations`,
averaged); its check-layer term alone is reported beside it. The question is whether D is higher for the
interacting prompt of a pair than for its independent twin (same facts, self-contained documents, same question):
on `interacting_docs.py`'s four pairs (seen before, never with this statistic) and on four new pairs of other kinds,
written with this script before it ran (a pronoun, a table's header, a report's definitions, a list's order). Per
prompt: D, its check-layer term, the repaired cache's first-token KL from a full prefill (the truth), fp32, the
bundled model, the 32 documents ingested (and calibrated on) as shipped, balanced's budget, unguarded.

    .venv/bin/python research/interaction_deviation.py      # ~2 min
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kvboost_rag import KVBoost, RepairConfig
from kvboost_rag.assembly import assemble
from kvboost_rag.repair.cacheblend import cacheblend_prefill

sys.path.insert(0, str(Path(__file__).parent))
from interacting_docs import KINDS, messages, pair  # noqa: E402

# (interacting documents, independent twins, question): four new kinds, written before the run.
FRESH = [
    (("The survey team was led by Marta Ilves, a geologist from the town of Tarn.",
      "She later founded the mining institute at Corvale in 1961 and directed it for twenty-two years."),
     ("The survey team was led by Marta Ilves, a geologist from the town of Tarn.",
      "Marta Ilves later founded the mining institute at Corvale in 1961 and directed it for twenty-two years."),
     "In which year was the mining institute at Corvale founded, and by whom?"),
    (("Table 4 of the census. Each row below gives, in this order: the city, its population, its founding year.",
      "Aldmere, 41200, 1702. Brisk, 9800, 1855. Covel, 15350, 1790. Durrow, 6120, 1911. Esk, 27400, 1688."),
     ("Table 4 of the census. Aldmere has 41200 people and was founded in 1702. Brisk has 9800 people and was "
      "founded in 1855.",
      "Covel has 15350 people and was founded in 1790. Durrow has 6120 people and was founded in 1911. Esk has "
      "27400 people and was founded in 1688."),
     "What is the population of Covel?"),
    (("In this report, the northern plant means the Hollin factory and the southern plant means the Vesk "
      "factory.",
      "Last year the northern plant produced 5,400 turbines and the southern plant produced 3,100 turbines."),
     ("This report covers two factories, the Hollin factory and the Vesk factory.",
      "Last year the Hollin factory produced 5,400 turbines and the Vesk factory produced 3,100 turbines."),
     "How many turbines did the Vesk factory produce last year?"),
    (("The members of the harbour committee, in order of seniority: Oswin Garr, Lena Pratt, Ivo Sand, "
      "Mabel Crane, Tobiah Wren.",
      "Their home villages, in the same order: Fennick, Holloway, Marsh End, Quarry Hill, Saltcote."),
     ("Oswin Garr lives in Fennick. Lena Pratt lives in Holloway. Ivo Sand lives in Marsh End.",
      "Mabel Crane lives in Quarry Hill. Tobiah Wren lives in Saltcote."),
     "Which village is Ivo Sand from?"),
]


@torch.inference_mode()
def measure(engine: KVBoost, documents, question: str) -> tuple[float, float, float]:
    prompt = messages(documents, question)
    truth = F.log_softmax(engine.prefill(prompt, "full", write_back=False).logits.float(), -1)
    p = engine.plan(prompt, "cacheblend")
    cache = assemble(p, engine.adapter, p.num_tokens, drift=engine.drift)
    result = cacheblend_prefill(engine.adapter, cache, p, RepairConfig(fidelity="balanced"))
    logits = engine.adapter.logits(result.hidden)[-1]
    kl = F.kl_div(F.log_softmax(logits.float(), -1), truth, log_target=True, reduction="sum").item()
    return sum(result.deviations) / len(result.deviations), result.deviations[0], kl


def main() -> None:
    engine = KVBoost.from_pretrained(dtype="float32")
    seen = [pair(i) for i in range(len(KINDS))]
    pairs = [("seen", *p) for p in seen] + [("fresh", *p) for p in FRESH]
    engine.ingest([doc for _, interacting, independent, _ in pairs for doc in (*interacting, *independent)])
    print("calibrated:", engine.predictor is not None)
    print("| set | pair | D interacting / independent | check layer | first-token KL | D higher | KL higher |")
    print("|---|---|---|---|---|---|---|")
    for i, (kind, interacting, independent, question) in enumerate(pairs):
        a, b = measure(engine, interacting, question), measure(engine, independent, question)
        print(f"| {kind} | {i} | {a[0]:.5f} / {b[0]:.5f} | {a[1]:.5f} / {b[1]:.5f} | {a[2]:.4f} / {b[2]:.4f} | "
              f"{a[0] > b[0]} | {a[2] > b[2]} |")


if __name__ == "__main__":
    main()
