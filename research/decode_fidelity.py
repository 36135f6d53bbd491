"""bf16 decode steps against fp32's, teacher-forced on fp32's greedy answer, of the checkout on PYTHONPATH.

For 20 bundled items (130-149): a full prefill in each dtype, then both decode fp32's 16-token greedy answer one
token at a time (`decode_step`, the path answers take); per step KL(fp32 || bf16), the largest logit gap and whether
the top token differs. Run it against two checkouts to see whether a change to bf16 decoding moved it further from
fp32 (from the repository root, each with its checkout first on PYTHONPATH):

    PYTHONPATH=/tmp/before .venv/bin/python research/decode_fidelity.py; .venv/bin/python research/decode_fidelity.py
"""

import statistics

import torch.nn.functional as F

import kvboost_rag
from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.bench.data import bundled, load_items
from kvboost_rag.bench.run import render_prompt
from kvboost_rag.generation import SamplingParams

TOKENS = 16


def engine(dtype: str) -> KVBoost:
    return KVBoost.from_pretrained(config=EngineConfig(dtype=dtype, calibrate=False,
                                                       repair=RepairConfig(fidelity="fast")))


def main() -> None:
    print(f"checkout: {kvboost_rag.__file__}")
    fp32, bf16 = engine("float32"), engine("bfloat16")
    kls, gaps, flips = [], [], 0
    for item in load_items(bundled("synthetic_k8.jsonl"))[130:150]:
        prompt = render_prompt(item)
        pre = fp32.prefill(prompt, "full", max_new_tokens=TOKENS, write_back=False)
        answer = list(list(fp32.stream_from(pre, SamplingParams(TOKENS)))[-1].result.token_ids)
        exact = fp32.prefill(prompt, "full", max_new_tokens=TOKENS, write_back=False)
        other = bf16.prefill(prompt, "full", max_new_tokens=TOKENS, write_back=False)
        for step, token in enumerate(answer[:-1]):
            truth = fp32.decode_step(exact.cache, token, exact.prompt_tokens + step)
            got = bf16.decode_step(other.cache, token, other.prompt_tokens + step).float()
            kls.append(float(F.kl_div(F.log_softmax(got, -1), F.log_softmax(truth, -1), log_target=True,
                                      reduction="sum")))
            gaps.append(float((truth - got).abs().max()))
            flips += int(truth.argmax() != got.argmax())
    print(f"{len(kls)} decode steps: KL(fp32 || bf16) mean {statistics.fmean(kls):.5f}, median "
          f"{statistics.median(kls):.5f}; largest logit gap, median {statistics.median(gaps):.3f}; "
          f"top token differs on {flips}")


if __name__ == "__main__":
    main()
