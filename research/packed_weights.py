"""Packed linear weights (kvboost_rag/packing.py) against plain ones, in one process, interleaved.

One engine in bf16 on the bundled model, one prompt of about SIZE tokens built as `bench-scaling` builds them
(bundled synthetic set, items 130 on, its documents ingested, the shared prefix stored). Each round times a
prefill of every strategy and DECODE single-stream decode steps, first with the weights packed, then with them
swapped back to plain nn.Linear, the order alternating by round; the first round is a warm-up. Prints medians and
the largest logit difference between the two (packing is meant to change no number).

    .venv/bin/python research/packed_weights.py [SIZE=1000] [ROUNDS=7]
"""

import statistics
import sys
import time

import torch

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt, store_shared_prefix
from kvboost_rag.bench.scaling import build_prompts, token_counter
from kvboost_rag.packing import PackedLinear, pack_linears

STRATEGIES = ("full", "naive", "cacheblend")
DECODE = 8


def unpack(model: torch.nn.Module) -> None:
    """PackedLinear -> nn.Linear over the same Parameters."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                plain = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                        device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)


def measure(engine: KVBoost, prompt) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    times, logits = {}, {}
    for strategy in STRATEGIES:
        pre = engine.prefill(prompt, strategy, write_back=False, max_new_tokens=DECODE)
        times[strategy], logits[strategy] = pre.ttft_ms, pre.logits
    pre = engine.prefill(prompt, "full", write_back=False, max_new_tokens=DECODE)
    started = time.perf_counter()
    for step in range(DECODE):
        engine.decode_step(pre.cache, 42, pre.prompt_tokens + step)
    times["decode step"] = (time.perf_counter() - started) / DECODE * 1e3
    return times, logits


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    engine = KVBoost.from_pretrained(config=EngineConfig(dtype="bfloat16", calibrate=False,
                                                         repair=RepairConfig(fidelity="fast")))
    model = engine.adapter.model
    if engine.adapter.packed_linears == 0:
        sys.exit("this CPU's oneDNN packs no bf16 weights (packing.can_pack): nothing to compare")
    item = build_prompts(load_items("kvboost_rag/bench/synthetic_k8.jsonl")[130:], [size], 1,
                         token_counter(engine))[0]
    engine.ingest(list(item.item.documents), progress=False, calibrate=False)
    store_shared_prefix(engine, item.item)
    prompt = render_prompt(item.item)
    samples = {"packed": [], "plain": []}
    gap = 0.0
    for round_ in range(rounds + 1):
        for kind in (("packed", "plain") if round_ % 2 else ("plain", "packed")):
            (pack_linears if kind == "packed" else unpack)(model)
            times, logits = measure(engine, prompt)
            if round_:
                samples[kind].append(times)
            if kind == "packed":
                packed_logits = logits
            else:
                plain_logits = logits
        gap = max(gap, *(float((packed_logits[s] - plain_logits[s]).abs().max()) for s in STRATEGIES))
    print(f"{item.tokens} prompt tokens, bf16, {rounds} rounds, {torch.get_num_threads()} threads; "
          f"largest logit difference packed vs plain: {gap}")
    print("| | plain ms | packed ms | plain speed-up over full | packed speed-up over full |")
    print("|---|---|---|---|---|")
    med = {kind: {key: statistics.median(t[key] for t in runs) for key in runs[0]} for kind, runs in samples.items()}
    for key in med["plain"]:
        ratio = {kind: med[kind]["full"] / med[kind][key] for kind in med} if key in STRATEGIES else {}
        cells = [f"{med['plain'][key]:.1f}", f"{med['packed'][key]:.1f}",
                 f"{ratio['plain']:.2f}x" if ratio else "-", f"{ratio['packed']:.2f}x" if ratio else "-"]
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
