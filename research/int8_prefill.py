"""A full prefill with int8 linears (torch's dynamic quantization, VNNI kernels) as `strict`'s cheap exact step on a
CPU without bf16 instructions: tried, refused. Its flips along full's greedy answers, teacher-forced, against the
dtype floor's (models.bf16_copy), and the time of each.

On such a CPU the ladder has no bf16 step, so `strict` is a float32 full prefill. A prefill whose answers differ
from float32's no more often than bf16's would be one; int8 is the other fast arithmetic there.

    .venv/bin/python research/int8_prefill.py research/data/fidelity_holdout.jsonl --prompts 12 --tokens 32
"""

from __future__ import annotations

import copy
import json

import torch
from dtype_floor_kernels import (  # this folder: Python puts a script's folder on sys.path
    calibration_prompts,
    forced_flips,
)

from kvboost_rag import models
from kvboost_rag.adapter import ModelAdapter


def int8_copy(model: torch.nn.Module, head: bool) -> torch.nn.Module:
    """`model` with every linear (and the LM head, with `head`) dynamically quantized to int8."""
    copied = copy.deepcopy(model)
    if head:
        return torch.ao.quantization.quantize_dynamic(copied, {torch.nn.Linear}, dtype=torch.qint8)
    copied.model = torch.ao.quantization.quantize_dynamic(copied.model, {torch.nn.Linear}, dtype=torch.qint8)
    return copied


def main() -> None:
    args, engine, drawn = calibration_prompts(__doc__, prompts=12)
    base = engine.adapter.model
    kernels = {"float32": ModelAdapter(base), "bf16": ModelAdapter(models.bf16_copy(base)),
               "int8": ModelAdapter(int8_copy(base, head=True)),
               "int8, head float32": ModelAdapter(int8_copy(base, head=False))}
    flips, seconds = forced_flips(engine, drawn, kernels, args.tokens)
    print(json.dumps({"tokens": sum(len(f) for f in flips["float32"]),
                      "flips": {name: sum(map(sum, f)) for name, f in flips.items()},
                      "answers differing in 16 tokens": {name: sum(any(a[:16]) for a in f)
                                                         for name, f in flips.items()},
                      "seconds": {name: round(s, 1) for name, s in seconds.items()}}))


if __name__ == "__main__":
    main()
