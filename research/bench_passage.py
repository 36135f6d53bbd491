"""The bench with documents stored after another ingestion passage: a research knob, not a product option.

    .venv/bin/python research/bench_passage.py passage.txt bench --data research/data/man_pages.jsonl --limit 64 ...

The file's text replaces `kvboost_rag.assembly.CONTEXT_PASSAGE` before the engine is built (it enters the model
fingerprint, so a store never mixes the two); everything after the file name is `kvboost-rag`'s command line.
The trimmed passage of docs/method.md ("The ingestion context judged on every held-out set") is the shipped one
less its last two sentences.
"""

import sys
from pathlib import Path

import kvboost_rag.assembly as assembly
from kvboost_rag.cli import main

if __name__ == "__main__":
    assembly.CONTEXT_PASSAGE = Path(sys.argv[1]).read_text().strip()
    sys.exit(main(sys.argv[2:]))
