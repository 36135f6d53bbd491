"""Research check (issue 23): how the bundled bench prompts were tokenized before prompts were tokenized whole.

Until issue 23 each piece of a prompt (fixed text, each document) was tokenized on its own. This script
rebuilds that tokenization from today's segments and compares it with today's (the whole prompt, as the
model's tokenizer cuts it), for every prompt of the bundled sets. Tokenization only: no KV is computed.

    .venv/bin/python research/tokenization_seams.py
"""

from kvboost_rag import KVBoost
from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.store.documents import Document

SETS = ("synthetic_k8.jsonl", "pydoc_k8.jsonl", "synthetic_calib.jsonl", "tiny.jsonl")


def main() -> None:
    engine = KVBoost.from_pretrained()
    tokenizer = engine.tokenizer
    blank, newline = tokenizer.convert_tokens_to_ids("ĊĊ"), tokenizer.convert_tokens_to_ids("Ċ")
    for name in SETS:
        items = load_items(bundled(name))
        same = only_blank_lines = used = found = 0
        for item in items:
            for text in item.documents:
                engine.documents.add(engine.document(text))
            rendered = engine.render(render_prompt(item))
            prompt = engine.tokenize(rendered)
            whole = [t for tokens, _ in prompt.chunks for t in tokens]
            pieces = []
            for seg in prompt.segments:
                pieces += (list(seg.token_ids) if isinstance(seg, Document)
                           else tokenizer(seg, add_special_tokens=False)["input_ids"])
            split_blank = [t for token in pieces for t in ([newline, newline] if token == blank else [token])]
            same += pieces == whole
            only_blank_lines += pieces != whole and split_blank == whole
            found += len(engine.documents.find(rendered))
            used += sum(isinstance(seg, Document) for seg in prompt.segments)
        print(f"{name}: {len(items)} prompts; tokenized alike {same}, differing only at blank lines "
              f"{only_blank_lines}; documents found in the text {found}, on token boundaries and used {used}")


if __name__ == "__main__":
    main()
