"""Calibration on documents grouped as a retriever groups them: a research knob, tried and not shipped (issue 41).

Calibration (drift maps, the guard's curve and its floors) draws each prompt's documents at random from the corpus.
A retriever returns documents like each other, and a document drifts towards what precedes it; here each
calibration prompt is instead a document drawn at random and the documents most like it (cosine of TF-IDF word
weights), shuffled. Runs `kvboost-rag`'s command line, or a research script, with calibration patched so:

    .venv/bin/python research/similar_calibration.py bench --data research/data/package_pages.jsonl --limit 64 ...
    .venv/bin/python research/similar_calibration.py research/lookalike_variants.py out/server_compare.json ...

Figures in docs/method.md, "Calibration on documents as a retriever groups them".
"""

from __future__ import annotations

import collections
import math
import random
import re
import runpy
import sys
from pathlib import Path

import kvboost_rag.drift as drift
from kvboost_rag.cli import main


def similar_groups(texts: list[str], count: int, per_prompt: int, rng: random.Random) -> list[list[str]]:
    """`count` groups: a document drawn at random and the `per_prompt` - 1 most like it, shuffled."""
    counts = [collections.Counter(re.findall(r"\w+", text.lower())) for text in texts]
    frequency = collections.Counter(word for words in counts for word in words)
    vectors = []
    for words in counts:
        weights = {w: n * math.log(len(texts) / frequency[w]) for w, n in words.items()}  # in every document: 0
        norm = math.sqrt(sum(x * x for x in weights.values())) or 1.0
        vectors.append({w: x / norm for w, x in weights.items()})
    groups = []
    for _ in range(count):
        seed = rng.randrange(len(texts))
        likeness = [sum(x * other.get(w, 0.0) for w, x in vectors[seed].items()) for other in vectors]
        likeness[seed] = math.inf
        nearest = sorted(range(len(texts)), key=lambda j: -likeness[j])[:per_prompt]
        rng.shuffle(nearest)
        groups.append([texts[j] for j in nearest])
    return groups


def similar_prompts(texts, num_tokens, room, count, per_prompt, seed=0, layout=drift.bare_layout) -> list:
    """drift.calibration_prompts with similar_groups for its random draw (the same fit to the context window)."""
    prompts = []
    for group in similar_groups(list(texts), count, per_prompt, random.Random(seed)):
        sizes = [num_tokens(t) + 2 for t in group]
        while len(group) > 1 and sum(sizes) > room:
            group.pop()
            sizes.pop()
        prompts.append(layout(group))
    return prompts


if __name__ == "__main__":
    drift.calibration_prompts = similar_prompts
    if sys.argv[1].endswith(".py"):
        sys.argv = sys.argv[1:]
        sys.path.insert(0, str(Path(sys.argv[0]).parent))  # its own imports (research/)
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        sys.exit(main(sys.argv[1:]))
