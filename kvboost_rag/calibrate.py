"""Calibration on the corpus: the drift maps and the fidelity guard's predictor, fitted in one pass.

Run by `KVBoost.ingest` by itself once the engine knows MIN_DOCUMENTS documents, and again whenever the corpus has
doubled since and grown by REFIT_GROWTH documents, so its cost stays a bounded share of ingestion: per prompt, one
full prefill (the drift maps' truth) and its greedy answer, then one repaired prefill teacher-forced on it per
recompute budget a guarded request may be served at (three by default: the levels' and the ladder's ceiling), shown
in a progress bar. `KVBoost.calibrate` runs it on demand. Both results are saved next to the store's disk tier under
the engine's fingerprint, and in its Redis tier when it has one (the same safetensors bytes,
`kvboost:{fingerprint[:16]}:calibration:drift` and `:fidelity`), so that a restarted server or another process on the
same Redis starts calibrated. An engine takes them up when it starts (the file first, else Redis), and `due` looks
again before fitting: another process may have calibrated this corpus meanwhile. A copy from another model, dtype,
tokenizer or encoding, of an older format or damaged is refused, warned about and fitted again (drift.from_bytes,
fidelity.from_bytes); an unreachable Redis is a StoreUnavailableWarning and no calibration from it.

Drives the engine through its public methods; the engine imports this module, not the other way round.
"""

from __future__ import annotations

import dataclasses
import random
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import drift, fidelity, models
from .adapter import ModelAdapter
from .assembly import APPROX
from .generation import SamplingParams
from .prompts import layout as named_layout
from .repair.guard import appended, escalations, half_cache
from .store.files import make_dir, write_atomic
from .store.tiered import redis_tier

MIN_DOCUMENTS = 8  # fewer documents than this make too few distinct prompts to fit on
REFIT_GROWTH = 32  # a refit also needs this many new documents: 8 -> 16 changes the prompts drawn, not the fit
PROMPTS = 12  # calibration prompts per fit: ~12 x 1.5k-token prompts, ~80 s fp32 on the bundled model
PER_PROMPT = 8  # documents per calibration prompt: about what a retriever returns
TOKENS = 16  # answer tokens per calibration prompt


def due(engine) -> bool:
    """Whether ingestion should calibrate now: enough documents, and none fitted or the corpus doubled since, nor
    saved meanwhile by another engine on the same store (then this one takes that calibration up instead)."""
    if not _stale(engine, engine.predictor):
        return False
    predictor = saved(engine, "fidelity", accept=lambda p: not _stale(engine, p))
    if predictor is None:
        return True
    maps = saved(engine, "drift")  # fitted in the same pass
    engine.predictor, engine.drift = predictor, maps if maps is not None else engine.drift
    return False


def _stale(engine, predictor: fidelity.Predictor | None) -> bool:
    known = len(engine.documents)
    if known < MIN_DOCUMENTS:
        return False
    if predictor is None:
        return True
    fitted = predictor.documents
    return known >= 2 * fitted and known - fitted >= REFIT_GROWTH


# What each calibration is called where it is refused, and what happens next.
_KINDS = {"drift": ("drift maps", "refit them with fit_drift()"),
          "fidelity": ("fidelity calibration", "the next ingest fits it again")}


def _path(engine, name: str) -> Path | None:
    return engine.drift_path if name == "drift" else engine.fidelity_path


def saved(engine, name: str, accept: Callable = lambda value: True):
    """The saved calibration `name` ("drift": the maps, on the engine's device; "fidelity": the predictor): the
    first of the disk tier's file and the Redis tier's value that is this engine's, whole and `accept`ed; None
    when there is none. A copy the checks refuse is warned about and never used."""
    path, redis = _path(engine, name), redis_tier(engine.store)
    sources = []
    if path is not None and path.exists():
        sources.append((str(path), lambda: _file_bytes(path)))
    if redis is not None:
        sources.append((f"{redis.calibration_key(name)} in the Redis store at {redis.url}",
                        lambda: redis.read_calibration(name)))  # None when absent or unreachable (warned there)
    what, then = _KINDS[name]
    for where, read in sources:
        data = read()
        if data is None:
            continue
        if name == "drift":
            value = drift.from_bytes(data, engine.fingerprint, engine.adapter)
            value = value.to(engine.adapter.device) if value is not None else None
        else:
            value = fidelity.from_bytes(data, engine.fingerprint)
        if value is None:
            warnings.warn(f"ignoring {what} {where}: not this model's, from an older kvboost-rag, or damaged; {then}",
                          stacklevel=3)
        elif accept(value):
            return value
    return None


def save(engine, name: str, data: bytes) -> None:
    """Keep calibration `name` (its to_bytes) beside the store: a file beside the disk tier, a value in the Redis
    tier (one Redis does not take is warned about there, never raised)."""
    path, redis = _path(engine, name), redis_tier(engine.store)
    if path is not None:
        make_dir(path.parent, engine.config.store.file_mode)
        write_atomic(path, data, engine.config.store.file_mode)
    if redis is not None:
        redis.write_calibration(name, data)


def _file_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # unreadable: refused as damaged
        return b""


def corpus_prompts(engine, texts: Sequence[str], count: int, per_prompt: int, seed: int = 0,
                   layout: Callable | None = None) -> list:
    """`count` prompts of `per_prompt` of `texts` laid out by `layout` (documents -> the application's prompt;
    the default is the documents alone as one user message), each within the context window."""
    room = engine.adapter.max_context - 64  # room for the layout's text around the documents
    return drift.calibration_prompts(texts, lambda text: len(engine.document(text).token_ids), room, count,
                                     per_prompt, seed, layout or drift.bare_layout)


def drift_samples(engine, prompts: Sequence) -> list[tuple[torch.Tensor, list]]:
    """What drift.fit takes from each prompt: its token ids and its reused (content-hit) chunks."""
    samples = []
    for prompt in prompts:
        p = engine.plan(prompt, "naive")
        if p.num_tokens <= engine.adapter.max_context:
            samples.append((p.token_ids, [c for c in p.chunks if c.source == APPROX]))
    return samples


def fit_drift(engine, texts: Sequence[str] | None = None, *, prompts: int = 24, per_prompt: int = PER_PROMPT,
              seed: int = 0, layout: Callable | None = None, places: int = drift.PLACES) -> drift.DriftMaps:
    """Drift maps alone (see drift.py): `prompts` prompts of `per_prompt` documents drawn from `texts` (ingested
    first), or from every ingested document, laid out by `layout`, with one map per place for a prompt's first
    `places` documents (the last serving every later one). About one full prefill per prompt."""
    pool = list(texts) if texts is not None else engine.documents.texts()
    if texts is not None:
        engine.ingest(pool, progress=False, calibrate=False)
    if len(pool) < 2:
        raise ValueError(f"fit_drift needs at least two ingested documents, got {len(pool)}: ingest the "
                         "corpus first")
    with engine.lock:
        maps = drift.fit(engine.adapter, drift_samples(engine, corpus_prompts(engine, pool, prompts, per_prompt,
                                                                              seed, layout)), places)
        engine.set_drift(maps)
    return maps


def question_for(documents: Sequence[str], rng: random.Random) -> str:
    """A question about one of `documents`, as users ask them: what the documents say of a name it holds (a
    capitalised word not opening a sentence), else of the words opening one of its sentences. Calibration answers
    then read the documents as real answers do, instead of continuing the last one."""
    text = rng.choice(list(documents))
    names = re.findall(r"(?<=[a-z,;] )[A-Z][\w-]+(?: [A-Z][\w-]+)*", text)
    if names:
        return f"What do the documents say about {rng.choice(names)}?"
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 4] or [text]
    return f'What do the documents say about "{" ".join(rng.choice(sentences).split()[:4])}"?'


@dataclasses.dataclass(frozen=True)
class CalibrationPrompt:
    prompt: object  # chat messages or text: the documents in the order drawn, laid out with a question
    reordered: object  # the same documents in reverse order: what the order floor answers


def calibration_set(engine, texts: Sequence[str], count: int, per_prompt: int, seed: int = 0,
                    layout: str | Callable | None = None) -> list[CalibrationPrompt]:
    """`count` prompts of `per_prompt` of `texts`, each with a question about its documents, laid out as the
    application lays them out: `layout` is a name in prompts.LAYOUTS (EngineConfig.calibration_layout by default)
    or a callable (documents, question) -> prompt."""
    name = layout if layout is not None else engine.config.calibration_layout
    arrange = named_layout(name) if isinstance(name, str) else name
    rng = random.Random(seed + 1)

    def both_orders(group: list[str]) -> CalibrationPrompt:
        question = question_for(group, rng)
        return CalibrationPrompt(arrange(group, question), arrange(group[::-1], question))

    return corpus_prompts(engine, texts, count, per_prompt, seed, both_orders)


def calibrate(engine, texts: Sequence[str] | None = None, *, prompts: int | None = None,
              per_prompt: int = PER_PROMPT, seed: int = 0, layout: str | Callable | None = None,
              progress: bool | None = None) -> fidelity.Predictor:
    """Fit the drift maps (when the engine's repair maps drift), then the fidelity guard's flip curve and the two
    floors its levels are held to, on prompts of the corpus's documents with questions, laid out by `layout` (see
    calibration_set); the engine uses them from now on.

    The curves' samples: for each prompt, a full prefill's greedy answer (TOKENS tokens), and the default
    strategy's cache teacher-forced on it, once per recompute budget the fidelity levels run at (see _flips). The
    floors: where a full prefill of the same documents in reverse order (the order floor), and one in the other
    dtype (the dtype floor), choose another token than that answer, teacher-forced: a curve each, on the same
    margins (see fidelity.py)."""
    pool = list(texts) if texts is not None else engine.documents.texts()
    if len(pool) < MIN_DOCUMENTS:
        raise ValueError(f"calibration needs at least {MIN_DOCUMENTS} ingested documents, got {len(pool)}: "
                         "ingest more of the corpus first")
    drawn = calibration_set(engine, pool, prompts or PROMPTS, per_prompt, seed, layout)
    laid_out = [c.prompt for c in drawn]
    # Pass 2 runs once per recompute budget a guarded request may be served at (balanced's first: the engine's
    # own), a curve each: the levels' budgets and the ladder's escalations above them (EngineConfig.escalate_to),
    # so that an escalation is judged by a curve of its own budget, not by a smaller budget's cautious one.
    repair = engine.config.repair
    ladders = {level: _ladder(engine, level) for level in fidelity.LEVELS}
    budgets = list(dict.fromkeys([repair.budget] + sorted({b for ladder in ladders.values() for b in ladder})))
    bar = tqdm(total=(2 + len(budgets)) * len(laid_out), desc="calibrating", unit="prompt",
               disable=not progress if progress is not None else None)
    with engine.lock:
        # Pass 1, per prompt: one full prefill gives both the drift maps' truth (its K/V) and the greedy answer.
        sums = drift.NormalEquations.empty(engine.adapter, drift.PLACES) if engine.config.repair.drift else None
        answers, prompt_ids = [], []
        for prompt in laid_out:
            full = engine.prefill(prompt, "full", max_new_tokens=TOKENS, write_back=False)
            prompt_ids.append(full.plan.token_ids)
            if sums is not None:
                reused = [c for c in engine.plan(prompt, "naive").chunks if c.source == APPROX]
                drift.add_prompt(engine.adapter, sums, reused, *full.cache.span(0, full.prompt_tokens))
            *_, last = engine.stream_from(full, SamplingParams(TOKENS))
            answers.append(list(last.result.token_ids))
            bar.update(1)
        if sums is not None and sums.prompts:
            engine.set_drift(drift.solve(sums))
        order_flips, dtype_flips, half_steps = _floor_flips(engine, drawn, prompt_ids, answers, bar)
        # Pass 2, with the maps: the default strategy's cache, repaired at each budget, teacher-forced on each
        # full answer; the floors' flips fitted against the same margins.
        curves, margins_at = [], {}
        for budget in budgets:
            margins, flipped = _flips(engine, laid_out, answers, budget, bar)
            floors = tuple(fidelity.fit(margins, flips, len(engine.documents), budget)
                           for flips in (order_flips, dtype_flips))
            # The floors are fitted as measured (a floor raised would loosen the level it holds), the curve is
            # fitted cautious where it saw few flips (fidelity.fit's pseudo_flips).
            curve = fidelity.fit(margins, flipped, len(engine.documents), budget, pseudo_flips=fidelity.PSEUDO_FLIPS)
            curves.append(dataclasses.replace(curve, floors=floors))
            margins_at[budget] = margins
        bar.close()
        # The shadow checks' figures stay with the store's curve (shadow.py): they judge the guard in service,
        # whichever curve it ran.
        observed = engine.predictor.observed if engine.predictor is not None else None
        half = fit_half(*half_steps, dtype_flips, len(engine.documents)) if half_steps[0] else None
        predictor = dataclasses.replace(curves[0], half=half, observed=observed).with_others(curves[1:])
        _seed_routes(engine, predictor, ladders, margins_at, [len(answer) for answer in answers])
        engine.set_predictor(predictor)  # saved with the routes seeded
        engine.counters["calibrations"] += 1
    return predictor


def _ladder(engine, level: str) -> tuple[float, ...]:
    """The budgets a request of `level` is repaired at: its own, then its ladder's escalations (repair/guard.py)."""
    settings = dataclasses.replace(engine.config.repair, fidelity=level)
    return settings.budget, *escalations(settings, engine.config.escalate_to)


def fit_half(margins: Sequence[float], flipped: Sequence[bool], dtype_flips: Sequence[bool],
             documents: int = 0) -> fidelity.Predictor:
    """The HALF step's own curve (fidelity.Predictor.half) from what the step served at calibration's steps, fitted
    as measured where it saw its share of flips: they are rare everywhere (0 to 4 in 192 calibration tokens), where
    one pseudo-flip doubles its estimate. But raised to expect at least half the flips bf16 throughout made on the
    same tokens (`dtype_flips`; the step's first token is a bf16 prefill's, the rest decode on in float32, which
    flips about half as often: 21% of answers against 42%): fitted plain on none where bf16 made three, it predicted
    0.008 differing answers where 0.167 did (SmolLM2, fidelity_holdout 1-24; research/half_curve.py,
    docs/method.md)."""
    raised = max(0.0, sum(dtype_flips) / 2 - sum(flipped))
    return fidelity.fit(margins, flipped, documents, 1.0, pseudo_flips=raised)


def _seed_routes(engine, predictor: fidelity.Predictor, ladders: dict[str, tuple[float, ...]],
                 margins_at: dict[float, list[float]], lengths: Sequence[int]) -> None:
    """Give the engine's ladder routes (repair/routes.py) what calibration has seen, so that its first requests do
    not pay to learn it: per level that acts and each budget its ladder repairs at, whether the guard would have
    served each calibration answer to its end from that budget's cache (its margins, teacher-forced on full's
    answer, judged as a request of that level from its first token). A level held on average is judged as it is
    served: the answers in turn, each borrowing from an account that starts empty and that the answers before
    lent to (an answer left part-way counts the floor's risk over the rest at the same margins, as an exact
    cache's tokens count). The repairs' and the full prefills' times were recorded as they ran."""
    for level in ("balanced", "strict"):
        for budget in ladders[level]:
            curve, start = predictor.at(budget), 0
            held_on_average = engine.accounts.get(level)
            account = fidelity.Account(held_on_average.cap) if held_on_average is not None else None
            for length in (n for n in lengths if n):  # an empty answer has no margins: nothing to judge
                watched = fidelity.Guard(curve, fidelity.target_for(level, curve), fidelity.target_of(level), account)
                margins, held = margins_at[budget][start:start + length], True
                for m in margins:
                    if held:
                        held = watched.admits(m)
                    if not held:
                        watched.passes(m)
                watched.settle()
                engine.routes.judged(("cacheblend", level, budget), held)
                start += length


def _floor_flips(engine, drawn: Sequence[CalibrationPrompt], prompt_ids: Sequence[torch.Tensor],
                 answers: Sequence[list[int]], bar) -> tuple[list[bool], list[bool], tuple[list, list]]:
    """The floors' flips at every step of every full answer, in _flips's order: whether a full prefill of the
    documents reversed (the order floor), and one of the model in the other dtype (the dtype floor), choose
    another token there (teacher-forced, so every step is judged after the same tokens). And where the engine has
    a bf16 model for the ladder's HALF step, that step's margins and flips at the same steps (_half_steps; else
    none). `prompt_ids`: each prompt's tokens as its full prefill ran them."""
    # The bf16 model the ladder's HALF step serves from (repair/guard.py), where the engine has one (float32, bf16
    # native, bf16_step on).
    half = engine.half_adapter()
    # The floor's copy runs whole teacher-forced prefills only, past the rows transposed copies serve (packing.py).
    other = half if half is not None else ModelAdapter(_other_dtype(engine.adapter.model), transposed_weights=False)
    order, dtype, half_margins, half_flips = [], [], [], []
    for item, ids, answer in zip(drawn, prompt_ids, answers, strict=True):
        if answer:
            order += _changes(_forced(engine.adapter, engine.plan(item.reordered, "full").token_ids, answer), answer)
            dtype += _changes(_forced(other, ids, answer), answer)
            if half is not None:
                margins, flipped = _half_steps(engine, half, ids, answer)
                half_margins += margins
                half_flips += flipped
        bar.update(1)
    del other
    return order, dtype, (half_margins, half_flips)


@torch.inference_mode()
def _forced(adapter: ModelAdapter, prompt_ids: torch.Tensor, answer: list[int]) -> torch.Tensor:
    """A full prefill of the prompt and the answer but its last token by `adapter`: its next-token logits [T, V] at
    each step of `answer` (row t chooses answer token t). Only those rows go through the LM head: over every
    position (the model's own forward), Gemma 3's 262k-token head cost as much as the layers."""
    n, ids = prompt_ids.shape[0], prompt_ids.tolist() + list(answer[:-1])
    return adapter.logits(appended(adapter, adapter.new_buffers(len(ids)), 0, ids)[:, n - 1:])


def _changes(logits: torch.Tensor, answer: list[int]) -> list[bool]:
    """At each step of `answer`, whether `logits` [T, V] pick another token."""
    return (logits.argmax(-1).cpu() != torch.tensor(answer)).tolist()


@torch.inference_mode()
def _half_steps(engine, half, prompt_ids: torch.Tensor, answer: list[int]) -> tuple[list[float], list[bool]]:
    """What the HALF step serves at each step of `answer`, teacher-forced: its margin and whether its token is not
    the answer's. Not the dtype floor's flips: the step decodes on in float32 from the bf16 prefill's K/V, which
    flips fewer of the later tokens than bf16 throughout (fidelity_holdout, SmolLM2, 64 tokens: 21% of its answers
    differ from full's where a bf16 full prefill's 42% do; a curve fitted on the floor's flips predicted 51%). Its
    own prefill of the prompt, not the dtype floor's of the prompt and the answer: the same K/V in exact arithmetic,
    but the step's curve rests on 0-2 flips in 192 tokens, which bf16 rounding moves (Gemma fidelity_holdout 49-72:
    from the floor's prefill, 0.015 predicted against 0.083 observed; docs/method.md)."""
    n, adapter = prompt_ids.shape[0], engine.adapter
    cache, first = half_cache(adapter, half, engine.lock, prompt_ids, n + len(answer))
    steps = first[None]  # [T, V]: row t chooses answer token t
    if len(answer) > 1:
        with engine.lock:
            steps = torch.cat([steps, adapter.logits(appended(adapter, cache, n, answer[:-1]))])
    return [fidelity.margin(row) for row in steps], _changes(steps, answer)


def _other_dtype(model):
    """The model in the dtype users compare ours with: bf16 for a float32 engine (models.bf16_copy: in float32
    kernels where bf16 is emulated), float32 for the others."""
    if next(model.parameters()).dtype == torch.float32:
        return models.bf16_copy(model)
    return models.in_dtype(model, torch.float32)


def _flips(engine, prompts: Sequence, answers: Sequence[list[int]], budget: float, bar) -> tuple[list, list]:
    """At every step of every full answer, the cache repaired at `budget`'s margin and whether its top token
    differs from the full prefill's there (the situation of a guarded request whose answer so far is full's)."""
    unguarded = dataclasses.replace(engine.config.repair, fidelity="fast", recompute_ratio=budget)
    margins, flipped = [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        if answer:
            reused = engine.prefill(prompt, "cacheblend", max_new_tokens=TOKENS, write_back=False, repair=unguarded)
            steps = torch.cat([reused.logits[None], engine.continuation_logits(reused, answer[:-1])]) \
                if len(answer) > 1 else reused.logits[None]
            for logits, token in zip(steps, answer, strict=True):
                margins.append(fidelity.margin(logits))
                flipped.append(int(logits.argmax()) != token)
        bar.update(1)
    return margins, flipped
