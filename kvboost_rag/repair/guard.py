"""The fidelity guard's decisions, in one place: whether a request is guarded and by which curve and target,
whether each token may come from the cache it has, and where the request goes when one may not (the ladder).

The engine builds a request's first cache through `start` and decodes; before each later token it asks its `Watch`
whether the token may come from the cache it has (`trusts`), and when not, for the next cache (`climb`). It keeps
only the plumbing: planning, the lock, decoding, streaming.

Guarded: a request of a guarded strategy (repair/protocol.py) whose cache is not exact, that is with content hits,
or with exact hits read back from quantized KV (see fidelity.py for the curve, the risk and the target).

The ladder. A guarded request is served from its strategy's repair at its own budget (step REPAIR) while the guard
trusts each token. Before a token it does not trust, the request climbs:

  1. ESCALATE: the same plan assembled again and repaired at a larger budget (the levels' budgets above the
     request's, then EngineConfig.escalate_to), exact prefix hits kept as they are, then the answer's tokens so far
     run after the prompt, teacher-forced: they were decoded from the smaller repair, so their K/V must be made
     again against the new cache to be that cache's. The token is judged again, by the curve fitted at the larger
     budget (Predictor.at), and its top token must be the one the refused repair picked (two repairs that pick
     apart: the token rests on what they left stale, see `_refused_top`); the first budget that trusts it serves
     from there on.
  2. HALF: where the engine runs in float32 and bf16 runs natively (EngineConfig.bf16_step), a full prefill of the
     prompt and the answer so far in bf16, nothing reused, its K/V kept in float32 to decode from: the cache the
     dtype floor is made of, ~1.6x faster than a float32 one on a CPU with bf16 instructions. It is judged by the
     step's own curve (fidelity.Predictor.half), so a `strict` answer, held to the dtype floor, is trusted
     there unless the tokens before it took their share; a `balanced` one, held to the order floor, all the more.
     Uncalibrated, there is no HALF step.
  3. FULL: a full prefill of the prompt and the answer so far, nothing reused: from there the answer continues
     exactly as a full prefill's would, unguarded.

Why assembled again rather than repaired further in place: cacheblend ranks tokens by their deviation from the K/V
as assembled, and the served cache holds fresh K/V in some layers for tokens it dropped from the set; a second pass
over it would rank by a mixture. Assembly only copies stored chunks, small next to a repair.

The first token climbs the same ladder before it is sent (its TTFT then counts every step tried); a later token's
climb costs total time, not TTFT. A request never climbs down. Only a plan with content hits escalates: a repair
never recomputes exact hits, so a cache whose only doubt is quantized exact hits goes straight to a full prefill.
Each step that served tokens is recorded as a `Served`: from which answer token on, which step, at which budget.

A step that does not pay for itself where the engine runs (repair/routes.py: its measured cost against a full
prefill's, its cache's measured chance of being trusted) is skipped, the request's own repair included; its trials,
now and then, are made after the request (`Trial`, `tried`, run by shadow.py) where the engine runs shadow checks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from .. import fidelity, likeness, models
from ..adapter import ModelAdapter, busy_clock
from ..assembly import APPROX, EXACT, Plan, assemble
from ..config import LEVEL_BUDGETS, RepairConfig
from ..drift import DriftMaps
from ..kvcache import KVBuffers
from .protocol import Request, Strategy
from .routes import SKIP, TRIAL, Routes, Step

# The steps of the ladder, as `Served.step` names them.
REPAIR = "repair"  # the request's strategy at its own budget (an unguarded strategy's prefill, too)
ESCALATE = "escalate"  # the same plan repaired again at a larger budget
HALF = "half"  # a full prefill of the prompt and the answer so far in bf16, decoded on in float32
FULL = "full"  # a full prefill of the prompt and the answer so far


@dataclass(frozen=True)
class Served:
    """One step of a request's ladder that served tokens: answer tokens first_token .. (the next step's) - 1."""

    first_token: int  # index into the answer of the first token it served
    step: str  # REPAIR, ESCALATE, HALF or FULL
    budget: float | None  # the recompute budget its cache was repaired at; 1.0 for HALF and FULL; None: unguarded
    recomputed_tokens: int  # prompt tokens its prefill ran through every layer (cacheblend: averaged per layer)


@dataclass(frozen=True)
class Judged:
    """One judgment of the guard: a cache's next-token logits before answer token `index` (what a shadow check
    compares with a full prefill's, shadow.py)."""

    index: int  # the answer token judged
    budget: float  # the recompute budget of the cache judged
    margin: float  # its logits' top-2 margin
    chance: float  # the flip chance the curve gave it
    top: int  # its greedy token
    served: bool  # trusted: the token came from this cache
    step: str = REPAIR  # the ladder step that made the cache (HALF's judgments refit no curve, shadow.py)


@dataclass(frozen=True)
class Built:
    """A cache made for a request: the prompt, then the answer so far, ready to decode the next token from."""

    cache: KVBuffers
    logits: torch.Tensor  # [V] fp32, the next-token distribution after the prompt and the answer so far
    recomputed_tokens: int  # prompt tokens run through every layer (the answer's are not counted)


@dataclass(frozen=True)
class Trial:
    """A skipped step's trial, due while a request was served and made once its answer is complete (`tried`)."""

    key: Step  # the step as repair/routes.py keeps its record
    step: str  # REPAIR, ESCALATE or HALF
    budget: float
    policy: Policy


@dataclass(frozen=True)
class Builder:
    """How one request's cache is made, at its own budget or a larger one, with the answer so far appended."""

    adapter: ModelAdapter
    plan: Plan
    strategy: Strategy
    settings: RepairConfig
    drift: DriftMaps | None  # the maps the request's content hits are assembled through (None: none)
    capacity: int  # prompt and every token the request may generate
    lock: AbstractContextManager  # the engine's: one forward at a time
    routes: Routes | None = None  # where each build's time is recorded (None: nowhere)
    half: Callable[[], ModelAdapter | None] = lambda: None  # the model in bf16 for HALF (made when first asked)
    # The trials of skipped steps due while serving the request, made off its path once it is done (`Trial`);
    # None: the engine has no shadow checks to make them, a due trial is built for the request itself.
    trials: list[Trial] | None = None

    def due(self) -> tuple[Trial, ...]:
        """The trials due so far, handed over once: a prefill may be decoded more than once."""
        if not self.trials:
            return ()
        due, self.trials[:] = tuple(self.trials), []
        return due

    @torch.inference_mode()
    def repaired(self, budget: float | None = None, answer: Sequence[int] = ()) -> Built:
        """The plan assembled and prefilled by its strategy, at `budget` (None: the request's settings as they are),
        then `answer` [T] teacher-forced after the prompt."""
        settings = self.settings if budget is None else dataclasses.replace(self.settings, recompute_ratio=budget)
        with self.lock:
            started = busy_clock()  # under the lock: the build's own time, not its wait (nor a trial's pauses)
            cache = assemble(self.plan, self.adapter, self.capacity, drift=self.drift)
            done = self.strategy.prefill(Request(self.adapter, self.plan, cache, settings))
            hidden = done.hidden if not answer else self._append(cache, answer)  # [1, 1, H]
            built = Built(cache, self.adapter.logits(hidden)[-1], done.recomputed_tokens)
            name = self.strategy.name if self.strategy.reuse_exact or self.strategy.reuse_content else FULL
            self._timed(name, 1.0 if name == FULL else settings.budget, started, built.logits, len(answer))
            return built

    @torch.inference_mode()
    def exact(self, answer: Sequence[int] = ()) -> Built:
        """A full prefill of the prompt and `answer` into a new cache, nothing reused."""
        token_ids = self._and(answer)
        with self.lock:
            started = busy_clock()
            cache, logits = exact_cache(self.adapter, self.lock, token_ids, self.capacity)
            self._timed(FULL, 1.0, started, logits, len(answer))
        return Built(cache, logits, self.plan.num_tokens)

    @torch.inference_mode()
    def halved(self, answer: Sequence[int] = ()) -> Built:
        """A full prefill of the prompt and `answer` in bf16 (the HALF step; `half()` must not be None), its K/V
        copied into a float32 cache to decode from."""
        token_ids = self._and(answer)
        with self.lock:
            started = busy_clock()
            cache, logits = half_cache(self.adapter, self.half(), self.lock, token_ids, self.capacity)
            self._timed(HALF, 1.0, started, logits, len(answer))
        return Built(cache, logits, self.plan.num_tokens)

    def _and(self, answer: Sequence[int]) -> torch.Tensor:
        """The prompt's token ids, then the answer's: [N + T]."""
        return torch.cat([self.plan.token_ids, torch.tensor(list(answer), dtype=torch.long)])

    def _timed(self, name: str, budget: float, started: float, logits: torch.Tensor, answer_tokens: int) -> None:
        if self.routes is None:
            return
        if logits.is_cuda:  # kernels run asynchronously there: the time is the work's once it is done
            torch.cuda.synchronize(logits.device)
        self.routes.timed(name, budget, busy_clock() - started, self.plan.num_tokens + answer_tokens)

    def _append(self, cache: KVBuffers, answer: Sequence[int]) -> torch.Tensor:
        """Run `answer` [T] through every layer after the prompt, writing its K/V: the last one's output [1, 1, H]."""
        return appended(self.adapter, cache, self.plan.num_tokens, answer)[:, -1:]


@torch.inference_mode()
def exact_cache(adapter: ModelAdapter, lock: AbstractContextManager, token_ids: torch.Tensor,
                capacity: int) -> tuple[KVBuffers, torch.Tensor]:
    """A full prefill of `token_ids` [N] into a new cache: (the cache, the next-token logits [V])."""
    with lock:
        cache = adapter.new_buffers(capacity)
        return cache, adapter.logits(appended(adapter, cache, 0, token_ids)[:, -1:])[-1]


def appended(adapter: ModelAdapter, cache: KVBuffers, n: int, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Run `token_ids` [T] through every layer after the `n` tokens `cache` holds (0: a full prefill), writing their
    K/V: their outputs [1, T, H]. The caller holds the engine's lock."""
    t = len(token_ids)
    return adapter.run_layers(adapter.embed(torch.as_tensor(token_ids, dtype=torch.long)), torch.arange(n, n + t),
                              cache, range(adapter.num_layers), n + t)


@torch.inference_mode()
def half_cache(adapter: ModelAdapter, half: ModelAdapter, lock: AbstractContextManager, token_ids: torch.Tensor,
               capacity: int) -> tuple[KVBuffers, torch.Tensor]:
    """The HALF step's cache: a full prefill of `token_ids` [N] by `half` (the model in bf16), its K/V copied into
    a new cache of `adapter`'s dtype to decode from; and its next-token logits [V]."""
    n = token_ids.shape[0]
    with lock:
        low, logits = exact_cache(half, lock, token_ids, n)
        cache = adapter.new_buffers(capacity)
        cache.all_keys[:, :, :, :n], cache.all_values[:, :, :, :n] = low.all_keys, low.all_values
        return cache, logits


def half_adapter(adapter: ModelAdapter) -> ModelAdapter | None:
    """The model in bf16, for the HALF step: None unless the engine runs in float32 and bf16 runs natively where it
    runs (models.native_matmuls): emulated bf16 is several times slower than float32, and from bf16 or float16 the
    other dtype is the slower one."""
    if adapter.dtype != torch.float32 or not models.native_matmuls(torch.bfloat16, adapter.device):
        return None
    return ModelAdapter(models.in_dtype(adapter.model, torch.bfloat16))


@dataclass(frozen=True)
class Policy:
    """What a guarded request is held to, fixed at its prefill."""

    predictor: fidelity.Predictor  # every fitted curve; a step is judged by the one at its budget (Predictor.at)
    fidelity: str | float  # the request's level: a floor's curve, or a fixed risk per answer (fidelity.target_for)
    budget: float  # the request's own recompute budget
    escalations: tuple[float, ...]  # the larger budgets tried, in order, before a full prefill
    # The level's floor risk lent by earlier answers (fidelity.Account); None: the answer is held to its own floor
    account: fidelity.Account | None = None

    def curve(self, budget: float) -> fidelity.Predictor:
        return self.predictor.at(budget)

    @property
    def half_curve(self) -> fidelity.Predictor | None:
        """What a HALF cache is judged by: the step's own curve (fidelity.Predictor.half); None:
        uncalibrated, or no floors to hold it to."""
        return self.predictor.half if self.curve(self.budget).floors is not None else None

    def judged_by(self, step: str, budget: float) -> tuple[fidelity.Predictor, float | fidelity.Predictor]:
        """The curve a cache of `step` at `budget` is judged by, and the target it is held to. A HALF cache's
        tokens are the dtype floor's own, so at `strict`, held to that floor, they are held to themselves: trusted
        unless the tokens before them took more than their share. A FULL cache risks nothing; its tokens count
        towards the request's own floor (fidelity.Guard.passes)."""
        if step == FULL:
            return self.curve(self.budget), self.target
        if step == HALF:
            return self.half_curve, self.half_curve if self.fidelity == "strict" else self.target
        return self.curve(budget), self.target_at(budget)

    def target_at(self, budget: float) -> float | fidelity.Predictor:
        """What a cache repaired at `budget` is held to: its level's floor curve at that budget where calibrated,
        else a fixed risk per answer; inf: "fast", measured and never acted on."""
        target = fidelity.target_for(self.fidelity, self.curve(budget))
        return math.inf if target is None else target

    @property
    def target(self) -> float | fidelity.Predictor:
        return self.target_at(self.budget)

    @property
    def minimum(self) -> float:
        """The risk per answer a floor-held level always allows: its fixed target (fidelity.Guard)."""
        fixed = fidelity.target_of(self.fidelity)
        return 0.0 if fixed is None else fixed

    @property
    def acts(self) -> bool:
        """Whether the guard may move the request ("fast" only measures)."""
        return fidelity.target_of(self.fidelity) is not None


def escalations(settings: RepairConfig, ceiling: float) -> tuple[float, ...]:
    """The budgets above the request's that its ladder repairs at: the levels' budgets below `ceiling`
    (EngineConfig.escalate_to), then the ceiling itself."""
    own = settings.budget
    steps = sorted({b for b in LEVEL_BUDGETS.values() if own < b < ceiling} | ({ceiling} if ceiling > own else set()))
    return tuple(steps)


def held_to(settings: RepairConfig, plan: Plan, strict_likeness: float | None) -> RepairConfig:
    """The settings a request runs under: a `balanced` one whose documents are `strict_likeness` alike or more
    (EngineConfig) is held to `strict`, at strict's budget unless it names its own (likeness.py)."""
    if settings.fidelity != "balanced" or strict_likeness is None:
        return settings
    texts = [segment.text for segment in plan.segments if not isinstance(segment, str)]
    return settings if likeness.likeness(texts) < strict_likeness else dataclasses.replace(settings, fidelity="strict")


def policy(strategy: Strategy, settings: RepairConfig, plan: Plan, predictor: fidelity.Predictor | None,
           kv_bits: int, escalate_to: float, accounts: dict[str, fidelity.Account] | None = None) -> Policy | None:
    """The guard a request runs under; None when it runs unguarded: a strategy the guard does not watch, or a cache
    that is exact (nothing reused, or exact hits kept at full precision). `accounts`: the engine's, per level held
    on average (fidelity.Account); a level borrows only from its own, and one without is held answer by answer."""
    if not strategy.guarded:
        return None
    content_hits = plan.count(APPROX) > 0
    if not content_hits and not (kv_bits < 16 and plan.count(EXACT) > 0):
        return None
    account = (accounts or {}).get(settings.fidelity) if isinstance(settings.fidelity, str) else None
    return Policy(predictor or fidelity.DEFAULT_PREDICTOR, settings.fidelity, settings.budget,
                  escalations(settings, escalate_to) if content_hits else (), account)


class Watch:
    """One request's guard while it is served: its running risk, the steps that served it, the cache to climb to."""

    def __init__(self, policy: Policy, builder: Builder, served: Sequence[Served], risk: float = 0.0,
                 judged: Sequence[Judged] = (), first: torch.Tensor | None = None):
        self.policy, self.builder, self.served, self.judged = policy, builder, list(served), list(judged)
        last = self.served[-1]
        self._guard = fidelity.Guard(*policy.judged_by(last.step, last.budget), policy.minimum, policy.account)
        self._guard.survive = 1.0 - risk
        for j in self.judged:  # the floor's risk over the tokens served so far, as the prefill's guard ran it
            floor = policy.judged_by(j.step, j.budget)[1]
            if j.served and isinstance(floor, fidelity.Predictor):
                self._guard.floor_survive *= 1.0 - floor.flip_chance(j.margin)
        # What the prefill borrowed for its first token: exactly what it was short then, the only token it judged.
        # Spent by the prefill, not returned here: a prefill may be decoded more than once.
        self._guard.borrowed = max(0.0, self._guard.risk - self._guard.allowed) if policy.account is not None else 0.0
        if last.step == FULL and last.first_token == 0 and first is not None:
            # The prefill fell back before its first token, whose logits [V] are `first`: `climb` counted the floor
            # over it in the prefill's guard, not judged, so not among `judged`; counted here again.
            self._guard.passes(fidelity.margin(first))
        self._next = sum(j.served for j in self.judged)  # the answer token judged next: one per trusted judgment

    @property
    def risk(self) -> float:
        """The chance the answer so far differs from a full prefill's (tokens from a FULL step add nothing)."""
        return self._guard.risk

    @property
    def exact(self) -> bool:
        """Served from a full prefill: nothing left to guard."""
        return self.served[-1].step == FULL

    def trusts(self, logits: torch.Tensor) -> bool:
        """Whether the next token may come from the cache whose next-token logits [V] these are (its risk is then
        counted in). From an exact cache, always: only the floor's risk over the token is counted (Guard.passes)."""
        if self.exact:
            self._guard.passes(fidelity.margin(logits))
            return True
        return self._judge(logits, self.served[-1].budget, self.served[-1].step)

    def step(self, budget: float, step: str = REPAIR) -> tuple[str, str, float]:
        """The ladder step `step` of a cache repaired at `budget`, as repair/routes.py keeps its record: a repair's
        under its strategy's name, HALF's under its own."""
        return HALF if step == HALF else self.builder.strategy.name, str(self.policy.fidelity), budget

    def worth(self, budget: float, step: str = REPAIR) -> bool:
        """Whether to build the cache at `budget` for the request: it pays where the engine runs (routes.py), or
        its trial is due and cannot be made off the request's path; always, without routes."""
        routes = self.builder.routes
        if routes is None:
            return True
        key = self.step(budget, step)
        verdict = routes.verdict(key)
        if verdict == TRIAL and self.builder.trials is not None:
            self.builder.trials.append(Trial(key, step, budget, self.policy))
            return False
        return verdict != SKIP

    def first_judged(self, logits: torch.Tensor, budget: float, step: str = REPAIR, agree_with: int | None = None
                     ) -> bool:
        """Judge a new cache's first token; refused, the step that made it failed (routes.py). Trusted, it is
        judged by the answer's end: whether the cache served it there (`finish`) or was left part-way (`climb`).
        `agree_with`: the top token of the repair it climbed from, which its top token must equal (`climb`)."""
        counted = self._counted(step, self._next)
        trusted = self._judge(logits, budget, step, agree_with)
        if not trusted and counted:
            self.builder.routes.judged(self.step(budget, step), False)
        return trusted

    def _counted(self, step: str, first_token: int) -> bool:
        """Whether routes.py counts a cache of `step` serving from `first_token` on. Not HALF's part-way: entered
        after repaired tokens took their share of the floor's allowance it may be refused where at a first token
        it never is (the same curve judges it as the floor it is held to), and its first-token record must not
        be spent on that (part-way, HALF is always tried: its alternative, a float32 prefill, costs more)."""
        return self.builder.routes is not None and not (step == HALF and first_token > 0)

    def finish(self) -> None:
        """The answer is complete: the cache serving it held to the end; the level's account is settled."""
        self._outcome(True)
        self._guard.settle()

    def _outcome(self, held: bool) -> None:
        last = self.served[-1]
        if last.step != FULL and self._counted(last.step, last.first_token):
            self.builder.routes.judged(self.step(last.budget, last.step), held)

    def _judge(self, logits: torch.Tensor, budget: float, step: str, agree_with: int | None = None) -> bool:
        margin, top = fidelity.margin(logits), int(logits.argmax())
        trusted = (agree_with is None or top == agree_with) and self._guard.admits(margin)
        self.judged.append(Judged(self._next, budget, margin, self._guard.predictor.flip_chance(margin),
                                  top, trusted, step))
        self._next += trusted
        return trusted

    def _refused_top(self, index: int) -> int | None:
        """The top token of the last repair refused at answer token `index` (None: none was), which the next repair
        must repeat to be trusted. Two repairs of one plan at different budgets that pick different tokens say the
        token rests on what the repairs left stale: a margin cannot show it, the upper repair can be sure and wrong
        (Gemma 3 270M: at 0.3 after 0.15, 5 of 8 such tokens flipped against 10 of 472 where they agreed;
        docs/method.md). So a disagreement climbs on, at no cost where they agree: both logits are at hand."""
        refused = [j for j in self.judged if j.index == index and not j.served and j.step != HALF]
        return refused[-1].top if refused else None

    def _half_tried(self) -> bool:
        """Whether HALF is a step still to try: calibrated floors, a bf16 model, not tried already, and paying."""
        return (self.policy.half_curve is not None and all(s.step != HALF for s in self.served)
                and (self._next > 0 or self.worth(1.0, HALF)) and self.builder.half() is not None)

    def climb(self, answer: Sequence[int]) -> Built:
        """The cache to serve answer token len(answer) from, the one it has refused: the next escalation whose
        logits the guard trusts, else a full prefill. `answer`: the tokens sent so far."""
        first = len(answer)
        if self.served[-1].first_token == first:  # refused before serving anything (a first token): not a step
            self.served.pop()
        else:  # left part-way: the step's cache did not serve the whole answer
            self._outcome(False)
        below = self.served[-1].budget if self.served else self.policy.budget
        for budget in (b for b in self.policy.escalations if b > below and self.worth(b)):
            built = self.builder.repaired(budget, answer)
            self._guard.predictor, self._guard.target = self.policy.judged_by(ESCALATE, budget)
            if self.first_judged(built.logits, budget, ESCALATE, self._refused_top(first)):
                self.served.append(Served(first, ESCALATE, budget, built.recomputed_tokens))
                return built
        if self._half_tried():
            built = self.builder.halved(answer)
            self._guard.predictor, self._guard.target = self.policy.judged_by(HALF, 1.0)
            if self.first_judged(built.logits, 1.0, HALF):
                self.served.append(Served(first, HALF, 1.0, built.recomputed_tokens))
                return built
        built = self.builder.exact(answer)
        self.served.append(Served(first, FULL, 1.0, built.recomputed_tokens))
        self._guard.predictor, self._guard.target = self.policy.judged_by(FULL, 1.0)
        self._guard.passes(fidelity.margin(built.logits))
        return built


def start(builder: Builder, guard: Policy | None) -> tuple[Built, Watch | None, tuple[Served, ...]]:
    """A request's first cache: its strategy's prefill, then, when guarded and the first token cannot be trusted
    there, the ladder (straight to it when the request's own repair does not pay where the engine runs). The Watch
    (None: unguarded) goes on guarding the answer; the steps that serve its first token on."""
    budget = builder.settings.budget if builder.strategy.guarded else None
    if guard is None:
        built = builder.repaired()
        return built, None, (Served(0, REPAIR, budget, built.recomputed_tokens),)
    watch = Watch(guard, builder, [Served(0, REPAIR, budget, 0)])
    if guard.acts and not watch.worth(guard.budget):
        return watch.climb(()), watch, tuple(watch.served)
    built = builder.repaired()
    watch.served[0] = Served(0, REPAIR, budget, built.recomputed_tokens)
    if not watch.first_judged(built.logits, guard.budget):
        built = watch.climb(())
    return built, watch, tuple(watch.served)


@torch.inference_mode()
def tried(builder: Builder, trial: Trial, answer: Sequence[int]) -> bool:
    """Make `trial`: build its step's cache for the request again (timed, routes.py) and judge it along `answer`
    [T], the tokens the request was served, teacher-forced; record whether it would have served them all (its first
    token and every later one trusted), and return it. Its forwards take the engine's lock, as a request's do.

    Judged from the answer's first token on, by a guard of the request's policy, and for an escalation by its
    margins alone (a served escalation's top token must also be the refused repair's, which a trial does not
    build): a trial can misjudge cost only, never fidelity, as skipping moves cost only. At a level held on average
    it may borrow what the level's account holds now, from a copy (an account lends to answers served, not to
    trials): judged as if held per answer, a step that serves `balanced` answers on credit looked as if it never
    lasted, and was skipped for good (Gemma 3 270M, man_pages, 64 tokens: every answer a full prefill, the account
    full and unused; docs/method.md)."""
    built = builder.halved() if trial.step == HALF else builder.repaired(trial.budget)
    account = trial.policy.account.copy() if trial.policy.account is not None else None
    judge = fidelity.Guard(*trial.policy.judged_by(trial.step, trial.budget), trial.policy.minimum, account)
    held = judge.trusts(built.logits)
    if held and len(answer) > 1:
        with builder.lock:
            hidden = appended(builder.adapter, built.cache, builder.plan.num_tokens, answer[:-1])  # [1, T - 1, H]
            held = all(judge.trusts(row) for row in builder.adapter.logits(hidden))  # before tokens 1 .. T - 1
    builder.routes.judged(trial.key, held)
    return held


def resume(guard: Policy | None, builder: Builder | None, served: Sequence[Served], risk: float,
           judged: Sequence[Judged] = (), first: torch.Tensor | None = None) -> Watch | None:
    """The guard of a stream decoding from a prefill that `start` left at `served` and `risk`, whose first-token
    logits are `first`; None when nothing is left to guard (unguarded, or on a full prefill already, unless the
    level is held on average: the floor's risk over the exact tokens is then counted, see fidelity.Account). A new
    Watch per stream: a prefill may be decoded more than once."""
    if guard is None or builder is None or (served[-1].step == FULL and guard.account is None):
        return None
    return Watch(guard, builder, served, risk, judged, first)
