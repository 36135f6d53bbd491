"""Research check: the noise floor, a full prefill in bf16 against one in fp32 on the same prompts.

No reuse at all: how far two full prefills that differ only in compute dtype are from each other, in the
bench's own terms (agreement of the first 16 greedy tokens, first-token KL, teacher-forced continuation KL
over fp32's greedy output, accuracy). A reuse strategy's deviation reads against this.

    .venv/bin/python research/noise_floor.py --skip 130 --limit 30
"""

import argparse
import statistics

import torch

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.bench.run import continued_logits, correct, kl, render_prompt
from kvboost_rag.generation import SamplingParams


def greedy(engine: KVBoost, prompt, max_new_tokens: int):
    pre = engine.prefill(prompt, "full", max_new_tokens=max_new_tokens, write_back=False)
    result = list(engine.stream_from(pre, SamplingParams(max_new_tokens=max_new_tokens)))[-1].result
    return pre, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(bundled("synthetic_k8.jsonl")))
    parser.add_argument("--skip", type=int, default=130)
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    items = load_items(args.data)[args.skip:args.skip + args.limit]
    fp32 = KVBoost.from_pretrained(config=EngineConfig(dtype="float32"))
    bf16 = KVBoost.from_pretrained(config=EngineConfig(dtype="bfloat16"))
    rows = []
    for item in items:
        prompt = render_prompt(item)
        pre32, out32 = greedy(fp32, prompt, args.max_new_tokens)
        pre16, out16 = greedy(bf16, prompt, args.max_new_tokens)
        truth = continued_logits(fp32, pre32, pre32.logits[None], out32.token_ids)
        other = continued_logits(bf16, pre16, pre16.logits[None].float(), out32.token_ids).float()
        per_token = kl(truth, other)
        rows.append({"agree16": float(out32.token_ids[:16] == out16.token_ids[:16]),
                     "kl_first": float(per_token[0]), "kl_cont": float(per_token.mean()),
                     "acc32": correct(out32.text, item.answers), "acc16": correct(out16.text, item.answers),
                     "ttft_ratio": pre32.ttft_ms / pre16.ttft_ms})
    mean = {key: statistics.fmean(row[key] for row in rows) for key in rows[0]}
    print(f"{len(rows)} items, full bf16 against full fp32: agree@16 {mean['agree16']:.3f}, KL first "
          f"{mean['kl_first']:.4f}, KL cont {mean['kl_cont']:.4f}, accuracy fp32 {mean['acc32']:.3f} / bf16 "
          f"{mean['acc16']:.3f}, bf16 full prefill {statistics.median(r['ttft_ratio'] for r in rows):.2f}x "
          "faster (median)")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
