"""Float32 linears with a transposed copy of their weights for inputs of a few rows (packing.ColumnsLinear) against
the weights as stored alone: what a decode forward costs, and how fast concurrent answers finish.

1. Costs: full prefills of the set's prompts (~1.2k tokens each on fidelity_holdout), then decode forwards over B
   streams x Q tokens (a lone stream with 0-7 drafts, 2 and 4 streams with 0 and 2), 7 each, the two ways
   alternating, after a warm-up round; medians, and the largest difference between the two ways' logits.
2. Concurrent answers: the items in groups of B (--streams; 1 is a lone stream), each group prefilled once per
   stream as shipped (`ingest` calibrates, the default strategy and drafts), the B answers decoded at once from B
   threads, the two ways in turns (the order swapped from group to group), after a warm-up group: the wall time
   summed and its median ratio, and whether each answer is the same token for token. Shadow checks off.

The way is switched by packing.COLUMN_ROWS: above any row count, no input takes the copy.

    .venv/bin/python research/column_weights.py research/data/fidelity_holdout.jsonl --limit 24 --tokens 64 \\
        --json out/column_weights.json
"""

from __future__ import annotations

import sys

from lookahead_speed import setup  # this folder (a script's folder is on sys.path)
from rows_in_place import compare

from kvboost_rag import packing

ROWS = packing.COLUMN_ROWS


def main() -> None:
    args, items, engine = setup(__doc__, streams={"type": int, "default": 4})
    if not engine.adapter.column_linears:
        sys.exit("the probe found no gain from transposed copies here (packing.columns_pay): nothing to compare")

    def switch(way: bool) -> None:
        packing.COLUMN_ROWS = ROWS if way else sys.maxsize

    sizes = [(1, q) for q in (1, 2, 3, 4, 6, 8)] + [(b, q) for b in (2, 4) for q in (1, 3)]
    compare(args, items, engine, switch, {True: "columns", False: "as stored"}, sizes)


if __name__ == "__main__":
    main()
