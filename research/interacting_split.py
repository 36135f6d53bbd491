"""Interacting against independent documents, the strongest interaction: a sentence cut between two documents.

After research/interacting_docs.py and research/interacting_answer.py (an ordered list whose codes are named only
by the document before: the truth did not move reliably at the answer's token), the construction where document
two cannot mean anything alone: its first words finish a sentence document one begins ("... The access code of the
east wing is" | "4417, and it changes ..."). Its twin holds the same words with the cut moved to the sentence's
start, so document two states the whole fact itself. The interacting prompt joins its documents with a space
(one passage), the twin with a blank line (two paragraphs); both ask the same question and open the answer with
the same words ("The access code of the east wing is "), so the first token served is the answer's first digit.
Six pairs, written before this ran. Each side's 12 documents are ingested into an engine of their own (the two
segmentations of one text would otherwise compete for the same words), without calibration, so that both sides
are judged by the same curve: the model's default, which orders requests as their margins do.

Declared before the run, for `fidelity="fast"` (the repair at the default budget; its estimate measured, never
acted on): the first token's estimated flip chance is higher for the interacting prompt than for its twin in every
pair. Reported beside it: the first-token KL from a full prefill (the truth), whether the first token equals
full's, and balanced's first-token estimate and fallback.

    .venv/bin/python research/interacting_split.py [MODEL]   # ~1 min, fp32; MODEL: the bundled one, or as
                                                              # from_pretrained takes it ("gemma-3-270m")
"""

import sys

import torch.nn.functional as F

from kvboost_rag import KVBoost, RepairConfig

# (opening sentences, the fact's subject, its value, what follows it)
PAIRS = [("The east wing of the Harlow museum reopened in spring after two years of repairs. Visitors enter "
          "through the old carriage hall.", "The access code of the east wing is", "4417",
          ", and it is changed on the first day of every month. Staff receive it by letter."),
         ("Rowan Street clinic keeps its vaccines in a cold room at the back of the building. The room has "
          "one door and no windows.", "The cold room's alarm number is", "8306",
          ", which rings the night nurse directly. It was set up by the regional office."),
         ("The Kessel ferry crosses the bay four times a day in summer. In winter the crossing can be "
          "cancelled at short notice.", "The ferry's radio channel is", "7152",
          ", shared with the harbour master. Captains report their position every hour."),
         ("Every player in the Lindqvist chess club has a locker in the basement. The lockers were "
          "painted green last year.", "The locker of the club's captain is number", "2938",
          ", next to the boiler. It holds the club's trophies as well."),
         ("The Ostrava archive stores maps from the eighteenth century in a sealed vault. Only two "
          "people hold keys.", "The vault's inventory number is", "6075",
          ", printed on a brass plate by the door. Researchers must quote it when they book a visit."),
         ("The Meridian hotel's rooftop garden is closed to guests after dark. Its gardener lives "
          "in a flat on the top floor.", "The gardener's phone extension is", "5481",
          ", reachable from any room. He answers until ten in the evening.")]


def pair(i: int) -> tuple[tuple[str, str], tuple[str, str], str, str]:
    """(interacting documents, independent twins, question, answer prefix) of pair i."""
    opening, subject, value, rest = PAIRS[i]
    interacting = (f"{opening} {subject}", f"{value}{rest}")
    independent = (opening, f"{subject} {value}{rest}")
    question = "What is " + subject[0].lower() + subject[1:].rsplit(" is", 1)[0] + "?"
    return interacting, independent, question, subject + " "


def prompt(engine: KVBoost, documents, joiner: str, question: str, answer_prefix: str) -> str:
    messages = [{"role": "user", "content": joiner.join(documents) + f"\n\nQuestion: {question}"}]
    return engine.render(messages) + answer_prefix


SIDES = (("interacting", 0, " "), ("independent", 1, "\n\n"))  # name, index in pair(), joiner


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    engines = {}
    for name, side, _ in SIDES:
        engines[name] = KVBoost.from_pretrained(model, dtype="float32", calibrate=False)
        engines[name].ingest([doc for i in range(len(PAIRS)) for doc in pair(i)[side]], calibrate=False)
    print("pair kind        | reused docs | fast: P(flip) first, KL first, same first | balanced: P(flip), fell back")
    higher = 0
    for i in range(len(PAIRS)):
        _, _, question, answer_prefix = pair(i)
        risks = {}
        for name, side, joiner in SIDES:
            engine = engines[name]
            text = prompt(engine, pair(i)[side], joiner, question, answer_prefix)
            truth = F.log_softmax(engine.prefill(text, "full", write_back=False).logits.float(), -1)
            fast = engine.prefill(text, repair=RepairConfig(fidelity="fast"), write_back=False)
            balanced = engine.prefill(text, repair=RepairConfig(fidelity="balanced"), write_back=False)
            kl = F.kl_div(F.log_softmax(fast.logits.float(), -1), truth, log_target=True, reduction="sum").item()
            same = int(fast.logits.argmax()) == int(truth.argmax())
            reused = sum(1 for chunk in fast.plan.chunks if chunk.source == "approx")
            risks[name] = fast.risk
            print(f"{i} {name:11s} | {reused} | {fast.risk:.2e} {kl:.4f} {same} | {balanced.risk:.2e} "
                  f"{balanced.fell_back}")
        higher += risks["interacting"] > risks["independent"]
    print(f"first-token estimate higher for the interacting prompt in {higher} of {len(PAIRS)} pairs")


if __name__ == "__main__":
    main()
