"""What the auto encoder mode learns from the calls it runs, and how it picks a plan. Pure.

The start-up calibration (vision/encoder_calibration.py) gives a cost model; one noisy probe
can make it wrong by a large factor. Each call's measured time (the slowest rank's, agreed by
the ranks before anyone learns from it) over the time the model predicted is a *ratio*, kept
per size class (the call's total patches and item count, each to a power of two) and per kind
of plan ("dp", "tp", "hybrid"). A kind's estimate for a class is the median of its recent log
ratios there: one slow outlier moves nothing. A kind not yet measured in a class borrows its
ratio from the other classes, scaled by how the class's measured kinds compare with theirs (see
`ratios_of`): load that arrives after the calibration then cannot make an untried plan look
cheaper than the tried ones.

Choosing (`EncoderLearner.choose`), given the best plan of each kind under the model:
- the greedy plan is the one with the lowest estimate. With nothing measured every ratio is 1
  (an untried hybrid is priced with TP's and DP's ratios on its two parts), so the first calls
  do what the calibration says: the better static mode for the batch shape;
- each kind's estimate has a band: `untried_spread` while the kind has no measurement in the
  class, then `1 + spread / sqrt(n)` after n measurements. Two kinds are *separated* once the
  worse one's optimistic end lies above the better one's pessimistic end; a kind separated
  from the greedy plan is not run again for that class, until new measurements of the greedy
  plan (it keeps running) move its estimate close again;
- otherwise the unseparated kind with the lowest optimistic estimate is explored, but only
  while explorations stay within `explore_fraction` of all calls (counted over the whole run).

Every rank feeds the same times in the same order (see AutoEncoder), so every rank holds the
same state and chooses the same plan: agreement by construction, with no message per plan.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vision.encoder_plan import EncoderPlan

KINDS = ("dp", "tp", "hybrid")
SizeClass = tuple[int, int]


def size_class(units: Sequence[Sequence[int]]) -> SizeClass:
    """(total patches, item count), each as its power-of-two bucket (`int.bit_length`)."""
    patches = sum(int(t) * int(h) * int(w) for t, h, w in units)
    return patches.bit_length(), len(units).bit_length()


@dataclass
class RatioStats:
    """Recent log(measured / modeled) of one kind in one size class; `count` counts them all."""

    window: int
    recent: deque[float] = field(default_factory=deque)
    count: int = 0

    def add(self, log_ratio: float) -> None:
        self.recent.append(log_ratio)
        if len(self.recent) > self.window:
            self.recent.popleft()
        self.count += 1

    def ratio(self) -> float:
        return math.exp(statistics.median(self.recent))


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
    untried_spread: float = 4.0  # a calibration may be off by this factor either way
    spread: float = 0.5  # band 1 + spread / sqrt(n) after n measurements
    explore_fraction: float = 0.125  # at most this share of all calls explore
    calls: int = 0
    explored: int = 0
    stats: dict[tuple[SizeClass, str], RatioStats] = field(default_factory=dict)

    def ratios_of(self, klass: SizeClass) -> dict[str, float]:
        """Each kind's learned ratio in one class (absent: unknown, the calibration stands).

        Nothing measured in the class: nothing (its first calls follow the calibration). A
        kind measured in this class has its own median. A kind measured only elsewhere
        borrows: its ratio over every class, times how this class's measured kinds stand
        against theirs (their geometric mean of own / overall). A machine that slowed down
        after the start-up calibration slows every kind alike, so an untried kind must not
        look cheaper merely because the tried ones were measured on the slower machine."""
        own = {k: self.stats[klass, k].ratio() for k in KINDS if (klass, k) in self.stats}
        if not own:
            return own  # a class's first call does what the calibration says (the safe default)
        overall = self._overall()
        borrowed = [k for k in overall if k not in own]
        level = math.exp(statistics.fmean(math.log(own[k] / overall[k]) for k in own))
        return {**own, **{k: level * overall[k] for k in borrowed}}

    def _overall(self) -> dict[str, float]:
        """Each measured kind's median ratio over the recent measurements of every class."""
        logs: dict[str, list[float]] = {}
        for (_, kind), stats in self.stats.items():
            logs.setdefault(kind, []).extend(stats.recent)
        return {k: math.exp(statistics.median(v)) for k, v in logs.items()}

    def band(self, klass: SizeClass, kind: str) -> float:
        got = self.stats.get((klass, kind))
        if got is None:
            return self.untried_spread
        return 1.0 + self.spread / math.sqrt(got.count)

    def choose(self, klass: SizeClass, plans: Mapping[str, EncoderPlan]) -> Choice:
        """The plan for this call among the best plan of each kind (estimates under
        `self.ratios_of(klass)`); counts the call, and the exploration if it is one."""
        self.calls += 1
        greedy = min(plans.values(), key=lambda p: (p.est_s, len(p.tp_items)))
        target = self._explore_target(klass, plans, greedy)
        if target is None or (self.explored + 1) > self.explore_fraction * self.calls:
            return Choice(greedy, klass, False)
        self.explored += 1
        return Choice(target, klass, True)

    def _explore_target(
        self, klass: SizeClass, plans: Mapping[str, EncoderPlan], greedy: EncoderPlan
    ) -> EncoderPlan | None:
        """The unseparated other plan with the lowest optimistic estimate, if any."""
        worst_greedy = greedy.est_s * self.band(klass, greedy.kind)
        open_ = [
            (p.est_s / self.band(klass, p.kind), KINDS.index(p.kind), p)
            for p in plans.values()
            if p.kind != greedy.kind and p.est_s / self.band(klass, p.kind) < worst_greedy
        ]
        return min(open_, key=lambda x: x[:2])[2] if open_ else None

    def observe(self, choice: Choice, seconds: float) -> None:
        """Learn from one call's agreed time (every rank calls this alike, in call order)."""
        plan = choice.plan
        if plan.est_s <= 0 or seconds <= 0:
            return
        modeled = plan.est_s / plan.factor
        key = (choice.klass, plan.kind)
        self.stats.setdefault(key, RatioStats(self.window)).add(math.log(seconds / modeled))

    def ratios(self) -> dict[str, float]:
        """Each kind's median ratio over every class (for logs and plots); 1 when unmeasured."""
        return {**dict.fromkeys(KINDS, 1.0), **self._overall()}
