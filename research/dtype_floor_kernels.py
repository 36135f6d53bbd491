"""The dtype floor measured by torch's bf16 kernels and by models.bf16_copy's (float32 kernels for the linears), on
the same calibration prompts: the flips each finds along full's greedy answers, teacher-forced, and their time.

Where bf16 is emulated (a CPU without avx512_bf16 / AMX), calibration measures the dtype floor with bf16_copy, whose
linears compute bf16 arithmetic (bf16 operands, float32 sums, one rounding to bf16) in float32 kernels. This
checks that the floor it finds is bf16's, not another, and what it saves. On a CPU with bf16 instructions
bf16_copy is plain bf16 and both columns are the same model.

    .venv/bin/python research/dtype_floor_kernels.py research/data/fidelity_holdout.jsonl --prompts 24 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvboost_rag import KVBoost, models
from kvboost_rag import calibrate as cal
from kvboost_rag.adapter import ModelAdapter
from kvboost_rag.bench.data import load_items
from kvboost_rag.generation import SamplingParams


def calibration_prompts(description: str, prompts: int):
    """The harness's arguments (`data`, `--prompts`, default `prompts`, `--tokens`), the bundled model in float32 with
    the data's documents ingested (uncalibrated), and `--prompts` calibration prompts drawn from them as calibration
    draws its own. Also used by int8_prefill.py."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("--prompts", type=int, default=prompts)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    engine = KVBoost.from_pretrained(calibrate=False)
    docs = list(dict.fromkeys(d for item in load_items(args.data) for d in item.documents))
    engine.ingest(docs)
    return args, engine, cal.calibration_set(engine, docs, args.prompts, cal.PER_PROMPT)


def forced_flips(engine, drawn, kernels: dict, tokens: int) -> tuple[dict[str, list[list[bool]]], dict[str, float]]:
    """Per kernel (a name -> ModelAdapter), for each drawn prompt, whether each token of full's greedy answer (up to
    `tokens`) flips when teacher-forced through that kernel, and each kernel's seconds (interleaved prompt by
    prompt). Also used by int8_prefill.py."""
    flips = {name: [] for name in kernels}
    seconds = dict.fromkeys(kernels, 0.0)
    for k, item in enumerate(drawn):
        full = engine.prefill(item.prompt, "full", max_new_tokens=tokens, write_back=False)
        *_, last = engine.stream_from(full, SamplingParams(tokens))
        answer = list(last.result.token_ids)
        for name in list(kernels)[::1 if k % 2 == 0 else -1]:  # interleaved
            started = time.perf_counter()
            flips[name].append(cal._changes(cal._forced(kernels[name], full.plan.token_ids, answer), answer))
            seconds[name] += time.perf_counter() - started
        print(k, {name: sum(f[-1]) for name, f in flips.items()}, flush=True)
    return flips, seconds


def main() -> None:
    args, engine, drawn = calibration_prompts(__doc__, prompts=24)
    kernels = {"torch bf16": ModelAdapter(models.in_dtype(engine.adapter.model, torch.bfloat16)),
               "bf16_copy": ModelAdapter(models.bf16_copy(engine.adapter.model))}
    flips, seconds = forced_flips(engine, drawn, kernels, args.tokens)
    per_token = {name: [x for answer in f for x in answer] for name, f in flips.items()}
    a, b = per_token.values()
    print(json.dumps({"tokens": len(a), "flips": {name: sum(f) for name, f in per_token.items()},
                      "flipped_by_both": sum(x and y for x, y in zip(a, b, strict=True)),
                      "seconds": {name: round(s, 1) for name, s in seconds.items()},
                      "bf16_native": models.native_matmuls(torch.bfloat16, torch.device("cpu"))}))


if __name__ == "__main__":
    main()
