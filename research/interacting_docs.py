"""Interacting against independent documents: does the guard's estimate see the interaction, and does the truth?

Four pairs of prompts built before anything was measured. In the interacting one, document two ("their codes, in
the same order as in part one: ...") means nothing without document one (the names, in that order); the
independent twin states the same eight facts self-contained ("The green door has code 1185."), split over two
documents. Same question. The 16 documents are ingested (and calibrated on) as shipped. Per prompt and level
(fast, balanced): the first token's estimated flip chance, the 16-token estimate, the first-token KL from a full
prefill and whether the 16 tokens equal full's, and whether the prefill fell back.

    .venv/bin/python research/interacting_docs.py      # ~2 min, fp32, the bundled model
"""

import torch.nn.functional as F

from kvboost_rag import KVBoost, RepairConfig

KINDS = [("door", ["red", "blue", "green", "white", "black", "amber", "grey", "pink"]),
         ("locker", ["north", "south", "east", "west", "upper", "lower", "inner", "outer"]),
         ("vault", ["Ash", "Birch", "Cedar", "Elm", "Fir", "Hazel", "Oak", "Pine"]),
         ("cabin", ["Alder", "Brook", "Cliff", "Dune", "Fern", "Glen", "Heath", "Isle"])]
CODES = [[4417, 9902, 1185, 3320, 7761, 5093, 2248, 6634], [8120, 3356, 7042, 1569, 6283, 2917, 5504, 9738],
         [2675, 8841, 4093, 7310, 1958, 6427, 3782, 5106], [9241, 1637, 5820, 3094, 7468, 2513, 8379, 4650]]


def pair(i: int) -> tuple[tuple[str, str], tuple[str, str], str]:
    """(interacting documents, independent twins, question) of pair i."""
    kind, names = KINDS[i]
    codes = CODES[i]
    register = f"Register {i + 1}"
    interacting = (f"{register}, part one. The {kind}s of the site, listed in a fixed order: {', '.join(names)}.",
                   f"{register}, part two. Their codes, in the same order as in part one: "
                   f"{', '.join(map(str, codes))}.")
    facts = [f"The {name} {kind} has code {code}." for name, code in zip(names, codes, strict=True)]
    independent = (f"{register}, part one. {' '.join(facts[:4])}", f"{register}, part two. {' '.join(facts[4:])}")
    return interacting, independent, f"What is the code of the {names[2]} {kind}?"


def messages(documents, question: str) -> list[dict]:
    return [{"role": "user", "content": "\n\n".join(documents) + f"\n\nQuestion: {question}"}]


def main() -> None:
    engine = KVBoost.from_pretrained(dtype="float32")
    engine.ingest([doc for i in range(len(KINDS)) for twins in pair(i)[:2] for doc in twins])
    print("calibrated:", engine.predictor is not None)
    print("pair, kind, level: first-token P(flip), 16-token estimate, first-token KL, same 16 tokens, fell back")
    for i in range(len(KINDS)):
        interacting, independent, question = pair(i)
        for name, documents in (("interacting", interacting), ("independent", independent)):
            prompt = messages(documents, question)
            full = engine.generate(prompt, strategy="full", max_new_tokens=16, write_back=False)
            truth = F.log_softmax(engine.prefill(prompt, "full", write_back=False).logits.float(), -1)
            for level in ("fast", "balanced"):
                repair = RepairConfig(fidelity=level)
                pre = engine.prefill(prompt, repair=repair, write_back=False)
                kl = F.kl_div(F.log_softmax(pre.logits.float(), -1), truth, log_target=True, reduction="sum").item()
                out = engine.generate(prompt, repair=repair, max_new_tokens=16, write_back=False)
                print(f"{i} {name:11s} {level:8s} {pre.risk:.4f} {out.fidelity_estimate:.4f} {kl:.4f} "
                      f"{out.token_ids == full.token_ids} {out.fell_back}")


if __name__ == "__main__":
    main()
