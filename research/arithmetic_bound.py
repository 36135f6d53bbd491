"""How far can a reuse path's TTFT ratio go on this CPU? Its ratio over a full prefill, beside the ratio it would
have if everything but its arithmetic (the linears and the attention kernels) cost nothing.

Per prompt size (the bundled synthetic set's items 130 on, built as bench-scaling builds them), in one process:
ROUNDS rounds (after one to warm up), each a full prefill and one of each strategy, timed, then one of each under
torch.profiler, whose kernel operations are summed: the time the prompt's matmuls and attention take at the rate
torch's kernels reach on this machine. Medians over the rounds, so a slow moment of a noisy machine lands in both
measures alike. full's TTFT over a strategy's kernel time is the most its ratio could be with planning,
assembly, norms, RoPE, residual adds and cache writes all free, and the kernels as they are. The strategies run
unguarded (`fidelity="fast"`) at their default budget, with no drift maps (`calibrate=False`): the guard and the
maps add time outside the kernels, which the bound leaves out anyway.

    .venv/bin/python research/arithmetic_bound.py 1000,1650 naive
    .venv/bin/python research/arithmetic_bound.py 4000,8000 naive,cacheblend --rounds 3
"""

import argparse
import statistics

from torch.profiler import ProfilerActivity, profile

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import render_prompt, store_shared_prefix
from kvboost_rag.bench.scaling import build_prompts, token_counter

ROUNDS = 5
# The operations that are the arithmetic: oneDNN's packed bf16 linears, plain linears and matmuls (fp32, the
# lm_head, a decode step's attention), the CPU flash attention kernel. Self times, so nothing is counted twice.
KERNELS = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm",
           "aten::_scaled_dot_product_flash_attention_for_cpu")


def kernel_ms(engine: KVBoost, prompt: str, strategy: str) -> dict[str, float]:
    """One prefill under the profiler: each kernel's self time in ms."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.prefill(prompt, strategy, write_back=False)
    return {event.key: event.self_cpu_time_total / 1e3 for event in prof.key_averages() if event.key in KERNELS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", help="prompt sizes in tokens, comma-separated")
    parser.add_argument("strategies", help="strategies to bound, comma-separated (full is always run)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed rounds, after one to warm up")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    strategies = ["full", *[s for s in args.strategies.split(",") if s != "full"]]
    engine = KVBoost.from_pretrained(config=EngineConfig(dtype=args.dtype, calibrate=False,
                                                         repair=RepairConfig(fidelity="fast")))
    items = load_items("kvboost_rag/bench/synthetic_k8.jsonl")[130:]
    for sized in build_prompts(items, sizes, 1, token_counter(engine)):
        engine.ingest(list(sized.item.documents), progress=False, calibrate=False)
        store_shared_prefix(engine, sized.item)
        prompt = render_prompt(sized.item)
        ttft: dict[str, list[float]] = {strategy: [] for strategy in strategies}
        kernels: dict[str, list[dict[str, float]]] = {strategy: [] for strategy in strategies}
        for round_ in range(args.rounds + 1):
            timed = {strategy: engine.prefill(prompt, strategy, write_back=False).ttft_ms for strategy in strategies}
            profiled = {strategy: kernel_ms(engine, prompt, strategy) for strategy in strategies}
            if round_:
                for strategy in strategies:
                    ttft[strategy].append(timed[strategy])
                    kernels[strategy].append(profiled[strategy])
        full = statistics.median(ttft["full"])
        print(f"{args.dtype}, {sized.tokens} tokens (medians of {args.rounds}):")
        for strategy in strategies:
            median = statistics.median(ttft[strategy])
            spent = statistics.median(sum(run.values()) for run in kernels[strategy])
            names = sorted({name for run in kernels[strategy] for name in run})
            parts = ", ".join(f"{name.split('::')[-1]} "
                              f"{statistics.median(run.get(name, 0.0) for run in kernels[strategy]):.1f}"
                              for name in names)
            print(f"  {strategy:>10}: TTFT {median:8.1f} ms ({full / median:5.2f}x), kernels {spent:8.1f} ms = "
                  f"{spent / median:4.0%} of it (bound {full / spent:5.2f}x; {parts})")


if __name__ == "__main__":
    main()
