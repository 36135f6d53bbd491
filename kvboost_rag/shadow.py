"""Online calibration: served answers checked against a full prefill in the background, refitting the guard.

Calibration on the corpus (calibrate.py) sees prompts made of documents with no question; what users ask may sit
elsewhere on the flip curve. So a share of the guarded requests served (EngineConfig.shadow_share, and
shadow_share_young while the request's curve was fitted on fewer than YOUNG_TOKENS tokens) is checked once its response
is complete, evenly rather than at random: the first guarded request, then one whenever the share of the requests
offered since is owed (a random draw at 25% can skip 25 requests in a row: with the engine's old seed it did, and no
check ran in the first 25 requests of every engine). The check: a full prefill of its prompt and its answer,
teacher-forced, gives the token a full prefill chooses at every step of the answer. Each judgment the guard made
(repair/guard.py: a cache's margin before a token, at that cache's budget, trusted or refused) becomes a sample, flipped
when that cache's greedy token differs from full's. The floors the levels are held to are measured on what users ask
too: where the request's curve has floors, the check also runs, teacher-forced along the same answer, a full prefill of
the documents in reverse order (the order floor) and one in bf16 (the dtype floor, where the engine has the HALF step's
bf16 model), and a repaired cache's judgment is a sample of each floor's curve at its budget, flipped where the floor's
token differs from full's (so a set where another order changes answers more than calibration's did loosens `balanced`
there, and one where it changes them less tightens it). The samples of each curve (the last MAX_SAMPLES: a budget's, its
floors', or the ladder's HALF step's own, fidelity.Predictor.half) refit that curve after every check, once there are
fidelity.MIN_TOKENS of them, the curve the engine had before counting as much as the tokens it was fitted on (a
calibrated curve is moved part of the way by a few checks, not replaced: replaced, on a corpus it was calibrated apart
from, the curves swung and moved most answers to a full prefill, docs/method.md) until the checks refute it (its
expected flips REFUTED standard deviations from those counted, fidelity.fit), when it counts the less the further: a
curve wrong here is then corrected, not held half-way); the engine uses the new curves at once and saves them beside the
store (KVBoost.set_predictor: the disk tier's folder, the Redis tier), so a restarted server or another process on the
same Redis starts from them. Only requests the guard may move are checked ("fast" answers are not: they asked for no
guard).

Off the critical path: `offer` only queues (a bounded queue: a check offered to a full one is dropped), and one
background thread runs the checks, layer by layer, each layer only while the engine is idle: no thread holds or
waits for its lock, no stream decoding, for QUIET_S since it was last seen busy (a request comes after the one
before it within that). A request that comes meanwhile waits at most one layer of one check.

The trials of skipped steps (repair/routes.py: a step measured not to pay is still tried now and then) are made here
too, whatever the request's share: the request climbs past the step, and once it is done its check carries the
step's `Trial`; the step's cache is built again and judged along the answer served (repair/guard.py's `tried`).
A build is not cut into layers as a check's prefill is, so the thread gives the lock up between its layers
(adapter.pausing, batching.EngineLock.released) whenever a request wants it, and its time left out of the
step's measured cost.

Predicted against observed (`figures`): over the tokens served from reused caches, the guard's summed flip chances
against the flips counted; over the answers, their summed risks (Generation.fidelity_estimate) against those that
differ from a full prefill's at a served token; per floor, over the judged tokens where the check ran it, the floor
curve's summed chances (before the check refits it: out of sample) against the tokens where the floor's token differs
from full's. `figures` are this engine's (/metrics). The store's go with every
curve a check refits (fidelity.Observed, in the fidelity file's metadata, the same bytes in Redis): those the
engine's curve carried (loaded with it, so a restart, another process on the same Redis and the next corpus
calibration keep them) plus this engine's checks since its last refit; `kvboost-rag store stats` shows them.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from . import fidelity
from .adapter import pausing
from .assembly import segments_text
from .repair import guard
from .repair.guard import HALF, Judged

FLOORS = fidelity.FLOOR_NAMES  # fidelity.Predictor.floors' order
YOUNG_TOKENS = 512  # a curve fitted on fewer tokens is checked more: four corpus calibrations' worth (8 x 16 each)
MAX_SAMPLES = 4096  # samples kept per budget: the newest, so the curve follows what is asked now
IDLE_POLL_S = 0.005  # how often a waiting check looks whether the engine is idle
# How long the engine must have been seen idle before a check takes it: a request's own preparation (rendering,
# tokenizing, planning: 5-40 ms at 1.2k tokens) or a client's next request after its answer falls within it, and a
# check that took the engine in that gap delayed the request by one of its layers (`strict`'s float32 prefills, the
# same as full's, took 2-4% longer than full's in the bench, where they followed the checked `balanced` answers).
QUIET_S = 0.1
LINGER_S = 1.0  # the thread ends once the queue has been empty this long (started again by the next offer)


@dataclass(frozen=True)
class Check:
    """A served request to check: its prompt and answer, and what the guard judged while serving it."""

    prompt_ids: torch.Tensor  # [N] long
    answer: tuple[int, ...]  # [T] the tokens sent
    judged: tuple[Judged, ...]
    risk: float  # the predicted chance the answer differs from a full prefill's (fidelity_estimate)
    segments: tuple = ()  # the prompt's text, fixed and documents (Plan.segments): the order floor reverses them
    # The trials of skipped steps due while it was served (repair/guard.py's Trial), made here whether or not the
    # request's share is owed a check, and the request's builder to make them with.
    trials: tuple[guard.Trial, ...] = ()
    builder: guard.Builder | None = None


class Shadow:
    """One engine's shadow checks: the queue, the thread that runs them, the samples and the figures."""

    def __init__(self, engine, share: float, young_share: float, queue: int):
        self.engine, self.share, self.young_share = engine, share, young_share
        self._queue: collections.deque[Check] = collections.deque()
        self._limit = queue
        self._owed = 1.0  # checks owed so far: the first guarded request is checked, then its share of the rest
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False  # a check is under way
        self._busy_seen = 0.0  # time.monotonic() when the engine was last seen busy (or a check was taken up)
        self._closed = False
        # budget (or guard.HALF: the HALF step's own curve) -> (margin, flipped)
        self.samples: dict[float | str, collections.deque[tuple[float, bool]]] = {}
        # checks, dropped, answers/answers_differ, predicted_risk (summed), tokens/flips (served tokens),
        # predicted_flips (their summed chances), samples, refits; per floor, under fidelity.Observed's names
        # (fidelity.FLOOR_KEYS): the judged tokens where it ran, its curve's chances there summed, and where its token
        # differs from full's
        self.counters: collections.Counter[str] = collections.Counter()
        self.predicted_risk = 0.0
        self.predicted_flips = 0.0
        self._saved = fidelity.Observed()  # `observed()` when a refit last handed the engine a curve (see _learn)
        # Per curve (a budget's, or guard.HALF's), the one the engine had before this engine's checks refit it: it
        # counts in every refit as much as the tokens it was fitted on (fidelity.fit's prior), so that a few checks
        # move it only part of the way; and the one the last refit handed the engine, so that one the corpus
        # calibration fits since is the prior.
        self._priors: dict[float | str, fidelity.Predictor] = {}
        self._handed: dict[float | str, tuple] = {}
        _LIVE.add(self)

    @property
    def on(self) -> bool:
        """Whether any request may be checked: then skipped steps' trials are made here too (repair/guard.py)."""
        return self.share > 0 or self.young_share > 0

    def offer(self, check: Check, curve: fidelity.Predictor) -> bool:
        """Queue `check` with the request's share (its curve's: young ones are checked more), or for its trials
        alone; whether it was queued for a check."""
        share = self.young_share if curve.tokens < YOUNG_TOKENS else self.share
        with self._changed:
            owed = share > 0 and bool(check.judged) and self._owed >= 1.0 - 1e-9  # 1e-9: 20 x 0.05 may sum below 1
            if share > 0 and check.judged:
                self._owed += share - owed
            if not owed:
                if not check.trials:
                    return False
                check = dataclasses.replace(check, judged=())  # its trials alone
            if self._closed or len(self._queue) >= self._limit:
                self.counters["dropped"] += owed
                self.counters["trials_dropped"] += len(check.trials)
                return False
            self._queue.append(check)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="kvboost-shadow", daemon=True)
                self._thread.start()
            self._changed.notify_all()
        return owed

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued check has run; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and not self._running, timeout)

    def close(self) -> None:
        """Drop what is queued and stop the thread (a check under way ends after its layer)."""
        with self._changed:
            self._closed = True
            self._queue.clear()
            self._changed.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def figures(self) -> dict:
        """Predicted against observed, for /metrics: per served token, per answer and per floor (observed().figures),
        and the checks' own counts."""
        c = self.counters
        return {"dropped": c["dropped"], "refits": c["refits"], "samples": c["samples"], "errors": c["errors"],
                "trials": {outcome: c[f"trials_{outcome}"] for outcome in ("held", "refused", "dropped")},
                **self.observed().figures()}

    def floor_figures(self, before: fidelity.Predictor | None) -> list[dict]:
        """The floors the checks measured, per floor and budget: the samples, the floor's flips among them (its
        token against full's along the served answers), and the flips `before`'s floor curve (the corpus
        calibration's, say: out of sample) and the engine's now (refit on them) expect at the same margins."""
        now, rows = self.engine.predictor or fidelity.DEFAULT_PREDICTOR, []
        for key, samples in sorted(((k, v) for k, v in self.samples.items() if isinstance(k, tuple)), key=str):
            margins, curves = [m for m, _ in samples], {"now": _curve(now, key)}
            if before is not None and before.at(key[1]).floors is not None:
                curves["before"] = _curve(before, key)
            rows.append({"floor": key[0], "budget": key[1], "samples": len(samples),
                         "flips": sum(flip for _, flip in samples)}
                        | {f"expected_{when}": sum(map(curve.flip_chance, margins)) for when, curve in curves.items()})
        return rows

    def observed(self) -> fidelity.Observed:
        """`figures`' predicted against observed, as kept with a curve and reported by the bench."""
        c = self.counters
        return fidelity.Observed(c["checks"], c["answers"], self.predicted_risk, c["answers_differ"], c["tokens"],
                                 self.predicted_flips, c["flips"], **{key: c[key] for key in fidelity.FLOOR_KEYS})

    # ---- the thread --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closed, LINGER_S)
                if self._closed or not self._queue:
                    self._thread = None
                    self._changed.notify_all()
                    return
                check, self._running = self._queue.popleft(), True
                self._busy_seen = time.monotonic()  # the request that offered it has just finished
            try:
                if check.judged:
                    self._learn(check, *self._tops(check))
                for trial in check.trials:  # built whole under the lock, giving it up between layers
                    with self._idle_lock(), pausing(self._give_way):
                        self.counters["trials_held" if guard.tried(check.builder, trial, check.answer) else
                                      "trials_refused"] += 1
            except _Closed:
                pass
            except Exception as e:  # noqa: BLE001 - a failed check (a full disk, say) must not end the checks
                self.counters["errors"] += 1
                warnings.warn(f"kvboost-rag: a shadow check failed and was skipped: {e!r}", stacklevel=1)
            finally:
                with self._changed:
                    self._running = False
                    self._changed.notify_all()

    def _idle_lock(self):
        """The engine's lock, taken once the engine is idle (waiting while it is not)."""
        self._wait_idle()
        return self.engine.lock

    def _busy(self) -> bool:
        """Whether a request holds or waits for the engine's lock (besides this thread), or a stream is decoding."""
        return bool(self.engine.lock.others or self.engine.batcher.decoders)

    def _wait_idle(self) -> None:
        """Until the engine has been idle for QUIET_S: a check's layers follow each other at once while nothing else
        wants the engine, and the first after a request waits for the next one's preparation to show."""
        while True:
            if self._closed:
                raise _Closed
            if self._busy():
                self._busy_seen = time.monotonic()
            elif time.monotonic() - self._busy_seen >= QUIET_S:
                return
            time.sleep(IDLE_POLL_S)

    def _give_way(self) -> None:
        """Between two layers of a trial's build (adapter.pausing): while a request wants the engine, it has it."""
        if self._busy():
            with self.engine.lock.released():
                self._wait_idle()

    def _tops(self, check: Check) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Full's greedy tokens along the answer (_forced), and where the request's curve has floors to refit,
        the floors' along the same answer: a full prefill of the documents in reverse order ("order", where the
        prompt has two or more), and one in bf16 ("dtype", where the engine has the HALF step's bf16 model; the
        calibration's float32 copy of a bf16 engine is not kept for the checks)."""
        engine = self.engine
        full = self._forced(engine.adapter, check.prompt_ids, check.answer)
        floors = {}
        if any(_curve(engine.predictor or fidelity.DEFAULT_PREDICTOR, j.budget).floors is not None
               for j in check.judged if j.step != HALF):
            if (reordered := _reordered(engine, check.segments)) is not None:
                floors["order"] = self._forced(engine.adapter, reordered, check.answer)
            with self._idle_lock():  # made on first use: not while a request may be making it
                half = engine.half_adapter()
            if half is not None:
                floors["dtype"] = self._forced(half, check.prompt_ids, check.answer)
        return full, floors

    @torch.inference_mode()
    def _forced(self, adapter, prompt_ids: torch.Tensor, answer: tuple[int, ...]) -> torch.Tensor:
        """A full prefill of the prompt and the answer by `adapter`, one layer at a time, each while the engine is
        idle: its greedy token before each answer token and after the last. [T + 1]"""
        ids = torch.cat([prompt_ids, torch.tensor(answer, dtype=torch.long)])  # [N + T]
        n, total = prompt_ids.numel(), ids.numel()
        positions, cache = torch.arange(total), adapter.new_buffers(total)
        with self._idle_lock():
            hidden = adapter.embed(ids)  # [1, N + T, H]
        for layer in range(adapter.num_layers):
            with self._idle_lock():
                hidden = adapter.run_layers(hidden, positions, cache, range(layer, layer + 1), total)
        with self._idle_lock():
            return adapter.logits(hidden[:, n - 1:]).argmax(-1).cpu()

    def _learn(self, check: Check, full_tops: torch.Tensor, floor_tops: dict[str, torch.Tensor] | None = None) -> None:
        """Count the check in, add its samples, refit the curves it touched (the budgets', the HALF step's, and
        where `floor_tops` has them the floors' at those budgets) and hand the engine the new curves."""
        flips = [judged.top != int(full_tops[judged.index]) for judged in check.judged]
        served = [(judged, flip) for judged, flip in zip(check.judged, flips, strict=True) if judged.served]
        self.counters.update(checks=1, answers=1, samples=len(flips), tokens=len(served),
                             flips=sum(flip for _, flip in served), answers_differ=any(flip for _, flip in served))
        self.predicted_risk += check.risk
        self.predicted_flips += sum(judged.chance for judged, _ in served)
        # Each judgment is a sample of the curve that judged it: its budget's, or the HALF step's own (guard.HALF,
        # fidelity.Predictor.half); a repaired cache's is one of its budget's floors' too, flipped where the floor's
        # token differs from full's: the floors' curves are P(the floor's token differs | the repaired cache's
        # margin), as calibration fits them (calibrate.py).
        engine = self.engine
        predictor = before = engine.predictor or fidelity.DEFAULT_PREDICTOR
        keys = []
        for judged, flip in zip(check.judged, flips, strict=True):
            key = HALF if judged.step == HALF else judged.budget
            if key == HALF and predictor.half is None:
                continue  # a curve dropped since (calibrated again): nothing to refit
            curves = [(key, flip)]
            if key != HALF and predictor.at(key).floors is not None:
                for floor, tops in (floor_tops or {}).items():
                    floor_flip = int(tops[judged.index]) != int(full_tops[judged.index])
                    curves.append(((floor, predictor.at(key).budget), floor_flip))
                    # Predicted by the floor's curve before this check refits it: out of sample, as the guard's are
                    predicted = _curve(before, curves[-1][0]).flip_chance(judged.margin)
                    self.counters.update({f"{floor}_tokens": 1, f"{floor}_predicted_flips": predicted,
                                          f"{floor}_observed_flips": floor_flip})
            for curve_key, curve_flip in curves:
                self.samples.setdefault(curve_key, collections.deque(maxlen=MAX_SAMPLES)).append(
                    (judged.margin, curve_flip))
                keys.append(curve_key)
        refitted = False
        for key in dict.fromkeys(keys):
            samples, current = self.samples[key], _curve(predictor, key)
            # The first check of this curve, or a curve not of our refits (calibrated since): the prior from now on.
            # (A refit hands over every curve, so a budget first judged later is in _handed, not _priors.)
            if key not in self._priors or _fitted(current) != self._handed.get(key):
                self._priors[key] = current
            if len(samples) >= fidelity.MIN_TOKENS:
                margins, flipped = zip(*samples, strict=True)
                # Floors fitted as measured, as calibration fits them (raised, they would loosen the level they hold)
                curve = fidelity.fit(margins, flipped, predictor.documents, current.budget, prior=self._priors[key])
                predictor = _with(predictor, key, curve)
                refitted = True
        if refitted:
            # The figures go with the curve: what the engine's curve carried, and this engine's checks since it last
            # handed one over (counted as handed over before the save, which may fail: the engine keeps the curve).
            now = self.observed()
            carried = (before.observed or fidelity.Observed()) + (now - self._saved)
            self._saved = now
            engine.set_predictor(dataclasses.replace(predictor, observed=carried))
            self._handed = {curve.budget: _fitted(curve) for curve in (predictor, *predictor.others)}
            self._handed |= {(kind, curve.budget): _fitted(floor) for curve in (predictor, *predictor.others)
                             if curve.floors is not None for kind, floor in zip(FLOORS, curve.floors, strict=True)}
            if predictor.half is not None:
                self._handed[HALF] = _fitted(predictor.half)
            self.counters["refits"] += 1


_LIVE: weakref.WeakSet[Shadow] = weakref.WeakSet()  # every engine's, for _close_all


@atexit.register
def _close_all() -> None:
    """Stop every engine's checks before the interpreter tears down: a check thread still inside torch then takes
    the process down with it (seen at the end of a test run that left engines open)."""
    for shadow in list(_LIVE):
        shadow.close()


def _curve(predictor: fidelity.Predictor, key: float | str | tuple[str, float]) -> fidelity.Predictor:
    """The curve a sample of `key` (a budget, guard.HALF, or a floor at a budget: ("order" | "dtype", budget))
    refits."""
    if isinstance(key, tuple):
        kind, budget = key
        return predictor.at(budget).floors[FLOORS.index(kind)]
    return predictor.half if key == HALF else predictor.at(key)


def _with(predictor: fidelity.Predictor, key, curve: fidelity.Predictor) -> fidelity.Predictor:
    """`predictor` with the curve a sample of `key` refits (_curve) replaced by `curve`."""
    if key == HALF:
        return dataclasses.replace(predictor, half=curve)
    if not isinstance(key, tuple):
        return with_curve(predictor, curve)
    kind, budget = key
    at = predictor.at(budget)
    floors = tuple(curve if name == kind else floor for name, floor in zip(FLOORS, at.floors, strict=True))
    return with_curve(predictor, dataclasses.replace(at, floors=floors))


def _reordered(engine, segments: tuple) -> torch.Tensor | None:
    """The order floor's prompt: the request's text with its documents in reverse order, as a full prefill runs it
    (calibrate.py's order floor reverses its prompts' documents the same way); None with fewer than two."""
    documents = [segment for segment in segments if not isinstance(segment, str)]
    if len(documents) < 2:
        return None
    backwards = iter(documents[::-1])
    swapped = [segment if isinstance(segment, str) else next(backwards) for segment in segments]
    return engine.plan(segments_text(swapped), "full").token_ids


def _fitted(curve: fidelity.Predictor) -> tuple:
    """What a fit decided about a curve (its figures since are kept with it, and change without a fit)."""
    return curve.budget, curve.intercept, curve.slope, curve.tokens, curve.flips


class _Closed(Exception):
    """The shadow was closed while a check waited for the engine."""


def with_curve(predictor: fidelity.Predictor, curve: fidelity.Predictor) -> fidelity.Predictor:
    """`predictor` with the curve at `curve.budget` replaced by `curve` (added when it has none there); the main
    curve stays first, the corpus size it was fitted for stays its own (calibrate.due reads it), and a curve without
    floors (a fit: fidelity.fit gives none) takes the floors' curves it replaces at that budget; one with floors (a
    floor's refit, _with) brings its own."""
    before = {c.budget: c for c in (predictor, *predictor.others)}
    if curve.floors is None and curve.budget in before:
        curve = dataclasses.replace(curve, floors=before[curve.budget].floors)
    curves = [c for c in (predictor, *predictor.others) if c.budget != curve.budget] + [curve]
    main = curve if curve.budget == predictor.budget else curves[0]
    main = fidelity.Predictor(main.intercept, main.slope, main.tokens, main.flips, predictor.documents, main.budget,
                              floors=main.floors, half=predictor.half)
    return main.with_others([c for c in curves if c is not main and c.budget != main.budget])
