"""Interacting against independent documents, judged at the token the interaction decides.

research/interacting_docs.py found that an ordered-list interaction moves the truth (the reused cache's
first-token KL from a full prefill 3-7x higher than for independent twins), but its first answer token was
"The", sure either way, so the guard's first-token estimate could not see it. Here the assistant's turn is
opened with the answer's words ("The code of the pine vault is "), so the first token served is the code's
first digit: the token where the two documents must be read together.

Six new pairs, kinds and codes written before this ran. In the interacting prompt, document two lists eight codes
"in the order of part one", which alone names the things they belong to; the twin states the same eight facts one
by one, split over two documents. Same question, same answer prefix. The 24 documents are ingested as shipped
(calibrated). Declared before the run, for `fidelity="fast"` (the repair at the default budget, its estimate
measured, never acted on):

    the first token's estimated flip chance is higher for the interacting prompt than for its twin in every pair;

reported beside it: the first-token KL from a full prefill (the truth), whether the first token equals full's,
and balanced's first-token estimate and fallback.

    .venv/bin/python research/interacting_answer.py      # ~3 min, fp32, the bundled model
"""

import torch.nn.functional as F

from kvboost_rag import KVBoost, RepairConfig

PAIRS = [("pump", "station", ["Arden", "Bexley", "Corby", "Dalton", "Ely", "Frome", "Goole", "Hythe"],
          [5821, 3047, 9163, 2708, 6435, 1892, 7354, 4016]),
         ("badge", "guard", ["Amos", "Bruno", "Cyril", "Dmitri", "Emil", "Felix", "Gideon", "Hugo"],
          [7290, 1468, 3925, 8051, 2637, 9704, 4182, 6359]),
         ("gate", "dock", ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"],
          [3186, 8642, 5079, 1723, 9458, 2961, 6814, 4307]),
         ("crate", "ship", ["Albatross", "Heron", "Kestrel", "Osprey", "Pelican", "Raven", "Swift", "Wren"],
          [6947, 2315, 8580, 4162, 1039, 7726, 3491, 5208]),
         ("panel", "tower", ["coral", "ivory", "jade", "lemon", "maroon", "olive", "plum", "teal"],
          [4528, 9071, 1364, 6793, 3250, 8417, 5902, 2186]),
         ("ticket", "show", ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday",
                             "holiday"],
          [8365, 4709, 2851, 9137, 5624, 1490, 7083, 3946])]


def pair(i: int) -> tuple[tuple[str, str], tuple[str, str], str, str]:
    """(interacting documents, independent twins, question, answer prefix) of pair i."""
    thing, owner, names, codes = PAIRS[i]
    ledger = f"Ledger {chr(ord('A') + i)}"
    interacting = (f"{ledger}, part one. The {owner}s on the list, in a fixed order: {', '.join(names)}.",
                   f"{ledger}, part two. The {thing} codes, in the order of part one: {', '.join(map(str, codes))}.")
    facts = [f"The {thing} code of the {name} {owner} is {code}." for name, code in zip(names, codes, strict=True)]
    independent = (f"{ledger}, part one. {' '.join(facts[:4])}", f"{ledger}, part two. {' '.join(facts[4:])}")
    asked = names[(3 * i + 1) % 8]
    return interacting, independent, f"What is the {thing} code of the {asked} {owner}?", \
        f"The {thing} code of the {asked} {owner} is "


def prompt(engine: KVBoost, documents, question: str, answer_prefix: str) -> str:
    messages = [{"role": "user", "content": "\n\n".join(documents) + f"\n\nQuestion: {question}"}]
    return engine.render(messages) + answer_prefix


def main() -> None:
    engine = KVBoost.from_pretrained(dtype="float32")
    engine.ingest([doc for i in range(len(PAIRS)) for twins in pair(i)[:2] for doc in twins])
    print("calibrated:", engine.predictor is not None)
    print("pair kind        | fast: P(flip) first, KL first, same first | balanced: P(flip) first, fell back")
    higher = 0
    for i in range(len(PAIRS)):
        interacting, independent, question, answer_prefix = pair(i)
        risks = {}
        for name, documents in (("interacting", interacting), ("independent", independent)):
            text = prompt(engine, documents, question, answer_prefix)
            truth = F.log_softmax(engine.prefill(text, "full", write_back=False).logits.float(), -1)
            fast = engine.prefill(text, repair=RepairConfig(fidelity="fast"), write_back=False)
            balanced = engine.prefill(text, repair=RepairConfig(fidelity="balanced"), write_back=False)
            kl = F.kl_div(F.log_softmax(fast.logits.float(), -1), truth, log_target=True, reduction="sum").item()
            same = int(fast.logits.argmax()) == int(truth.argmax())
            risks[name] = fast.risk
            print(f"{i} {name:11s} | {fast.risk:.4f} {kl:.4f} {same} | {balanced.risk:.4f} {balanced.fell_back}")
        higher += risks["interacting"] > risks["independent"]
    print(f"first-token estimate higher for the interacting prompt in {higher} of {len(PAIRS)} pairs")


if __name__ == "__main__":
    main()
