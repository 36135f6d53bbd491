"""What Gemma 3's sliding layers cost a prefill, with one dense mask against the bands attention.py runs them in.

Gemma 3 270M's layers slide over 512 keys (15 of 18). A prompt longer than that used to give those layers one
dense additive mask [Q, K], on which the CPU flash kernel computes every query against every key; attention.py
now cuts the queries into blocks (BAND_ROWS), each over only the keys it sees. This harness times, interleaved,
medians of `--repeats` after a warm-up:

1. the attention kernel alone at Gemma's shapes (4 query heads, 1 K/V head, 256 channels, window 512), a whole
   prompt of each length: one dense mask against the bands, fp32 and bf16, and the bands' largest deviation from
   the dense result;
2. a full prefill of the real model through the adapter, fp32 and bf16 (the ladder's HALF step), with the sliding
   layers' masks dense (as before) and described (as shipped), and the bf16 prefill's speed-up over fp32's.

    .venv/bin/python research/window_attention.py --lengths 824 1400 --json out/g51/window_attention.json
"""

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from kvboost_rag import models
from kvboost_rag.adapter import ModelAdapter
from kvboost_rag.attention import CausalRows, causal_attention
from kvboost_rag.repair.guard import exact_cache, half_adapter


def timed(fn, repeats: int) -> float:
    """Median ms of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def kernel(lengths, repeats: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in lengths:
            query = torch.randn(1, 4, n, 256, dtype=dtype)
            key, value = torch.randn(1, 1, n, 256, dtype=dtype), torch.randn(1, 1, n, 256, dtype=dtype)
            mask = CausalRows(torch.arange(n), n, 512)
            dense = mask.dense(dtype, query.device)

            def one_mask(query=query, key=key, value=value, dense=dense):
                return F.scaled_dot_product_attention(query, key, value, attn_mask=dense, enable_gqa=True)

            def bands(query=query, key=key, value=value, mask=mask):
                return causal_attention(query, key, value, mask, None)

            gap = (bands().float() - one_mask().transpose(1, 2).float()).abs().max().item()
            rows.append({"dtype": str(dtype), "tokens": n, "dense_ms": timed(one_mask, repeats),
                         "bands_ms": timed(bands, repeats), "max_abs_gap": gap})
            print(rows[-1])
    return rows


def dense_where_a_window_cuts_in(adapter: ModelAdapter):
    """The adapter's masks as before the bands: dense in a sliding layer whose window cuts in."""
    described = adapter._mask

    def mask(positions, attend_len, dtype, window, dense=False):
        return described(positions, attend_len, dtype, window, dense or (window is not None and attend_len > window))
    return mask


def prefills(model_name: str, lengths, repeats: int) -> list[dict]:
    loaded = models.load(model_name, "float32")
    fp32 = ModelAdapter(loaded.model)
    bf16 = half_adapter(fp32)
    if bf16 is None:
        raise SystemExit("bf16 is emulated on this CPU: no bf16 prefill to time")
    rows = []
    for n in lengths:
        ids = torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(n))
        result = {"tokens": n}
        for masks in ("dense", "bands"):
            for adapter in (fp32, bf16):
                if masks == "dense":
                    adapter._mask = dense_where_a_window_cuts_in(adapter)
                else:
                    adapter.__dict__.pop("_mask", None)
            # Interleaved: one fp32 then one bf16 prefill per repeat.
            times = {"float32": [], "bfloat16": []}
            for repeat in range(repeats + 1):
                for name, adapter in (("float32", fp32), ("bfloat16", bf16)):
                    started = time.perf_counter()
                    exact_cache(adapter, nullcontext(), ids, n)
                    if repeat:
                        times[name].append((time.perf_counter() - started) * 1e3)
            for name, values in times.items():
                result[f"{masks}_{name}_ms"] = statistics.median(values)
            result[f"{masks}_bf16_speedup"] = result[f"{masks}_float32_ms"] / result[f"{masks}_bfloat16_ms"]
        print(result)
        rows.append(result)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=models.GEMMA_NAME)
    parser.add_argument("--lengths", type=int, nargs="+", default=[824, 1400])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    figures = {"kernel": kernel(args.lengths, args.repeats), "prefill": prefills(args.model, args.lengths,
                                                                                 args.repeats)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
