"""What the research harnesses share: a full prefill as the reference, a prefill scored against it, and the
summary they print and save. Imported by the scripts next to it (run as `python research/NAME.py`)."""

import json
import statistics
from pathlib import Path

from kvboost_rag.bench.run import continued_logits, kl
from kvboost_rag.generation import SamplingParams


def full_reference(engine, prompt, tokens: int, room: int):
    """(reference [T, V], distributions): a full prefill's distributions over its own `tokens` greedy tokens
    (teacher-forced), and the function giving any prefill's distributions over the same tokens. `room`: the
    new tokens the first full prefill leaves space for (the harness's answer length)."""
    full = engine.prefill(prompt, "full", max_new_tokens=room, write_back=False)
    greedy = list(list(engine.stream_from(full, SamplingParams(tokens)))[-1].result.token_ids)

    def distributions(pre):
        return continued_logits(engine, pre, pre.logits[None], greedy)

    return distributions(engine.prefill(prompt, "full", max_new_tokens=tokens, write_back=False)), distributions


def score(reference, distributions, pre) -> dict:
    """First-token and continuation KL from the reference, recompute fraction and TTFT of prefill `pre`."""
    per_token = kl(reference, distributions(pre)[: len(reference)])
    return {"first": float(per_token[0]), "cont": float(per_token.mean()),
            "rec": pre.recomputed_tokens / pre.prompt_tokens, "ms": pre.ttft_ms}


def summarize(rows: list[dict], names: list[str], keys: tuple[str, ...], out: str) -> None:
    """Mean of each key per variant, printed (continuation KL also as a share of naive's) and saved to `out`."""
    summary = {name: {k: statistics.fmean(r[name][k] for r in rows) for k in keys} for name in names}
    for name, s in summary.items():
        ratio = s["cont"] / summary["naive"]["cont"] if "naive" in summary else float("nan")
        accuracy = f" acc {s['acc']:.3f}" if "acc" in s else ""
        print(f"{name:10s} cont {s['cont']:.4f} ({ratio:.2f} naive) first {s['first']:.4f}{accuracy} "
              f"rec {s['rec']:.3f} ms {s['ms']:.0f}")
    Path(out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
