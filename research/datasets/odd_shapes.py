"""Eight items of shapes no held-out set has, for the bench's robustness, not its figures: one document, twenty, three
scripts with emoji, the same document twice, documents padded with blank lines and tabs, one ~2,850-token document,
and one item over SmolLM2's 8,192-token window (the bench refuses the set, naming it, before ingesting; `head -7` the
file to run the rest). docs/method.md, "An outside set's odd shapes".

    .venv/bin/python research/datasets/odd_shapes.py out/odd.jsonl
"""

import json
import random
import sys

WORDS = ["river", "town", "bridge", "mayor", "harbour", "school", "market", "station", "garden", "tower", "library",
         "museum"]
LARKIN = "The Larkin Institute was founded in 1931 by Maeve Larkin in the town of Dunmore."
FERRY = "The ferry to Inish Mor leaves at 9:40 every morning."


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def item(item_id: str, documents: list[str], question: str, answer: str) -> dict:
    return {"id": item_id, "documents": documents, "question": question, "answers": [answer]}


ITEMS = [
    item("one-doc", [LARKIN], "Who founded the Larkin Institute?", "Maeve Larkin"),
    item("twenty-docs", [f"Record {i}: the warehouse at dock {i} stores {n} crates."
                         for i, n in enumerate(range(100, 2100, 100))],
         "How many crates does the warehouse at dock 7 store?", "800"),
    item("cjk-emoji", ["東京タワーは1958年に完成した。高さは333メートルである。",
                       "Der Kölner Dom wurde 1880 fertiggestellt. 🏰 Er ist 157 Meter hoch.",
                       "La tour Eiffel mesure 330 mètres 🗼 et fut achevée en 1889."],
         "How tall is the Tokyo Tower in metres?", "333"),
    item("same-doc-twice", [FERRY, FERRY, "The bus to Galway leaves at 11:15."],
         "When does the ferry to Inish Mor leave?", "9:40"),
    item("whitespace", ["\n\n  The code word is ORCHID.  \n", "\tNothing else matters here.\n\n"],
         "What is the code word?", "ORCHID"),
    item("long-doc", [words(2500, 3) + " The secret number is 4417. " + words(300, 4)],
         "What is the secret number?", "4417"),
    item("shared-moved", [LARKIN, FERRY, "The code word is ORCHID."], "In which town is the Larkin Institute?",
         "Dunmore"),
    item("over-window", [words(3500, 10 + i) for i in range(3)], "Which word appears most?", "river"),
]

if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else "odd_shapes.jsonl", "w", encoding="utf-8") as f:
        for row in ITEMS:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
