"""The RAG benchmark: every strategy on the same prompts, in one run, against a full prefill.

Per item, strategies run interleaved (their order rotated from item to item), after a warm-up, and
each is compared with `full` on the same tokens:

- ttft_ms: call to first-token logits (on a GPU, once they are computed: the engine waits for the device);
  speedup: full's TTFT / this TTFT, median over items.
- accuracy: an expected answer appears in the output (case-insensitive), where answers exist.
- agreement: the first `agree_tokens` generated tokens equal full's.
- first_token_kl / continuation_kl: KL(full || strategy) at the first token, and averaged over
  full's greedy output fed to both (teacher forcing): how far the cache is from the truth; first_logit_gap:
  max |logit - full's logit| over the vocabulary at the first token (summarized as the mean and the max over items).
- recompute_fraction / reuse_fraction: prompt tokens computed through every layer / reused.
- the noise floor (with a `floor` engine: the same model in another dtype): a full prefill there, scored as
  the strategies are. No user can tell apart answers that differ less than a change of dtype makes them differ.
- observed_fidelity (per guarded strategy): the guard's estimates (fidelity_estimate) of the answers it guarded
  against those that differ from full's, summed, as the shadow checks report them (fidelity.Observed); and
  shadow_checks: the shadow checks the bench's answers led to (shadow.py), once they have run, after the timed part;
  floors_checked: the floors those checks measured (another order, bf16) against what the curves calibrated at
  ingestion expected, and the refit ones (shadow.Shadow.floor_figures).
- floor_credit: per level held on average (fidelity.Account), the loans of floor risk its answers took from
  the answers before them, their sum, the credit left at the end and its cap (EngineConfig.floor_credit).

A strategy spec is a name with optional repair overrides: "cacheblend:recompute_ratio=0.3,taper=1".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .. import fidelity
from ..config import RepairConfig
from ..engine import Generation, KVBoost
from ..generation import SamplingParams
from ..prompts import layout as prompt_layout
from ..repair import names as strategy_names
from .data import BenchItem

FULL = "full"
SHADOW_DRAIN_S = 300.0  # the longest the report waits, after the timed part, for the shadow checks still queued
# The order floor: a full prefill of the same documents in reverse order, scored against full as a strategy is.
# A retriever's order is arbitrary, so users already accept answers that differ this often (issue 41).
ORDER_FLOOR = "full (documents reversed)"


@dataclass(frozen=True)
class StrategySpec:
    label: str
    strategy: str
    repair: RepairConfig


def _setting(current, value: str, label: str):
    """`value` as the type of the setting's current value; bool() of any non-empty text is True, so booleans
    are read by name."""
    if isinstance(current, bool):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{value!r} in {label!r} is not a boolean; use true or false")
        return value.lower() in ("true", "1")
    if isinstance(current, str):  # a name, or a number where the setting takes either (fidelity)
        try:
            return float(value)
        except ValueError:
            return value
    return float(value) if current is None else type(current)(value)  # None: a number not set (recompute_ratio)


def parse_strategies(text: str, base: RepairConfig) -> list[StrategySpec]:
    """"full,naive,cacheblend:recompute_ratio=0.3" -> specs; `full` always comes first."""
    specs, names = [], [s.strip() for s in text.split(";" if ";" in text else ",") if s.strip()]
    fields = {f.name: f.type for f in dataclasses.fields(RepairConfig)}
    for label in names:
        name, _, overrides = label.partition(":")
        if name not in strategy_names():
            raise ValueError(f"unknown strategy {name!r} in --strategies; use {', '.join(strategy_names())}")
        repair = base
        for pair in filter(None, overrides.split("+") if "+" in overrides else [overrides]):
            key, _, value = pair.partition("=")
            if key not in fields:
                raise ValueError(f"unknown repair setting {key!r} in {label!r}; use {', '.join(fields)}")
            repair = dataclasses.replace(repair, **{key: _setting(getattr(base, key), value, label)})
        specs.append(StrategySpec(label, name, repair))
    if FULL not in [s.label for s in specs]:
        specs.insert(0, StrategySpec(FULL, FULL, base))
    return sorted(specs, key=lambda s: s.label != FULL)


def render_prompt(item: BenchItem, layout: str = "bench") -> list[dict]:
    """The item's chat messages in a prompt layout (prompts.LAYOUTS; `bench`: the system text, then the documents
    in order, then the question)."""
    return prompt_layout(layout)(list(item.documents), item.question, item.system)


def kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) per row. logits: [T, V] -> [T]."""
    ref_logp, other_logp = reference.log_softmax(-1), other.log_softmax(-1)
    return (ref_logp.exp() * (ref_logp - other_logp)).sum(-1).clamp_min(0)


@dataclass
class Sample:
    ttft_ms: float
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    recomputed_tokens: int
    reused_tokens: int
    distributions: torch.Tensor  # [T, V] logits: first token, then after each of the reference's tokens
    result: Generation | None = None
    metrics: dict = field(default_factory=dict)


def continued_logits(engine: KVBoost, pre, first: torch.Tensor, token_ids) -> torch.Tensor:
    """`first` [1, V] followed by the logits after each of token_ids[:-1] fed to `pre`'s cache."""
    if len(token_ids) < 2:
        return first
    return torch.cat([first, engine.continuation_logits(pre, list(token_ids)[:-1])])


def floor_label(floor: KVBoost) -> str:
    return f"full ({floor.config.dtype})"


def run_item(engine: KVBoost, item: BenchItem, specs: list[StrategySpec], max_new_tokens: int,
             rotate: int, floor: KVBoost | None = None, layout: str = "bench",
             order_floor: bool = False) -> dict[str, Sample]:
    prompt = render_prompt(item, layout)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    order = specs[rotate % len(specs):] + specs[:rotate % len(specs)]
    samples: dict[str, Sample] = {}
    prefills = {}  # kept for teacher forcing below
    for spec in order:  # timed part: interleaved
        pre = engine.prefill(prompt, spec.strategy, max_new_tokens=max_new_tokens, write_back=False,
                             repair=spec.repair)
        result = list(engine.stream_from(pre, params))[-1].result
        samples[spec.label] = Sample(pre.ttft_ms, result.text, result.token_ids, pre.prompt_tokens,
                                     pre.recomputed_tokens, pre.reused_tokens, pre.logits[None], result)
        prefills[spec.label] = (engine, pre)
    if floor is not None:  # after the timed strategies: its TTFT is another dtype's, not a rival's
        # The engine's shadow checks run whenever it is idle, as it is while another engine prefills: they would
        # share the cores with the floor's prefill (its TTFT ran 0.87x float32's where a bf16 prefill is ~1.6x faster)
        engine.shadow.drain(timeout=SHADOW_DRAIN_S)
        pre = floor.prefill(prompt, FULL, max_new_tokens=max_new_tokens, write_back=False)
        result = list(floor.stream_from(pre, params))[-1].result
        samples[floor_label(floor)] = Sample(pre.ttft_ms, result.text, result.token_ids, pre.prompt_tokens,
                                             pre.recomputed_tokens, pre.reused_tokens, pre.logits[None].float(), result)
        prefills[floor_label(floor)] = (floor, pre)
    if order_floor and len(item.documents) > 1:  # untimed too: what another retrieval order gives
        reordered = dataclasses.replace(item, documents=item.documents[::-1])
        pre = engine.prefill(render_prompt(reordered, layout), FULL, max_new_tokens=max_new_tokens, write_back=False)
        result = list(engine.stream_from(pre, params))[-1].result
        samples[ORDER_FLOOR] = Sample(pre.ttft_ms, result.text, result.token_ids, pre.prompt_tokens,
                                      pre.recomputed_tokens, pre.reused_tokens, pre.logits[None], result)
        prefills[ORDER_FLOOR] = (engine, pre)
    # Quality: every strategy's cache scored on full's greedy continuation (teacher forcing).
    for label, sample in samples.items():
        runner, pre = prefills[label]
        sample.distributions = continued_logits(runner, pre, sample.distributions, samples[FULL].token_ids).float()
    return samples


def correct(text: str, answers: tuple[str, ...]) -> float:
    """1.0 when an expected answer appears in the text (case-insensitive)."""
    return float(any(a.lower() in text.lower() for a in answers))


def score(samples: dict[str, Sample], item: BenchItem, agree_tokens: int) -> None:
    for sample in samples.values():
        full = samples[FULL]
        n = min(len(sample.distributions), len(full.distributions))
        per_token = kl(full.distributions[:n], sample.distributions[:n])
        sample.metrics = {
            "ttft_ms": sample.ttft_ms,
            "speedup": full.ttft_ms / sample.ttft_ms,
            "total_ms": sample.result.total_ms,
            # the fidelity guard: predicted chance the answer differs from full's, a full prefill instead, an
            # exact cache for the tokens after some point
            "fidelity_estimate": sample.result.fidelity_estimate,
            "fell_back": float(sample.result.fell_back),
            "switched": float(sample.result.exact_from is not None and not sample.result.fell_back),
            # the ladder (repair/guard.py): some tokens served by a larger repair before any full prefill
            "escalated": float(any(s.step == "escalate" for s in sample.result.served)),
            # ... or by a full prefill in bf16 (the dtype floor's cache) before any in float32
            "halved": float(any(s.step == "half" for s in sample.result.served)),
            # held to `strict` (a `balanced` request: its documents are records of one template, guard.held_to)
            "held_strict": float(sample.result.fidelity == "strict"),
            # the whole answer differs from full's: what fidelity_estimate predicts
            "differs": float(sample.token_ids != full.token_ids),
            # a guarded strategy's answer: its fidelity_estimate is the guard's (others' are 0: nothing predicted)
            "guarded": sample.result.recompute_budget is not None,
            "agreement": float(sample.token_ids[:agree_tokens] == full.token_ids[:agree_tokens]),
            "first_token_kl": float(per_token[0]),
            "continuation_kl": float(per_token.mean()),
            "first_logit_gap": float((sample.distributions[0] - full.distributions[0]).abs().max()),
            "recompute_fraction": sample.recomputed_tokens / sample.prompt_tokens,
            "reuse_fraction": sample.reused_tokens / sample.prompt_tokens,
            "prompt_tokens": sample.prompt_tokens,
        }
        if sample.result.document_tokens:  # the found documents' tokens served from the store (issue 39's seams)
            sample.metrics["document_reuse"] = sample.result.document_tokens_reused / sample.result.document_tokens
        if item.answers:
            sample.metrics["accuracy"] = correct(sample.text, item.answers)


def summarize(per_item: list[dict[str, dict]], labels: list[str]) -> dict[str, dict]:
    summary = {}
    for label in labels:
        rows = [item[label] for item in per_item if label in item]  # the order floor needs two documents
        entry = {
            "ttft_ms": statistics.median(r["ttft_ms"] for r in rows),
            "speedup": statistics.median(r["speedup"] for r in rows),
            "total_ms": statistics.median(r["total_ms"] for r in rows),
        }
        for key in ("accuracy", "agreement", "first_token_kl", "continuation_kl", "first_logit_gap",
                    "recompute_fraction", "reuse_fraction", "document_reuse", "prompt_tokens", "fidelity_estimate",
                    "fell_back", "switched", "escalated", "halved", "held_strict", "differs"):
            values = [r[key] for r in rows if key in r]
            entry[key] = statistics.fmean(values) if values else None
        gaps = [r["first_logit_gap"] for r in rows if "first_logit_gap" in r]
        entry["max_first_logit_gap"] = max(gaps) if gaps else None
        # The guard's estimates against what happened, as the shadow checks report them (fidelity.Observed).
        guarded = [r for r in rows if r.get("guarded")]
        observed = fidelity.Observed(answers=len(guarded),
                                     predicted_differ=sum(r["fidelity_estimate"] for r in guarded),
                                     observed_differ=int(sum(r["differs"] for r in guarded)))
        entry["observed_fidelity"] = observed.answer_figures() if guarded else None
        if label != "full":
            entry |= paired_accuracy(per_item, label) or {}
        summary[label] = entry
    return summary


def paired_accuracy(per_item: list[dict[str, dict]], label: str) -> dict | None:
    """Accuracy paired with full's on the items both were scored on: those full answered right and `label` did not
    (lost), the reverse (won), and the sign test's p on them, whether the difference is within noise (issue 41's
    rule is lost - won). None where the set has no answers."""
    pairs = [(item["full"]["accuracy"], item[label]["accuracy"]) for item in per_item
             if "accuracy" in item.get(label, {}) and "accuracy" in item.get("full", {})]
    if not pairs:
        return None
    lost, won = sum(f > g for f, g in pairs), sum(f < g for f, g in pairs)
    return {"lost": lost, "won": won, "sign_test_p": sign_test(lost, won)}


def sign_test(lost: int, won: int) -> float:
    """The exact two-sided sign test's p on the items that changed: how likely a split at least this uneven is when
    either way is as likely. Three lines of binomial tail rather than scipy, which nothing else here needs."""
    n, k = lost + won, min(lost, won)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def read_stored(engine: KVBoost, items: list[BenchItem], layout: str = "bench") -> None:
    """Read every item's stored documents once, untimed. A document stored by an earlier run is read from disk on
    first use, inside whichever strategy's TTFT comes first; a server that has served it holds it in memory."""
    for item in items:
        engine.plan(render_prompt(item, layout), "naive")


def store_shared_prefix(engine: KVBoost, item: BenchItem, layout: str = "bench") -> None:
    """Classic prefix caching keeps the prompt's text before its first document (the template's opening and the
    system text, shared by every request): store it once, as a server would have."""
    rendered = engine.render(render_prompt(item, layout))
    first_doc = min((rendered.find(d.strip()) for d in item.documents if d.strip() in rendered), default=-1)
    if first_doc > 0:
        engine.prefill(rendered[:first_doc], "prefix")


def check_fits(engine: KVBoost, items: list[BenchItem], max_new_tokens: int, layout: str = "bench") -> None:
    """Refuse, before the slow part (ingestion and calibration take minutes on long documents), a set whose prompts
    would not fit the context window with their answers: every such item is named, not the first one met
    mid-run."""
    over = []
    for item in items:
        n = len(engine.tokenize(engine.render(render_prompt(item, layout))).prompt_ids)
        if n + max_new_tokens > engine.adapter.max_context:
            over.append(f"{item.id} ({n} tokens)")
    if over:
        raise ValueError(f"{len(over)} of {len(items)} items' prompts plus {max_new_tokens} new tokens exceed the "
                         f"model's context window ({engine.adapter.max_context}): {', '.join(over[:10])}"
                         f"{' and more' if len(over) > 10 else ''}; leave them out of the data or shorten their "
                         "documents")


def run_bench(engine: KVBoost, items: list[BenchItem], specs: list[StrategySpec], *, max_new_tokens: int = 16,
              agree_tokens: int = 16, progress: bool = True, drift_prompts: int = 0,
              floor: KVBoost | None = None, layout: str = "bench", order_floor: bool = False) -> dict:
    """Ingest every document (untimed), fit drift maps on them when asked, warm up, then measure; returns
    the JSON-ready report. With `floor` (the model in another dtype), its full prefill is one more row (the dtype
    floor); with `order_floor`, a full prefill of the documents in reverse order is another."""
    started = time.perf_counter()
    check_fits(engine, items, max_new_tokens, layout)
    checked = engine.shadow.observed()  # an engine that served before: only the bench's checks are reported
    engine.ingest([d for item in items for d in item.documents], progress=progress)
    calibrated = engine.predictor  # what the floors' curves were before the checks of the bench's answers refit them
    if drift_prompts > 0:
        engine.fit_drift(prompts=drift_prompts)
    read_stored(engine, items, layout)
    for item in items[:1]:
        store_shared_prefix(engine, item, layout)
        run_item(engine, item, specs, max_new_tokens, 0, floor, layout, order_floor)  # warm-up, discarded
    per_item = []
    for i, item in enumerate(tqdm(items, desc="bench", unit="item", disable=not progress)):
        samples = run_item(engine, item, specs, max_new_tokens, i, floor, layout, order_floor)
        score(samples, item, agree_tokens)
        per_item.append({label: s.metrics for label, s in samples.items()} | {"id": item.id})
    labels = [s.label for s in specs] + ([floor_label(floor)] if floor is not None else [])
    labels += [ORDER_FLOOR] if order_floor and any(ORDER_FLOOR in r for r in per_item) else []
    report = {
        "model": engine.model_id,
        "dtype": engine.config.dtype,
        "device": str(engine.adapter.device),
        "kv_bits": engine.config.store.kv_bits,
        "items": len(items),
        "max_new_tokens": max_new_tokens,
        "agree_tokens": agree_tokens,
        "layout": layout,
        "drift_prompts": engine.drift.prompts if engine.drift is not None else 0,  # 0: stored K/V as they are
        "seconds": round(time.perf_counter() - started, 1),
        "strategies": summarize([{k: v for k, v in r.items() if k != "id"} for r in per_item], labels),
        "per_item": per_item,
    }
    # The shadow checks the guarded answers led to (shadow.py) run while the engine is idle, between the bench's
    # requests and after them: those still queued are waited for here, outside `seconds`.
    engine.shadow.drain(timeout=SHADOW_DRAIN_S)
    shadow = engine.shadow.observed() - checked
    report["shadow_checks"] = shadow.figures() if shadow.checks else None
    report["floors_checked"] = engine.shadow.floor_figures(calibrated) if shadow.checks else None
    report["floor_credit"] = {level: account.figures() for level, account in engine.accounts.items()}
    report["ladder_trials"] = engine.shadow.figures()["trials"]  # the engine's: every one of its requests
    return report
