"""How cost grows with the prompt: every strategy's TTFT against a full prefill's at several prompt sizes.

Prompts of about each target size are built from a bench set (the bundled synthetic_k8.jsonl by default): one
item's question and its documents, last and as the item has them, after documents of the items that follow it,
as many as come nearest the target (an item too long for a small target keeps its answer's document and drops
others). No document is in two prompts. Every document is ingested as a user ingests them, `KVBoost.ingest` then
the calibration it runs by itself (timed apart). Per prompt the strategies run interleaved, their order rotated,
after one warm-up run of each size's first prompt, and each is compared with `full` on the same tokens with
`run.py`'s metrics; a size's figures are medians (times) and means (quality) over its prompts.

Only sizes that fit the model's context window with the new tokens are measured; the others are reported as
refused, with the window's size (the bundled SmolLM2-135M's is 8192, its max_position_embeddings: no 16k prompt).
"""

from __future__ import annotations

import collections
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from .. import calibrate as calibration
from .. import models
from ..engine import KVBoost
from .data import BenchItem
from .run import FULL, StrategySpec, read_stored, render_prompt, run_item, score, store_shared_prefix, summarize

DEFAULT_SIZES = (1000, 2000, 4000, 8000)
DEFAULT_STRATEGIES = "full,prefix,naive,cacheblend"


@dataclass(frozen=True)
class SizedPrompt:
    target: int  # the size asked for, in prompt tokens
    tokens: int  # the prompt's tokens as the engine plans them
    item: BenchItem  # its documents, question and answers


def token_counter(engine: KVBoost) -> Callable[[BenchItem], int]:
    """An item's prompt tokens as the engine tokenizes it (chat template, BOS), without the store."""

    def count(item: BenchItem) -> int:
        return sum(len(tokens) for tokens, _ in engine.tokenize(engine.render(render_prompt(item))).chunks)

    return count


def _nearest(target: int, below: int, above: int) -> bool:
    """Whether `above` tokens (the document just added) is at least as near the target as `below` (without it)."""
    return abs(above - target) <= abs(target - below)


def build_prompts(items: Sequence[BenchItem], sizes: Sequence[int], per_size: int,
                  count: Callable[[BenchItem], int]) -> list[SizedPrompt]:
    """`per_size` prompts of about each of `sizes` tokens (`count` measures one), from `items` in order."""
    prompts: list[SizedPrompt] = []
    at, spare = 0, collections.deque()  # the next item; documents drawn from items before it, not used yet

    def next_item() -> BenchItem:
        nonlocal at
        if at >= len(items):
            raise ValueError(f"the set's {len(items)} items are too few for {per_size} prompt(s) of each of "
                             f"{', '.join(map(str, sizes))} tokens; ask for fewer prompts or smaller sizes")
        at += 1
        return items[at - 1]

    def draw() -> str:
        while not spare:
            spare.extend(next_item().documents)
        return spare.popleft()

    for target in sizes:
        for _ in range(per_size):
            question = next_item()
            prompt = _trimmed(question, target, count)
            tokens = count(prompt)
            while tokens < target:
                doc = draw()
                longer = replace(prompt, documents=(doc, *prompt.documents),
                                 answer_doc=None if prompt.answer_doc is None else prompt.answer_doc + 1)
                more = count(longer)
                if not _nearest(target, tokens, more):
                    spare.appendleft(doc)  # not used: the next prompt's
                    break
                prompt, tokens = longer, more
            prompts.append(SizedPrompt(target, tokens, replace(prompt, id=f"{question.id}@{target}")))
    return prompts


def _trimmed(item: BenchItem, target: int, count: Callable[[BenchItem], int]) -> BenchItem:
    """`item`, or, when it is longer than `target` tokens, it without its first documents other than the answer's
    (the one its answer is in, when the set says), as few as bring it nearest the target."""
    tokens = count(item)
    while tokens > target and len(item.documents) > 1:
        drop = 1 if item.answer_doc == 0 else 0
        shorter = replace(item, documents=item.documents[:drop] + item.documents[drop + 1:],
                          answer_doc=None if item.answer_doc is None else item.answer_doc - (drop < item.answer_doc))
        fewer = count(shorter)
        if _nearest(target, fewer, tokens):
            break
        item, tokens = shorter, fewer
    return item


def ingest(engine: KVBoost, texts: Sequence[str], progress: bool) -> dict:
    """Ingest `texts` as KVBoost.ingest does (encode and store, then calibrate when due), the two timed apart."""
    tokens = sum(len(engine.document(t).token_ids) for t in texts)
    before = collections.Counter(engine.counters)
    started = time.perf_counter()
    engine.ingest(list(texts), progress=progress, calibrate=False)
    if engine.adapter.device.type == "cuda":  # the last forwards may still be running
        torch.cuda.synchronize(engine.adapter.device)
    # Four decimals, and the rate from the figure reported, so the two agree on a fast ingest (tens of ms).
    encoded = max(round(time.perf_counter() - started, 4), 1e-4)
    # What ingest(texts) runs next by itself (EngineConfig.calibrate, on by default), called here to time it apart.
    calibrated = engine.config.calibrate and calibration.due(engine)
    started = time.perf_counter()
    if calibrated:
        engine.calibrate(progress=progress)
    computed = engine.counters["documents_computed"] - before["documents_computed"]
    return {"documents": len(texts), "tokens": tokens, "computed": computed,
            "stored_already": engine.counters["documents_stored"] - before["documents_stored"],
            "seconds": encoded, "tokens_per_s": round(tokens / encoded, 1) if computed else None,
            "calibrated": bool(calibrated), "calibration_s": round(time.perf_counter() - started, 3) if calibrated
            else 0.0}


def device_name(device: torch.device) -> str:
    """The GPU's name (torch.cuda.get_device_name), or the CPU's, its threads and whether it has bf16 instructions
    (timing in bf16 means something only where it has them: models.native_matmuls)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = models.cpu_capabilities().get("cpu_name") or platform.processor() or platform.machine()
    native = models.native_matmuls(torch.bfloat16, device)
    return f"CPU {name}, {torch.get_num_threads()} threads, {'with' if native else 'no'} bf16 instructions"


def run_scaling(engine: KVBoost, items: Sequence[BenchItem], specs: list[StrategySpec], *,
                sizes: Sequence[int] = DEFAULT_SIZES, per_size: int = 3, max_new_tokens: int = 8,
                progress: bool = True, log: Callable[[str], None] = lambda line: None) -> dict:
    """Measure every spec at every size that fits the context window; returns the JSON-ready report. `log` gets a
    line per stage (what a run cut short still shows)."""
    started = time.perf_counter()
    window = engine.adapter.max_context
    fits = [s for s in sizes if s + max_new_tokens <= window]
    refused = [{"target": s, "reason": f"{s} prompt tokens + {max_new_tokens} new exceed {engine.model_id}'s "
                                      f"context window of {window} tokens"} for s in sizes if s not in fits]
    if not fits:
        raise ValueError(f"no size fits: {refused[0]['reason']}; use --sizes at most {window - max_new_tokens}, or a "
                         "model with a longer context")
    prompts = build_prompts(items, fits, per_size, token_counter(engine))
    over = [p for p in prompts if p.tokens + max_new_tokens > window]
    if over:  # a target just under the window, overshot by the last document
        raise ValueError(f"prompt {over[0].item.id} came to {over[0].tokens} tokens, past the context window "
                         f"({window}) with {max_new_tokens} new ones; ask for a smaller size")
    texts = list(dict.fromkeys(d for p in prompts for d in p.item.documents))
    for r in refused:
        log(f"refused: {r['reason']}")
    ingestion = ingest(engine, texts, progress)
    log(f"ingested {ingestion['documents']} documents, {ingestion['tokens']} tokens, in {ingestion['seconds']} s; "
        f"calibration {ingestion['calibration_s']} s")
    read_stored(engine, [p.item for p in prompts])
    store_shared_prefix(engine, prompts[0].item)
    agree = min(16, max_new_tokens)
    per_prompt, warmed = [], set()
    for rotate, p in enumerate(tqdm(prompts, desc="scaling", unit="prompt", disable=not progress)):
        if p.target not in warmed:  # each size's shapes are new to the kernels: one run of it discarded
            run_item(engine, p.item, specs, max_new_tokens, 0)
            warmed.add(p.target)
        samples = run_item(engine, p.item, specs, max_new_tokens, rotate)
        score(samples, p.item, agree)
        full = samples[FULL]
        row = {"id": p.item.id, "target": p.target}
        for label, s in samples.items():
            row[label] = s.metrics | {
                "ttft_ratio": s.ttft_ms / full.ttft_ms,
                "first_token_agreement": float(s.token_ids[:1] == full.token_ids[:1]),
                "first_logit_gap": float((s.distributions[0] - full.distributions[0]).abs().max()),
            }
        per_prompt.append(row)
        log(f"{p.item.id}: {p.tokens} tokens, TTFT " + ", ".join(f"{label} {s.ttft_ms:.1f} ms"
                                                                 for label, s in samples.items()))
    labels = [s.label for s in specs]
    rows = []
    for target in fits:
        mine = [r for r in per_prompt if r["target"] == target]
        summary = summarize([{k: v for k, v in r.items() if k not in ("id", "target")} for r in mine], labels)
        for label in labels:
            summary[label]["ttft_ratio"] = statistics.median(r[label]["ttft_ratio"] for r in mine)
            for key in ("first_token_agreement", "first_logit_gap"):
                summary[label][key] = statistics.fmean(r[label][key] for r in mine)
        rows.append({"target": target, "prompts": len(mine),
                     "prompt_tokens": statistics.median(r[FULL]["prompt_tokens"] for r in mine),
                     "strategies": summary})
    return {
        "kind": "scaling",
        "model": engine.model_id,
        "dtype": engine.config.dtype,
        "device": str(engine.adapter.device),
        "device_name": device_name(engine.adapter.device),
        "torch": torch.__version__,
        "kv_bits": engine.config.store.kv_bits,
        "context_window": window,
        "per_size": per_size,
        "max_new_tokens": max_new_tokens,
        "agree_tokens": agree,
        "ingest": ingestion,
        "sizes": rows,
        "refused": refused,
        "seconds": round(time.perf_counter() - started, 1),
        "per_prompt": per_prompt,
    }
