"""How alike a request's documents are, the cue that holds a `balanced` request to `strict` (repair/guard.py,
`held_to`).

Records written from one template (eight towns named alike, each with a population; a ship and its captain) are
told apart by a small model only from a cache that is right nearly everywhere: the repaired cache names a look-alike
record's entity where a full prefill reads the right one, at every recompute budget a reused cache is worth, and the
guard's margins do not see it (docs/method.md, "The look-alike families' answers need almost all of the cache
right"). Random groups of a corpus's documents, what calibration fits on, are never that alike, so such a request
is unlike everything the guard's curve was fitted on.

Word 4-grams rather than the model's tokens: a tokenizer cuts code and markup into short pieces that recur across
unrelated pages (package pages share 0.045 of their token 4-grams and 0.007 of their word 4-grams), while records
from one template share whole phrases either way (0.13-0.22 on the synthetic families).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

GRAM = 4  # words


def word_grams(text: str) -> frozenset[tuple[str, ...]]:  # not cached: 0.4 ms a request of ~600 words
    words = re.findall(r"\w+", text.lower())
    return frozenset(tuple(words[i:i + GRAM]) for i in range(len(words) - GRAM + 1))


def likeness(texts: Sequence[str]) -> float:
    """The mean, over pairs of `texts`, of the word 4-grams two share over those either has (Jaccard); 0 for fewer
    than two texts."""
    grams = [word_grams(text) for text in texts]
    shares = [len(a & b) / len(a | b) if a or b else 0.0 for a, b in itertools.combinations(grams, 2)]
    return sum(shares) / len(shares) if shares else 0.0
