"""The reuse paths and a decode step before and after two cuts of their fixed costs, interleaved in one process
(docs/method.md, note 1g):

- sibling linears as one call (`packing.Siblings`: an attention's q/k/v, an MLP's gate/up);
- keys widened once before RoPE turns them (`ModelAdapter.apply_rope`), instead of each mixed-dtype operation
  converting its bf16 operands again.

"before" is an engine built with `packing.FUSED_SIBLINGS = ()` whose adapter turns keys the way apply_rope did
before (BEFORE_APPLY_ROPE below, bound to that adapter alone); "after" is the library as it is. Both compute the
same numbers bit for bit (tests/unit/test_packing.py, and the check this script makes). Per prompt size (the
bundled synthetic set's items 130 on, built as bench-scaling builds them): ROUNDS rounds after one to warm up,
each a full, naive and cacheblend prefill (unguarded, no drift maps) and DECODE_STEPS decode steps per engine,
the engines' order alternating; then the assembly alone. Medians. Last, what it costs at load: packing a copy of
the bf16 model with and without siblings, alternately, ROUNDS times each.

    .venv/bin/python research/fewer_calls.py 1000,1650
"""

import argparse
import copy
import statistics
import time
import types

import torch

from kvboost_rag import EngineConfig, KVBoost, RepairConfig, packing
from kvboost_rag.assembly import assemble
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt, store_shared_prefix
from kvboost_rag.bench.scaling import build_prompts, token_counter
from kvboost_rag.models import load

ROUNDS, DECODE_STEPS = 7, 6


def BEFORE_APPLY_ROPE(self, keys, cos, sin, inverse=False, fused=True, out=None):
    """ModelAdapter.apply_rope as of 24e68a4 (the halves-pairing branch; the other is unchanged)."""
    r = cos.shape[-1]
    if not (fused and self._splits_halves(r)):
        return type(self).apply_rope(self, keys, cos, sin, inverse, fused, out)
    half, sign = r // 2, -1 if inverse else 1
    if out is None:
        shape = (*torch.broadcast_shapes(keys.shape[:-1], cos.shape[:-1]), keys.shape[-1])
        out = torch.empty(shape, device=keys.device, dtype=torch.promote_types(keys.dtype, cos.dtype))
    if r < keys.shape[-1]:
        out[..., r:] = keys[..., r:]
    k1, k2 = keys[..., :half], keys[..., half:r]
    torch.addcmul(k1 * cos[..., :half], k2, sin[..., :half], value=-sign, out=out[..., :half])
    torch.addcmul(k2 * cos[..., half:], k1, sin[..., half:], value=sign, out=out[..., half:r])
    return out


def engines() -> dict[str, KVBoost]:
    config = EngineConfig(dtype="bfloat16", calibrate=False, repair=RepairConfig(fidelity="fast"))
    shipped = packing.FUSED_SIBLINGS
    packing.FUSED_SIBLINGS = ()
    try:
        before = KVBoost.from_pretrained(config=config)
    finally:
        packing.FUSED_SIBLINGS = shipped
    before.adapter.apply_rope = types.MethodType(BEFORE_APPLY_ROPE, before.adapter)
    return {"before": before, "after": KVBoost.from_pretrained(config=config)}


def decode_ms(engine: KVBoost, prompt: str) -> float:
    pre = engine.prefill(prompt, "naive", write_back=False, max_new_tokens=DECODE_STEPS)
    steps = []
    for i in range(DECODE_STEPS):
        started = time.perf_counter()
        engine.decode_step(pre.cache, int(pre.logits.argmax()), pre.plan.num_tokens + i)
        steps.append(time.perf_counter() - started)
    return statistics.median(steps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", help="prompt sizes in tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    runs = engines()
    items = load_items("kvboost_rag/bench/synthetic_k8.jsonl")[130:]
    for sized in build_prompts(items, [int(s) for s in args.sizes.split(",")], 1, token_counter(runs["after"])):
        prompt = render_prompt(sized.item)
        for engine in runs.values():
            engine.ingest(list(sized.item.documents), progress=False, calibrate=False)
            store_shared_prefix(engine, sized.item)
        same = all(torch.equal(runs["before"].prefill(prompt, s, write_back=False).logits,
                               runs["after"].prefill(prompt, s, write_back=False).logits)
                   for s in ("full", "naive", "cacheblend"))
        ms = {(name, what): [] for name in runs for what in ("full", "naive", "cacheblend", "decode step")}
        for round_ in range(args.rounds + 1):
            order = list(runs.items()) if round_ % 2 else list(runs.items())[::-1]
            measured = {}
            for name, engine in order:
                for strategy in ("full", "naive", "cacheblend"):
                    measured[name, strategy] = engine.prefill(prompt, strategy, write_back=False).ttft_ms
                measured[name, "decode step"] = decode_ms(engine, prompt)
            if round_:
                for key, value in measured.items():
                    ms[key].append(value)
        m = {key: statistics.median(values) for key, values in ms.items()}
        print(f"bf16, {sized.tokens} tokens, medians of {args.rounds} (logits bit for bit the same: {same}):")
        for what in ("full", "naive", "cacheblend", "decode step"):
            ratio = "" if what in ("full", "decode step") else \
                f"  (ratio to full {m['before', 'full'] / m['before', what]:5.2f}x -> " \
                f"{m['after', 'full'] / m['after', what]:5.2f}x)"
            print(f"  {what:>12}: {m['before', what]:7.1f} -> {m['after', what]:7.1f} ms{ratio}")
        with torch.inference_mode():
            for name, engine in runs.items():
                plan = engine.plan(prompt, "naive")
                assemble(plan, engine.adapter, plan.num_tokens)
                times = []
                for _ in range(15):
                    started = time.perf_counter()
                    assemble(plan, engine.adapter, plan.num_tokens)
                    times.append(time.perf_counter() - started)
                print(f"  assembly ({name}, naive's plan): {statistics.median(times) * 1e3:.1f} ms")
    for name, ms in packing_ms(args.rounds).items():
        print(f"packing the model's weights at load, {name}: {ms:.0f} ms")


def packing_ms(rounds: int) -> dict[str, float]:
    """pack_linears on a fresh copy of the unpacked bf16 model, without and with siblings, alternately."""
    model, shipped = load(None, dtype="bfloat16").model, packing.FUSED_SIBLINGS
    times: dict[str, list[float]] = {"without siblings": [], "with siblings": []}
    for _ in range(rounds + 1):
        for name, siblings in (("without siblings", ()), ("with siblings", shipped)):
            fresh = copy.deepcopy(model)
            packing.FUSED_SIBLINGS = siblings
            try:
                started = time.perf_counter()
                packing.pack_linears(fresh)
                times[name].append(time.perf_counter() - started)
            finally:
                packing.FUSED_SIBLINGS = shipped
    return {name: statistics.median(spent[1:]) * 1e3 for name, spent in times.items()}


if __name__ == "__main__":
    main()
