"""What the auto encoder mode learns from the calls it runs, and how it picks a plan. Pure.

The start-up calibration (vision/encoder_calibration.py) gives a cost model; one noisy probe
can make it wrong by a large factor. Each call's measured time (the slowest rank's, agreed by
the ranks before anyone learns from it) over the time the model predicted is a *ratio*, kept
per size class (the call's total patches and item count, each to a power of two) and per kind
of plan ("dp", "tp", "hybrid"). A kind's estimate for a class is the median of its recent log
ratios there: one slow outlier moves nothing. A kind not yet measured in a class borrows its
ratio from the other classes, scaled by how the class's measured kinds compare with theirs (see
`ratios_of`): load that arrives after the calibration then cannot make an untried plan look
cheaper than the tried ones. A kind measured nowhere yet takes the class's measured level:
how far a tried kind missed its model is, on a class's first calls, the machine (load that came
after the calibration, a first call's allocations), which the untried kind shares; what is that
kind's own model is found by trying the other kind, not by guessing. (At half the level, one
slow first call of TP on a loaded tp 2 host made an untried DP look cheaper, and a class ran
the slower DP greedily from its second call: the first calls of issue 54's stream.)

Choosing (`EncoderLearner.choose`), given the best plan of each kind under the model:
- the greedy plan is the one with the lowest estimate. With nothing measured every ratio is 1
  (an untried hybrid is priced with TP's and DP's ratios on its two parts), so the first calls
  do what the calibration says: the better static mode for the batch shape;
- each kind's estimate has a band (`width`, in log units). Measured n times in the class:
  `confidence * noise / sqrt(n)`, where `noise` is the robust spread of one call's time around
  its kind's median, pooled over every class and kind (the machine's noise, not a constant),
  but never narrower than `early_spread[n - 1]` while n is below `min_tries`: the pooled spread
  is a median and ignores outliers by design, so one unlucky try (a call 1.6x slow while the
  machine was busy) could otherwise separate and settle a class on the wrong plan for good. A
  kind one try could misjudge by up to 2x is tried again; past a quarter it is separated after
  two tries; a plan 1.3x slower on a quiet machine after one or two. Borrowed from
  other classes: how far borrowing missed in the classes where it can be checked, plus the
  noise. Untried anywhere: `untried_spread`, 2x: the start-up calibration timed every kind on
  this device and group, so its order of two kinds is trusted where they are more than 2x
  apart, and only nearer kinds are ever tried (a 4x band tried every kind of every class, a
  tenth of the first calls, even where the calibration was decisive). Another kind is
  *separated* from the greedy plan once its optimistic end lies above the greedy plan's
  estimate, less `tolerance` once it has
  `min_tries` measurements in the class (two plans within 3% of each other are not worth
  telling apart: with only the last 9 calls in a median, their bands never would). A try is
  made for a possible gain: comparing with the greedy plan's pessimistic end as well kept a
  plan measured 2x slower unseparated on a machine whose speed drifts by a quarter, and tried
  it every eighth call;
- when every other kind is separated from the greedy plan, the class is *settled*: nothing is
  explored there until the greedy plan's own estimate moves by more than its band from where it
  stood when the class settled (new evidence: the machine changed), and then the bands decide
  afresh;
- otherwise the unseparated kind with the lowest optimistic estimate is explored, but never on
  a class's first call, never while an earlier try of that kind in that class is not yet
  measured, and only while explorations stay within `explore_fraction` of all calls (counted
  over the whole run) and, past a class's first try, of that class's calls.

Every rank feeds the same times in the same order (see AutoEncoder), so every rank holds the
same state and chooses the same plan: agreement by construction, with no message per plan.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vision.encoder_plan import EncoderPlan

KINDS = ("dp", "tp", "hybrid")
RELATIVE = ("hybrid",)  # ratios on top of the TP and DP ratios of the plan's parts (Scale)
SizeClass = tuple[int, int]


def _borrowed(own: Mapping[str, float], overall: Mapping[str, float], kind: str) -> float:
    """A kind's log ratio in a class borrowed from every class's (`overall`): shifted by the
    level of the class's own measured TP and DP ratios against theirs (a slow class is slow
    for both), except for a hybrid's, which is already relative to its parts' ratios."""
    levels = [own[k] - overall[k] for k in own if k not in RELATIVE and k in overall]
    if kind in RELATIVE or not levels:
        return overall[kind]
    return statistics.fmean(levels) + overall[kind]


def size_class(units: Sequence[Sequence[int]]) -> SizeClass:
    """(total patches, item count), each as its power-of-two bucket (`int.bit_length`)."""
    patches = sum(int(t) * int(h) * int(w) for t, h, w in units)
    return patches.bit_length(), len(units).bit_length()


@dataclass
class RatioStats:
    """Recent log(measured / modeled) of one kind in one size class; `count` counts them all.
    `misses`: each recent value's distance from the median of the others (the noise sample)."""

    window: int
    recent: deque[float] = field(default_factory=deque)
    count: int = 0
    misses: list[float] = field(default_factory=list)

    def add(self, log_ratio: float) -> None:
        self.recent.append(log_ratio)
        if len(self.recent) > self.window:
            self.recent.popleft()
        self.count += 1
        self.misses = leave_one_out_misses(list(self.recent))

    def log_ratio(self) -> float:
        return statistics.median(self.recent)

    def ratio(self) -> float:
        return math.exp(self.log_ratio())


def leave_one_out_misses(values: list[float]) -> list[float]:
    """|v - median(the others)| for each value; nothing below 3 values (no spread to see)."""
    if len(values) < 3:
        return []
    return [abs(v - statistics.median(values[:i] + values[i + 1 :])) for i, v in enumerate(values)]


@dataclass(frozen=True)
class Choice:
    """The plan to run and why: `explored` when it is not the greedy plan."""

    plan: EncoderPlan
    klass: SizeClass
    explored: bool


@dataclass
class EncoderLearner:
    """Per (size class, kind) ratio statistics, the exploration budget, and the choice rule."""

    window: int = 9  # recent measurements per kind and class the median is taken over
    untried_spread: float = 2.0  # the calibration's order of two kinds is trusted beyond this
    prior_noise: float = 0.15  # one call's log spread until `min_misses` misses are measured
    noise_floor: float = 0.02  # no machine is trusted to repeat a call closer than this
    min_misses: int = 6
    confidence: float = 2.5  # band = confidence * noise / sqrt(n)
    explore_fraction: float = 0.125  # at most this share of all calls explore
    tolerance: float = 0.03  # a plan tried `min_tries` times that cannot gain this is left alone
    min_tries: int = 3
    early_spread: tuple[float, ...] = (2.0, 1.25)  # least band after 1, 2 tries in a class
    calls: int = 0
    explored: int = 0
    stats: dict[tuple[SizeClass, str], RatioStats] = field(default_factory=dict)
    settled: dict[SizeClass, tuple[str, float]] = field(default_factory=dict)  # kind, log ratio
    seen: set[SizeClass] = field(default_factory=set)
    pending: Counter[tuple[SizeClass, str]] = field(default_factory=Counter)  # tries not measured
    class_calls: Counter[SizeClass] = field(default_factory=Counter)
    class_explored: Counter[SizeClass] = field(default_factory=Counter)
    _cache: dict[str, float | None] = field(default_factory=dict, repr=False)

    def ratios_of(self, klass: SizeClass) -> dict[str, float]:
        """Each kind's learned ratio in one class (absent: unknown, the calibration stands).

        Nothing measured in the class: nothing (its first calls follow the calibration). A
        kind measured in this class has its own median. A kind measured only elsewhere
        borrows: its ratio over every class, times how this class's measured TP and DP stand
        against theirs (their geometric mean of own / overall); a hybrid's ratio, relative to
        its parts' (see `Scale`), is borrowed as it is. A machine that slowed down
        after the start-up calibration slows every kind alike, so an untried kind must not
        look cheaper merely because the tried ones were measured on the slower machine.

        A TP or DP measured nowhere yet takes the level of the class's measured TP and DP
        (the mean of their log ratios): priced at 1, an untried TP priced a hybrid's TP part
        10-30% under the DP measured beside it, and the hybrid, truly slower, ran greedily for
        rounds (tp 2, the benchmark's random workload); at half the level, a first call slowed
        by the machine moved its class to the untried kind (issue 54's stream). At the full
        level the calibration's order stands until the other kind is tried."""
        own = {k: self.stats[klass, k].log_ratio() for k in KINDS if (klass, k) in self.stats}
        if not own:
            return {}  # a class's first call does what the calibration says (the safe default)
        overall = self._overall()
        logs = {k: _borrowed(own, overall, k) for k in overall}
        level = [v for k, v in own.items() if k not in RELATIVE]
        if level:
            guess = statistics.fmean(level)
            logs |= {k: guess for k in KINDS if k not in RELATIVE and k not in logs}
        return {k: math.exp(v) for k, v in {**logs, **own}.items()}

    def _overall(self, without: SizeClass | None = None) -> dict[str, float]:
        """Each measured kind's median log ratio over the recent measurements of every class
        (but `without`)."""
        logs: dict[str, list[float]] = {}
        for (klass, kind), stats in self.stats.items():
            if klass != without:
                logs.setdefault(kind, []).extend(stats.recent)
        return {k: statistics.median(v) for k, v in logs.items()}

    def noise(self) -> float:
        """The robust spread (log units) of one call's time: 1.4826 times the median miss,
        pooled over every class and kind measured at least 3 times; `prior_noise` before
        `min_misses` misses exist; never below `noise_floor`."""
        if "noise" not in self._cache:
            misses = [m for stats in self.stats.values() for m in stats.misses]
            spread = 1.4826 * statistics.median(misses) if len(misses) >= self.min_misses \
                else self.prior_noise
            self._cache["noise"] = max(self.noise_floor, spread)
        return self._cache["noise"]

    def borrow_miss(self) -> float | None:
        """How far borrowing missed (log units, the largest miss) where it can be checked: in
        each class with two or more kinds also measured elsewhere, each such kind's own median
        against what borrowing from the other classes, at the level of the class's other
        kinds, predicts for it. None while no class allows the check."""
        if "borrow" not in self._cache:
            misses = [m for klass in {c for c, _ in self.stats} for m in self._misses_in(klass)]
            self._cache["borrow"] = max(misses) if misses else None
        return self._cache["borrow"]

    def _misses_in(self, klass: SizeClass) -> list[float]:
        others = self._overall(without=klass)
        own = {k: self.stats[klass, k].log_ratio() for k in KINDS
               if (klass, k) in self.stats and k in others}
        if len(own) < 2:
            return []
        others_own = {kind: {j: v for j, v in own.items() if j != kind} for kind in own}
        return [abs(value - _borrowed(others_own[kind], others, kind))
                for kind, value in own.items()
                if kind in RELATIVE or any(j not in RELATIVE for j in others_own[kind])]

    def width(self, klass: SizeClass, kind: str) -> float:
        """Half the band of a kind's estimate in a class, in log units (see the module doc)."""
        untried = math.log(self.untried_spread)
        got = self.stats.get((klass, kind))
        if got is not None:
            n = len(got.recent)
            band = self.confidence * self.noise() / math.sqrt(n)
            if n < self.min_tries and n <= len(self.early_spread):
                band = max(band, math.log(self.early_spread[n - 1]))
            return min(untried, band)
        miss = self.borrow_miss()
        if miss is None or not any(k == kind for _, k in self.stats):
            return untried
        return min(untried, miss + self.confidence * self.noise())

    def choose(self, klass: SizeClass, plans: Mapping[str, EncoderPlan]) -> Choice:
        """The plan for this call among the best plan of each kind (estimates under
        `self.ratios_of(klass)`); counts the call, and the exploration if it is one."""
        self.calls += 1
        self.class_calls[klass] += 1
        greedy = min(plans.values(), key=lambda p: (p.est_s, len(p.tp_items)))
        first = klass not in self.seen
        self.seen.add(klass)
        if first or greedy.est_s <= 0 or self._still_settled(klass, greedy.kind):
            return Choice(greedy, klass, False)
        target = self._explore_target(klass, plans, greedy)
        if target is None or not self._budget_allows(klass):
            return Choice(greedy, klass, False)
        self.explored += 1
        self.class_explored[klass] += 1
        self.pending[klass, target.kind] += 1
        return Choice(target, klass, True)

    def _budget_allows(self, klass: SizeClass) -> bool:
        """One more try keeps within `explore_fraction` of all calls, and of the class's calls
        beyond its first try: a class whose plans never separate (a near tie on a noisy
        machine) cannot spend the budget that settled classes left unused."""
        share = self.explore_fraction
        return (self.explored + 1 <= share * self.calls
                and self.class_explored[klass] <= share * self.class_calls[klass])

    def _still_settled(self, klass: SizeClass, kind: str) -> bool:
        """Whether the class settled on this kind, and its estimate stayed within its band."""
        got = self.settled.get(klass)
        if got is None:
            return False
        stats = self.stats[klass, kind] if got[0] == kind else None
        if stats is None or abs(stats.log_ratio() - got[1]) > self.width(klass, kind):
            del self.settled[klass]  # new evidence: the bands decide afresh
            return False
        return True

    def _explore_target(
        self, klass: SizeClass, plans: Mapping[str, EncoderPlan], greedy: EncoderPlan
    ) -> EncoderPlan | None:
        """The unseparated other plan with the lowest optimistic estimate whose last try is
        measured; settles the class when every other plan is separated."""
        center = math.log(greedy.est_s)  # est_s > 0
        open_ = [
            (best, KINDS.index(p.kind), p)
            for p in plans.values()
            if p.kind != greedy.kind
            and (best := math.log(max(p.est_s, 1e-12)) - self.width(klass, p.kind))
            < center - self._margin(klass, p.kind)
        ]
        if not open_ and (klass, greedy.kind) in self.stats:
            self.settled[klass] = greedy.kind, self.stats[klass, greedy.kind].log_ratio()
        ready = [x for x in open_ if not self.pending[klass, x[2].kind]]
        return min(ready, key=lambda x: x[:2])[2] if ready else None

    def eager(self, klass: SizeClass) -> bool:
        """Whether a call of this class should be learned from at once rather than with the
        next batch of times: fewer than `min_tries` of its calls measured, or a try of another
        kind there not yet measured (a wrong calibration then costs one call, not a batch)."""
        measured = sum(s.count for (c, _), s in self.stats.items() if c == klass)
        trying = any(n for (c, _), n in self.pending.items() if c == klass)
        return measured < self.min_tries or trying

    def _margin(self, klass: SizeClass, kind: str) -> float:
        """What a kind must be able to gain (log) to be tried again once measured
        `min_tries` times in the class: plans closer than `tolerance` are not worth a try."""
        got = self.stats.get((klass, kind))
        enough = got is not None and len(got.recent) >= self.min_tries
        return math.log1p(self.tolerance) if enough else 0.0

    def observe(self, choice: Choice, seconds: float) -> None:
        """Learn from one call's agreed time (every rank calls this alike, in call order)."""
        plan = choice.plan
        key = (choice.klass, plan.kind)
        if choice.explored:
            self.pending[key] -= 1
        if plan.est_s <= 0 or seconds <= 0:
            return
        modeled = plan.est_s / plan.factor
        self.stats.setdefault(key, RatioStats(self.window)).add(math.log(seconds / modeled))
        self._cache.clear()

    def ratios(self) -> dict[str, float]:
        """Each kind's median ratio over every class (for logs and plots); 1 when unmeasured."""
        overall = {k: math.exp(v) for k, v in self._overall().items()}
        return {**dict.fromkeys(KINDS, 1.0), **overall}
