"""Which steps of the guard's ladder pay for themselves: each step's measured cost against a full prefill's, and how
often the cache it made served the whole answer.

A step of the ladder (repair/guard.py: the request's own repair, each escalation, the bf16 prefill) costs its
prefill whether or not its cache then serves the answer; refused at its first token or left part-way, the request
pays for the next step too, at worst a full prefill. Trying a step of cost c (a share of a full prefill's) whose
cache serves the whole answer with chance s costs c + (1 - s) against going straight to a full prefill's 1: it pays
when s > c. (The steps between are left out of that sum: they only make the bound looser, and the steps are few.)
Both are measured while serving: c as the median seconds per token of the step's last builds against full's, s as
the share of the step's last caches that served their answer to its end (a first token refused, or a cache left
for another part-way, is a failure), per strategy, level and budget, since a strict level refuses what a balanced
one trusts. Judged by whole answers, not first tokens: a cache trusted at its first token and left at its tenth has
paid for another prefill too, and a request's total time is what a skipped step saves. A step that does not pay is
skipped, and its request goes on up the ladder. So `strict` on a model whose repairs it never trusts to the end
costs a bf16 prefill (or a full one), not refused repairs and then one, and a device on which a repair is slower
than a full prefill (the H200 of docs/gpu_h200/) stops repairing.

Skipping only ever serves a request from a cache nearer to a full prefill's: it moves cost, never fidelity.
Until a step has been judged MIN_OUTCOMES times and both costs timed MIN_TIMINGS times it is tried; a skipped
step is still tried now and then, so that its share follows what is asked now: after EXPLORE_EVERY skips, then
after twice as many each time it still does not pay, up to EXPLORE_MAX, and after EXPLORE_EVERY again once a trial
has held (a step that starts paying again is found in tens of requests, not hundreds). Where the engine runs shadow
checks, a trial is made off the request's path (repair/guard.py's `Trial`, run by shadow.py once the engine is
idle): the request climbs past the step as if skipped, and the step's cache is built afterwards and judged along the
answer that was served. Made for the request itself, a refused trial cost it that prefill and then the next step's:
on a CPU where no repair of `strict` lasts, the 8th and 24th requests of a run took 1.9x and 2.3x a full prefill's
time.

The record goes with the fidelity curves (KVBoost.set_predictor: `to_json` in the fidelity file's metadata, the same
bytes in Redis), written when calibration has seeded it (calibrate.py) and at every refit of the online checks; an
engine that loads the curves starts from it (`restored`), so a restarted server or another process on the same Redis
does not pay its first requests to learn what the calibrating one measured. Only cost rests on it: a record that is
not ours or damaged is warned about and started afresh.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
import threading
import warnings
from dataclasses import dataclass, field

WINDOW = 32  # the judgments of a step kept: the newest
TIMINGS = 16  # the build times of a step kept: the newest
MIN_OUTCOMES = 8
MIN_TIMINGS = 3
EXPLORE_EVERY = 8  # skips before a skipped step's first trial
EXPLORE_MAX = 64  # the most skips between its trials, the wait doubling after each that finds it still not paying
FULL = 1.0  # a full prefill's budget, as repair/guard.py records it
TRY, SKIP, TRIAL = "try", "skip", "trial"  # Routes.verdict's

Step = tuple[str, str, float]  # (strategy, level, budget) of a judged cache


@dataclass
class Routes:
    """One engine's record of its ladder's steps; thread-safe (requests climb from several threads)."""

    enabled: bool = True
    _trusted: dict[Step, collections.deque[bool]] = field(default_factory=dict)
    _seconds_per_token: dict[tuple[str, float], collections.deque[float]] = field(default_factory=dict)
    _skips: collections.Counter[Step] = field(default_factory=collections.Counter)  # since its last trial
    _explore_after: dict[Step, int] = field(default_factory=dict)  # skips before its next trial
    _lock: threading.Lock = field(default_factory=threading.Lock)
    counters: collections.Counter[str] = field(default_factory=collections.Counter)  # tried, skipped, explored

    def timed(self, strategy: str, budget: float, seconds: float, tokens: int) -> None:
        """A cache of `strategy` built at `budget` over `tokens` tokens took `seconds`: ("full", FULL) is a full
        prefill, the measure of the others; ("half", FULL) one in bf16 (repair/guard.py's HALF)."""
        with self._lock:
            self._seconds_per_token.setdefault((strategy, budget), collections.deque(maxlen=TIMINGS)).append(
                seconds / max(tokens, 1))

    def judged(self, step: Step, trusted: bool) -> None:
        """A cache `step` made served its answer to the end (trusted), or not: refused at its first token or left
        part-way."""
        with self._lock:
            self._trusted.setdefault(step, collections.deque(maxlen=WINDOW)).append(trusted)
            if trusted:  # what is asked may have changed: the next trial comes after EXPLORE_EVERY skips again
                self._explore_after.pop(step, None)

    def cost(self, strategy: str, budget: float) -> float | None:
        """A build at `budget` as a share of a full prefill's time per token; None until both are timed enough."""
        with self._lock:
            step = self._seconds_per_token.get((strategy, budget), ())
            full = self._seconds_per_token.get(("full", FULL), ())
            if len(step) < MIN_TIMINGS or len(full) < MIN_TIMINGS:
                return None
            return statistics.median(step) / statistics.median(full)

    def trusted_share(self, step: Step) -> float | None:
        with self._lock:
            outcomes = self._trusted.get(step, ())
            return sum(outcomes) / len(outcomes) if len(outcomes) >= MIN_OUTCOMES else None

    def verdict(self, step: Step) -> str:
        """Whether to build the cache of `step` = (strategy, level, budget) rather than climb past it. TRY: build
        it, it pays (or is not measured enough to say); SKIP: climb past it; TRIAL: it does not pay, but its trial
        is due (built for the request, or, where the engine can, off its path: repair/guard.py's `Trial`)."""
        if not self.enabled:
            return TRY
        share, cost = self.trusted_share(step), self.cost(step[0], step[2])
        if share is None or cost is None or share > cost:
            with self._lock:  # it pays: should it stop paying, its trials start again from EXPLORE_EVERY
                self._explore_after.pop(step, None)
            self.counters["tried"] += 1
            return TRY
        with self._lock:
            self._skips[step] += 1
            wait = self._explore_after.get(step, EXPLORE_EVERY)
            explore = self._skips[step] >= wait
            if explore:
                self._skips[step] = 0
                self._explore_after[step] = min(2 * wait, EXPLORE_MAX)
        self.counters["explored" if explore else "skipped"] += 1
        return TRIAL if explore else SKIP

    def to_json(self) -> str:
        """The judgments and timings kept, oldest first: what `restored` reads."""
        with self._lock:
            judged = [[*step, "".join("1" if held else "0" for held in outcomes)]
                      for step, outcomes in self._trusted.items()]
            timed = [[*key, list(times)] for key, times in self._seconds_per_token.items()]
        return json.dumps({"judged": judged, "timed": timed})


def restored(text: str | None, enabled: bool = True) -> Routes:
    """A record starting from what `Routes.to_json` wrote (None: an empty one)."""
    record = Routes(enabled=enabled)
    if text is None:
        return record
    try:
        saved = json.loads(text)
        for strategy, level, budget, outcomes in saved["judged"]:
            if not isinstance(outcomes, str) or set(outcomes) - {"0", "1"}:
                raise ValueError(f"outcomes {outcomes!r} are not a string of 0 and 1")
            step = (str(strategy), str(level), float(budget))
            record._trusted[step] = collections.deque((c == "1" for c in outcomes), maxlen=WINDOW)
        for strategy, budget, times in saved["timed"]:
            times = [float(t) for t in times]
            if not all(math.isfinite(t) and t >= 0 for t in times):
                raise ValueError(f"times {times} are not finite, non-negative numbers")
            record._seconds_per_token[(str(strategy), float(budget))] = collections.deque(times, maxlen=TIMINGS)
    except (ValueError, TypeError, KeyError) as error:
        warnings.warn(f"ignoring the ladder's saved routes ({error}): they are measured again from the next requests "
                      "(this costs time, never fidelity)", stacklevel=2)
        return Routes(enabled=enabled)
    return record
