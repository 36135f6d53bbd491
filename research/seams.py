"""Issue 39: the share of document tokens reused on each family's tokenizer, and what seam handling costs.

Reuse: for every tokenizer fetched by scripts/fetch_tokenizers (Llama 3.1 for Llama 3.x and SmolLM3, Qwen3 for
Qwen2.5/3, Gemma 3, Llama 2 for Mistral and Phi-3) and the bundled SmolLM2's, paired with a tiny random model of
its vocabulary (the share depends on tokens alone, not on weights), the documents of held-out items laid out five
ways (tests/unit/test_seams.py's layouts): the share of their tokens served from the store, now and under the
rule before issue 39 (a document used only where the prompt's tokens over it were exactly its own).

Cost: on the bundled model (what `kvboost-rag bench` runs), tokenizing each prompt with today's rule and the
previous one (the pre-issue-39 assembly.py, read from git), interleaved, against naive's TTFT on the same prompt
in the same run; medians.

    .venv/bin/python research/seams.py [--items 12] [--out docs/seams.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.models import LoadedModel, convert_bundled

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.unit.test_seams import CACHE, CHECKED, INST_TEMPLATE  # noqa: E402 - the layouts the tests check

BEFORE = "dcabe86"  # the last commit before issue 39's matching
SETS = {"synthetic 300-315": (bundled("synthetic_k8.jsonl"), 300), "multidoc_other": (
    Path(__file__).parent / "data" / "multidoc_other.jsonl", 0)}


def legacy_tokenize():
    """tokenize_prompt as it was before issue 39, loaded from git into a throwaway module."""
    source = subprocess.run(["git", "show", f"{BEFORE}:kvboost_rag/assembly.py"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).parent).stdout
    folder = Path(tempfile.mkdtemp())
    (folder / "assembly.py").write_text(source)
    spec = importlib.util.spec_from_file_location("kvboost_rag._legacy_assembly", folder / "assembly.py",
                                                  submodule_search_locations=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "kvboost_rag"
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.tokenize_prompt


def tokenizers() -> dict[str, object]:
    found = {"smollm2": AutoTokenizer.from_pretrained(convert_bundled()[0])}
    for family in ("llama3_1", "qwen3", "gemma3", "llama2"):
        if (CACHE / family / "tokenizer.json").exists():
            tok = AutoTokenizer.from_pretrained(CACHE / family)
            tok.chat_template = tok.chat_template or INST_TEMPLATE
            found[family] = tok
    return found


def tiny_engine(family: str, tokenizer) -> KVBoost:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192)
    loaded = LoadedModel(LlamaForCausalLM(config).eval(), tokenizer, f"tiny-{family}", "seed0")
    return KVBoost(loaded, EngineConfig(calibrate=False, repair=RepairConfig(fidelity="fast")))


def reuse_table(items_per_set: int) -> list[str]:
    legacy = legacy_tokenize()
    lines = ["| tokenizer | set | " + " | ".join(CHECKED) + " |", "|---|---|" + "---|" * len(CHECKED)]
    for family, tokenizer in tokenizers().items():
        engine = tiny_engine(family, tokenizer)
        for set_name, (path, skip) in SETS.items():
            items = load_items(path)[skip:skip + items_per_set]
            cells = []
            for layout in CHECKED.values():
                reused = found = before = 0
                for item in items:
                    engine.ingest(list(item.documents), progress=False)
                    rendered = engine.render(layout(list(item.documents), item.question))
                    p = engine.plan(rendered, "naive")
                    reused, found = reused + p.document_tokens_reused, found + p.document_tokens
                    old = legacy(rendered, engine.documents, engine.tokenizer, engine.config.chunking.max_chunk_tokens,
                                 engine._bos_ids, engine._special_ids)
                    before += sum(n for tokens, is_doc in old.chunks if is_doc for n in [len(tokens)])
                cells.append(f"{reused / found:.3f} ({before / found:.3f})")
            lines.append(f"| {family} | {set_name} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines


def cost(items_per_set: int, dtype: str, rounds: int = 5) -> list[str]:
    legacy = legacy_tokenize()
    engine = KVBoost.from_pretrained(dtype=dtype, calibrate=False, repair=RepairConfig(fidelity="fast"))
    lines = [f"| {dtype}, layout | prompt tokens | naive TTFT ms | tokenize before ms | tokenize now ms | "
             "added / naive TTFT |", "|---|---|---|---|---|---|"]
    path, skip = SETS["synthetic 300-315"]
    items = load_items(path)[skip:skip + items_per_set]
    for name in ("bench", "tags"):
        ttft, old_ms, new_ms, sizes = [], [], [], []
        for item in items:
            engine.ingest(list(item.documents), progress=False)
            rendered = engine.render(CHECKED[name](list(item.documents), item.question))
            engine.prefill(rendered, "naive", write_back=False)  # warm-up
            for _ in range(rounds):
                start = time.perf_counter()
                legacy(rendered, engine.documents, engine.tokenizer, engine.config.chunking.max_chunk_tokens,
                       engine._bos_ids, engine._special_ids)
                old_ms.append((time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                engine.tokenize(rendered)
                new_ms.append((time.perf_counter() - start) * 1e3)
                pre = engine.prefill(rendered, "naive", write_back=False)
                ttft.append(pre.ttft_ms)
                sizes.append(pre.prompt_tokens)
        t, a, b = statistics.median(ttft), statistics.median(old_ms), statistics.median(new_ms)
        lines.append(f"| {name} | {statistics.median(sizes):.0f} | {t:.1f} | {a:.2f} | {b:.2f} | {(b - a) / t:+.2%} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=12, help="items per set")
    parser.add_argument("--out", default=None, help="write the tables (Markdown) here")
    args = parser.parse_args()
    out = ["# Seams (issue 39): document tokens reused on each family's tokenizer, and the cost", "",
           f"`.venv/bin/python research/seams.py --items {args.items} --out docs/seams.md`. Share of the found "
           "documents' tokens served from the store, now (and under the rule before issue 39: a document used only "
           "where the prompt's tokens over it were exactly its own).", "", *reuse_table(args.items), "",
           "What seam handling costs: tokenizing the prompt with today's rule and the previous one, interleaved "
           "with naive prefills on the bundled model, synthetic items 300+, medians.", ""]
    for dtype in ("float32", "bfloat16"):
        out += cost(args.items, dtype) + [""]
    if args.out:
        Path(args.out).write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
