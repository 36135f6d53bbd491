"""The fidelity guard: an answer that stays a full prefill's, checked token by token.

A reused cache is close to a full prefill's, not equal: its next-token distribution differs a little, and a
greedy answer changes where that little difference swaps the top two tokens, which happens where the model is
unsure between them. So the guard watches each token's margin under the reused cache, log p(top 1) - log p(top
2), and predicts from it the chance that a full prefill would pick another token there:

    P(flip | margin) = sigmoid(intercept + slope * margin)

fitted per model and corpus (`fit`, on calibration prompts: the reused cache's margins against a full prefill's
greedy tokens, teacher-forced, the curve raised to expect one flip more than they held, so that a budget whose
calibration saw none is not the most trusted; run by ingestion itself, see calibrate.py) and saved beside the
store (its disk folder, its Redis tier). One curve per recompute budget the levels run at: a cache repaired less
is wrong more often at the same margin, so a curve fitted at balanced's budget would make strict's (larger) one
fall back far more than it needs to; a request is judged by the curve of its own budget (`Predictor.at`).

A request's risk is the chance its answer differs from a full prefill's so far,
1 - prod(1 - P(flip | m_t)) over the tokens served from the reused cache. Before a token would take the risk
over the request's target, the request climbs a ladder (repair/guard.py, where every decision of the guard is
made): the same plan repaired again at larger budgets, each judged by its own curve, then the exact cache (a full
prefill of the prompt and the tokens so far), decoded from then on. The first token's check comes before it is
sent, so a request that starts unsure pays for the steps it tried in its TTFT; a later one costs total time, not
TTFT. Served answers are also checked against a full prefill in the background, refitting the curves on what
users ask (shadow.py).

Levels are held to floors users already accept (issue 41), measured on the calibration prompts (and refit on served
requests by the shadow checks, shadow.py): "balanced" lets an answer differ from a full prefill's no more often
than a full prefill of the same documents in another order does (the order floor), "strict" no more often than a
full prefill in the other dtype (bf16 against float32: the dtype floor). Each floor is a curve too, P(the floor's
token differs | margin), fitted on the same steps (the floor's flips against the reused cache's margins at that
budget): a request is trusted while its risk stays within the risk the floor would run over the very same tokens.
So an answer through unsure tokens, which any other order would change as well, is not moved for being unsure, and
a long one not for being long. "fast" has no guard; a number in (0, 1) is a fixed risk per answer; without floors
(no calibration yet) the levels fall back to BALANCED and STRICT per answer, and the model's DEFAULT curve serves,
a conservative one.

A floor is a rate over answers, and holding every answer to it is stricter than the rate: an answer whose first
token the reused cache is less sure of than the floor moves to an exact cache even where the answers before it
ran far less risk than theirs. So `balanced` is held on average too (`Account`, one per engine): what an answer
leaves of its floor's risk when it completes (the floor's risk over all its tokens, those served exactly included,
less its own) is lent on, a share LEND of it, up to EngineConfig.floor_credit answers' worth, and a later answer
whose risk would pass its own allowance borrows the difference instead of moving, while there is some. The summed
risk of the answers then stays under the floor's summed risk, by what is not lent. On Gemma 3 270M and manual
pages, where the per-answer rule moved 83% of the answers to a bf16 prefill before their first token (1.70x, 0.95
of the answers full's where the order floor keeps 0.52), held on average it moves 36% (2.84x, 0.66; docs/method.md).
`strict` is held answer by answer: its floor, bf16's, changes one answer in tens, so there is next to nothing to
lend, and what was lent there cost one answer more than the floor changed (the same run: 1.71x against 1.67x).

Predicted against observed (`Observed`): the shadow checks' figures (the answers' summed risks against those that
differed from a full prefill's; the served tokens' summed flip chances against the flips; each floor's curve, at the
judged tokens, against the tokens where the floor differed from full) are kept with the curve they refit, in its
file's metadata, so `kvboost-rag store stats` (and `store verify redis://...`) can show them without a model; the
bench reports the same figures per strategy.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass, field, fields, replace

import safetensors.torch
import torch

from .store.files import safetensors_metadata

# 3: one curve per recompute budget; 4: and the floors' curves at it. The shadow checks' figures (Observed) are
# optional metadata, read by 4's readers as none where absent and ignored where not known: no new version. 5: the
# curves fitted cautious where calibration saw few flips (fit's pseudo_flips), so a 4's plain curves are fitted again.
# 6: and the HALF step's own curve (Predictor.half), which a 5 has not. 7: that curve expecting at least half the
# flips bf16 throughout made (calibrate.py), so a 6's, fitted on none where bf16 made several, are fitted again.
VERSION = 7
LEVELS = ("fast", "balanced", "strict")
BALANCED = 0.15  # target chance, per request, that the answer differs from a full prefill's
STRICT = 0.03
MIN_TOKENS = 32  # calibration tokens a fit needs, at least a few of them flips
# A prior curve whose expected flips at the new samples' margins are more standard deviations than this from the
# flips counted there is refuted by them, and counts the less the further (fit's prior).
REFUTED = 3.0
# Calibration's curves expect this many flips more on their samples than they hold (fit's pseudo_flips): the rule
# of succession, for a budget whose calibration saw almost none.
PSEUDO_FLIPS = 1.0
# Used until a corpus is calibrated: a flip is even odds at margin 0 and 1 in 50 at 2 nats.
DEFAULT = (0.0, -2.0)
# The share of an answer's unspent floor risk lent on to later answers (Account): not all of it, so that a level
# held on average stays under its floor by what it keeps, where a mean held exactly at the floor would come out
# under it half the time from the curves' own error (they are fitted on tens of flips).
LEND = 0.5


def target_of(fidelity: str | float) -> float | None:
    """The risk a fidelity setting allows per request; None for "fast" (no guard)."""
    return {"fast": None, "balanced": BALANCED, "strict": STRICT}.get(fidelity, fidelity)  # type: ignore[arg-type]


def margin(logits: torch.Tensor) -> float:
    """log p(top 1) - log p(top 2) of next-token logits [V]: how sure the model is of its greedy token."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


@dataclass(frozen=True)
class Observed:
    """The guard's predictions against what checks against a full prefill found (shadow.py's checks of served
    answers, kept with the curve they refit): over the answers, their summed risks (Generation.fidelity_estimate)
    against those that differed from a full prefill's; over the tokens served from reused caches, their summed
    flip chances against the tokens a full prefill chose otherwise; and per floor (where the checks ran the floors,
    shadow.py), over the judged tokens, the floor curve's summed chances that the floor's token differs from full's
    against the tokens where it did. Sums, not means, so that two sets add up."""

    checks: int = 0
    answers: int = 0
    predicted_differ: float = 0.0
    observed_differ: int = 0
    tokens: int = 0
    predicted_flips: float = 0.0
    observed_flips: int = 0
    # The floors' (FLOOR_FIELDS): optional in a file, a file written before them has none
    order_tokens: int = 0
    order_predicted_flips: float = 0.0
    order_observed_flips: int = 0
    dtype_tokens: int = 0
    dtype_predicted_flips: float = 0.0
    dtype_observed_flips: int = 0

    def __add__(self, other: Observed) -> Observed:
        return Observed(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: Observed) -> Observed:
        return Observed(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def answer_figures(self) -> dict:
        """Per answer: the sums, the shares (predicted: the mean risk) and predicted / observed (None where there is
        nothing to divide by)."""
        return {"answers": self.answers, "predicted_differ": self.predicted_differ,
                "observed_differ": self.observed_differ,
                "predicted_differ_share": _divided(self.predicted_differ, self.answers),
                "observed_differ_share": _divided(self.observed_differ, self.answers),
                "differ_ratio": _divided(self.predicted_differ, self.observed_differ)}

    def figures(self) -> dict:
        """answer_figures, the checks, the same per served token, and per floor per judged token ("floors")."""
        return {"checks": self.checks, **self.answer_figures(),
                **_flip_figures(self.tokens, self.predicted_flips, self.observed_flips),
                "floors": {floor: _flip_figures(*(getattr(self, f"{floor}_{name}") for name in FLOOR_FIELDS))
                           for floor in FLOOR_NAMES}}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Observed:
        """The figures `to_json` wrote; ValueError unless every one is there, of its type, finite and not negative."""
        values = json.loads(text)
        kinds = {f.name: f.type for f in fields(cls)}
        if not isinstance(values, dict) or not set(kinds) - set(FLOOR_KEYS) <= set(values) <= set(kinds):
            raise ValueError(f"observed fidelity figures must be {sorted(kinds)}")
        for name, value in values.items():
            counted = kinds[name] == "int"
            if (isinstance(value, bool) or not isinstance(value, int if counted else (int, float))
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"observed fidelity figure {name}={value!r}")
        return cls(**{name: value if kinds[name] == "int" else float(value) for name, value in values.items()})


FLOOR_NAMES = ("order", "dtype")  # Predictor.floors' order
FLOOR_FIELDS = ("tokens", "predicted_flips", "observed_flips")  # Observed's per floor, named f"{floor}_{field}"
FLOOR_KEYS = tuple(f"{floor}_{name}" for floor in FLOOR_NAMES for name in FLOOR_FIELDS)  # those fields' names


def _flip_figures(tokens: int, predicted: float, observed: int) -> dict:
    return {"tokens": tokens, "predicted_flips": predicted, "observed_flips": observed,
            "predicted_flip_share": _divided(predicted, tokens), "observed_flip_share": _divided(observed, tokens),
            "flip_ratio": _divided(predicted, observed)}


def _divided(a: float, b: float) -> float | None:
    return a / b if b else None


def observed_in(data: bytes) -> Observed | None:
    """The Observed figures in a fidelity file's metadata (to_bytes); None when it has none (no shadow check has
    refit its curve, or a file written before they were kept). ValueError when they, or the bytes, are damaged."""
    text = safetensors_metadata(data).get("observed")
    return None if text is None else Observed.from_json(text)


@dataclass(frozen=True)
class Predictor:
    intercept: float
    slope: float
    tokens: int = 0  # calibration tokens fitted on (0: the model's default curve)
    flips: int = 0  # of them, tokens a full prefill chose otherwise
    documents: int = 0  # the corpus's size when fitted (a corpus that doubles is fitted again)
    budget: float = 0.0  # the recompute budget its prompts were repaired at (0: the default curve, any budget)
    others: tuple[Predictor, ...] = ()  # the curves fitted at the other levels' budgets in the same pass
    # The floors' curves at this budget, fitted in the same pass: (order, dtype); None: the levels' fixed targets
    floors: tuple[Predictor, Predictor] | None = None
    # The curve the ladder's HALF step (a bf16 full prefill, decoded on in float32) is judged by, on the main curve
    # only: P(its token differs from a float32 full prefill's | its own margin), fitted on what the step serves
    # (expecting at least half the flips bf16 throughout made there, calibrate.py), refit by the shadow checks.
    # Not the dtype floor's curve, which holds `strict` to the floor as measured, at the reused cache's margins: an
    # estimate by it was 10x low on Gemma 3 270M where bf16 changed a quarter of the answers (docs/method.md).
    # None: uncalibrated, no HALF step.
    half: Predictor | None = None
    # The shadow checks' figures so far (shadow.py), on the main curve only; None: no check has refit a curve yet
    observed: Observed | None = None
    # The ladder's routes as saved with the curves (repair/routes.py's to_json), read back by from_bytes; None: none.
    # Not the curves' own: two predictors of the same curves are equal whatever routes they were saved with.
    routes: str | None = field(default=None, compare=False)

    def flip_chance(self, margin: float) -> float:
        z = self.intercept + self.slope * margin
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def at(self, budget: float) -> Predictor:
        """The curve for a request repaired at `budget`: the one fitted at the largest budget not above it (a
        cache repaired less deviates more, so a smaller budget's curve is the cautious one), else the smallest."""
        curves = sorted((self, *self.others), key=lambda curve: curve.budget)
        below = [curve for curve in curves if curve.budget <= budget + 1e-9]
        return below[-1] if below else curves[0]

    def with_others(self, others: Sequence[Predictor]) -> Predictor:
        return replace(self, others=tuple(replace(curve, others=(), half=None) for curve in others))


DEFAULT_PREDICTOR = Predictor(*DEFAULT)


def target_for(fidelity: str | float, curve: Predictor) -> float | Predictor | None:
    """What a request at `fidelity`, judged by `curve`, is held to: its level's floor curve where calibrated (see
    the module's docstring), else a fixed risk per answer (target_of); None for "fast"."""
    if fidelity in ("balanced", "strict") and curve.floors is not None:
        return curve.floors[0 if fidelity == "balanced" else 1]
    return target_of(fidelity)


@dataclass
class Account:
    """The floor risk left unspent by a level's answers before, lent to those that would pass theirs (see the
    module's docstring): `balanced`'s, one per engine, in memory, empty at start. Thread-safe: requests borrow from
    several threads. `cap`: the most it holds, in answers' worth of risk (EngineConfig.floor_credit; 0 lends
    nothing), so that a run of easy answers cannot pay for a burst of hard ones beyond it."""

    cap: float
    credit: float = 0.0
    loans: int = 0  # borrowings granted
    borrowed: float = 0.0  # their sum
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def borrow(self, amount: float) -> bool:
        """Take `amount` of risk if the account holds it."""
        with self._lock:
            if amount > self.credit:
                return False
            self.credit -= amount
            self.loans, self.borrowed = self.loans + 1, self.borrowed + amount
            return True

    def repay(self, returned: float, unspent: float) -> None:
        """A completed answer gives back what it borrowed and did not need (`returned`), and lends LEND of the
        floor risk it left unspent."""
        with self._lock:
            self.credit = min(self.cap, self.credit + returned + LEND * unspent)

    def figures(self) -> dict:
        with self._lock:
            return {"cap": self.cap, "credit": self.credit, "loans": self.loans, "borrowed": self.borrowed}

    def copy(self) -> Account:
        """An account holding what this one holds now, for judging what an answer could borrow without lending it
        (the ladder's trials: repair/guard.tried)."""
        with self._lock:
            return Account(self.cap, self.credit)


class Guard:
    """One request's running risk: `trusts(logits)` says whether the next token may come from the reused cache
    (and counts its risk in), or must come from an exact one. `target`: a fixed risk per answer, or a floor's
    curve (the risk the floor would run over the same tokens, accumulated alongside); `minimum`: a risk per answer
    always allowed, so that a floor measured on few calibration prompts, which may have changed nothing, never
    holds a level tighter than its fixed target (BALANCED, STRICT). `account`: the level's, which a token past the
    floor's allowance borrows the difference from (held on average); None: every answer held to its own floor."""

    def __init__(self, predictor: Predictor, target: float | Predictor, minimum: float = 0.0,
                 account: Account | None = None):
        self.predictor, self.target, self.minimum, self.account = predictor, target, minimum, account
        self.survive = 1.0  # chance the answer so far equals a full prefill's
        self.floor_survive = 1.0  # the same for the floor, over the same tokens
        # From the account, in all: a stream's guard starts with what its prefill's borrowed (repair/guard.Watch)
        self.borrowed = 0.0
        self._borrowed_here = 0.0  # of it, by this guard: what `settle` may return

    @property
    def risk(self) -> float:
        return 1.0 - self.survive

    @property
    def allowed(self) -> float:
        """The risk the answer may run on its own: its floor's over the same tokens (at least `minimum`), or the
        fixed target."""
        return self._allowed(self.floor_survive)

    def _allowed(self, floor_survive: float) -> float:
        return max(1.0 - floor_survive, self.minimum) if isinstance(self.target, Predictor) else self.target

    def trusts(self, logits: torch.Tensor) -> bool:
        return self.admits(margin(logits))

    def admits(self, token_margin: float) -> bool:
        """`trusts` for a token whose margin is known."""
        p = self.predictor.flip_chance(token_margin)
        q = self.target.flip_chance(token_margin) if isinstance(self.target, Predictor) else 0.0
        floor_survive = self.floor_survive * (1.0 - q)
        short = 1.0 - self.survive * (1.0 - p) - self._allowed(floor_survive) - self.borrowed  # past allowance, loans
        if short > 0 and not self._borrow(short):
            return False
        self.survive *= 1.0 - p
        self.floor_survive = floor_survive
        return True

    def passes(self, token_margin: float) -> None:
        """A token served from an exact cache: nothing risked, but the floor's risk over it counts in the answer's
        allowance, as it counts in the floor's rate."""
        if isinstance(self.target, Predictor):
            self.floor_survive *= 1.0 - self.target.flip_chance(token_margin)

    def settle(self) -> None:
        """The answer is complete: give the account back what this guard borrowed beyond the answer's final need,
        and lend on the floor risk it left unspent."""
        if self.account is None or not isinstance(self.target, Predictor):
            return
        need = max(0.0, self.risk - self.allowed)
        returned = min(self._borrowed_here, max(0.0, self.borrowed - need))
        self.account.repay(returned, max(0.0, 1.0 - self.floor_survive - self.risk))
        self.borrowed -= returned
        self._borrowed_here = 0.0

    def _borrow(self, amount: float) -> bool:
        if self.account is None or not isinstance(self.target, Predictor) or not self.account.borrow(amount):
            return False
        self.borrowed += amount
        self._borrowed_here += amount
        return True


def fit(margins: Sequence[float], flipped: Sequence[bool], documents: int = 0, budget: float = 0.0,
        prior: Predictor | None = None, pseudo_flips: float = 0.0) -> Predictor:
    """Logistic regression of `flipped` on `margins` (Newton's method with step halving, a small ridge towards the
    DEFAULT curve), for requests repaired at `budget`. The step halving keeps a nearly separable sample (a floor
    that flips only where margins are small, say) from overshooting into a curve of huge coefficients.

    With `prior` (a curve fitted before, on its `tokens`), that curve counts as much as the tokens it was fitted on:
    it adds, at the same margins, its own flip chances as soft labels, weighing `prior.tokens` in all, so that a few
    new samples move a curve fitted on many only part of the way (shadow.py). Unless the samples refute it: a prior
    that expects a number of flips at their margins more than REFUTED standard deviations from the count weighs
    (REFUTED / z)^2 of its tokens (at twice the distance, a quarter), never less than MIN_TOKENS' worth, so a curve
    calibrated elsewhere and wrong here is replaced by what the checks see, where one they agree with only moves.
    The result counts both's tokens.

    With `pseudo_flips`, the fitted curve is raised (its intercept) until it expects that many flips more on the
    samples than they hold: the rule of succession. A sample with one flip or none otherwise gives a curve that
    predicts almost none anywhere, and the guard would trust it most where it knows least (Gemma 3 270M's
    calibration sees 1, 1 and 0 flips in 192 tokens at its three budgets, where held-out questions flip 18, 17 and
    15 of 480; the plain fits predict 7.8, 9.7 and 0.4 of them, raised by one flip 13.0, 15.6 and 8.5:
    research/curve_fits.py). Where a sample holds many flips, one more moves the curve little."""
    if len(margins) < MIN_TOKENS:
        raise ValueError(f"a fidelity predictor needs at least {MIN_TOKENS} calibration tokens, got {len(margins)}")
    x = torch.tensor(list(margins), dtype=torch.float64)
    y = torch.tensor([float(f) for f in flipped], dtype=torch.float64)
    weight = torch.ones_like(x)
    tokens, flips = len(margins), int(y.sum())
    if prior is not None and prior.tokens > 0:
        soft = torch.tensor([prior.flip_chance(m) for m in margins], dtype=torch.float64)
        # The flips' count has variance sum p(1 - p) under the prior; at least 1, so that one flip where it expects
        # none is no refutation.
        z = abs(float(y.sum() - soft.sum())) / math.sqrt(max(float((soft * (1 - soft)).sum()), 1.0))
        counted = max(prior.tokens * min(1.0, (REFUTED / z) ** 2) if z > 0 else prior.tokens,
                      min(prior.tokens, MIN_TOKENS))
        x, y = torch.cat([x, x]), torch.cat([y, soft])
        weight = torch.cat([weight, torch.full_like(weight, counted / len(margins))])
        tokens, flips = tokens + prior.tokens, flips + prior.flips
    design = torch.stack([torch.ones_like(x), x], dim=1)  # [T, 2]
    centre = torch.tensor(DEFAULT, dtype=torch.float64)
    ridge = 1e-2 * torch.eye(2, dtype=torch.float64)

    def loss(w: torch.Tensor) -> float:  # the penalized negative log-likelihood
        z = design @ w
        return float((weight * (torch.nn.functional.softplus(z) - y * z)).sum()
                     + 0.5 * (w - centre) @ ridge @ (w - centre))

    w = centre.clone()
    for _ in range(100):
        p = torch.sigmoid(design @ w)
        grad = design.T @ (weight * (p - y)) + ridge @ (w - centre)
        hess = design.T @ (design * (weight * p * (1 - p))[:, None]) + ridge
        step = torch.linalg.solve(hess, grad)
        scale, before = 1.0, loss(w)
        while scale > 1e-6 and loss(w - scale * step) > before:
            scale /= 2
        w = w - scale * step
        if (scale * step).abs().max() < 1e-9:
            break
    if pseudo_flips > 0:
        w[0] += _raise_to(design @ w, weight, float((weight * y).sum()) + pseudo_flips)
    return Predictor(float(w[0]), float(w[1]), tokens, flips, documents, budget)


def _raise_to(z: torch.Tensor, weight: torch.Tensor, flips: float) -> float:
    """How much to add to logits `z` [T] for their (weighted) flip chances to sum to `flips`, by bisection: the sum
    grows with the shift. Hand-written: scipy's root finders are not a dependency, and this runs once per curve."""
    low, high = 0.0, 64.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if float((weight * torch.sigmoid(z + mid)).sum()) < flips else (low, mid)
    return low


def to_bytes(predictor: Predictor, fingerprint: str, routes: str | None = None) -> bytes:
    """The predictor as safetensors, its metadata naming the model (fingerprint) and format version: what
    calibrate.save keeps beside the engine's store (a file, a Redis value). One row per curve, the main one
    first: (budget, intercept, slope, tokens, flips), then the same four for the order and the dtype floor's
    curves (NaN without floors); and the bf16 prefill's curve (Predictor.half) as "half": (intercept, slope, tokens,
    flips), NaN without one. The shadow checks' figures, where there are some, as JSON in the metadata
    ("observed"): a reader of version 4 without them ignores them, and one with them reads a file without as none.
    So with the ladder's routes (`routes`, repair/routes.py's JSON; default: the predictor's own)."""
    meta = {"fingerprint": fingerprint, "version": str(VERSION), "documents": str(predictor.documents)}
    if predictor.observed is not None:
        meta["observed"] = predictor.observed.to_json()
    if (routes := routes or predictor.routes) is not None:
        meta["routes"] = routes
    rows = []
    for c in (predictor, *predictor.others):
        floors = ([v for f in c.floors for v in (f.intercept, f.slope, f.tokens, f.flips)] if c.floors
                  else [math.nan] * 8)
        rows.append([c.budget, c.intercept, c.slope, c.tokens, c.flips, *floors])
    half = predictor.half
    half_row = [half.intercept, half.slope, half.tokens, half.flips] if half is not None else [math.nan] * 4
    return safetensors.torch.save({"curves": torch.tensor(rows, dtype=torch.float64),
                                   "half": torch.tensor(half_row, dtype=torch.float64)}, metadata=meta)


def from_bytes(data: bytes, fingerprint: str) -> Predictor | None:
    """The predictor in `data` when it is this engine's (model, weights, dtype, tokenizer, encoding) and whole;
    else None: a foreign, old or damaged one is never used."""
    try:
        meta = safetensors_metadata(data)
        tensors = safetensors.torch.load(bytes(data))
        curves, half_row = tensors["curves"], tensors["half"]
        documents = int(meta.get("documents", 0))
        observed = Observed.from_json(meta["observed"]) if "observed" in meta else None
    except Exception:  # noqa: BLE001 - safetensors raises its own error type for every kind of damage
        return None
    if (meta.get("fingerprint") != fingerprint or meta.get("version") != str(VERSION) or curves.ndim != 2
            or curves.shape[0] < 1 or curves.shape[1] != 13 or not torch.isfinite(curves[:, :5]).all()
            or half_row.shape != (4,) or not (torch.isfinite(half_row).all() or torch.isnan(half_row).all())):
        return None
    half = None
    if torch.isfinite(half_row).all():
        intercept, slope, tokens, flips = half_row.tolist()
        half = Predictor(intercept, slope, int(tokens), int(flips), documents, 1.0)
    parsed = []
    for row in curves.tolist():
        budget, intercept, slope, tokens, flips, *floor_values = row
        floors = None
        if all(math.isfinite(v) for v in floor_values):
            floors = tuple(Predictor(i, s, int(t), int(f), documents, budget)
                           for i, s, t, f in (floor_values[:4], floor_values[4:]))
        elif not all(math.isnan(v) for v in floor_values):
            return None  # partly there: damaged
        parsed.append(Predictor(intercept, slope, int(tokens), int(flips), documents, budget, floors=floors))
    main, *others = parsed
    return replace(main, half=half, observed=observed, routes=meta.get("routes")).with_others(others)
