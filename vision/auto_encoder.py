"""Auto encoder mode's runner: each encoder call planned (vision/encoder_plan.py), run on the
tower, timed, and learned from (vision/encoder_learner.py).

`run_planned_encoder` encodes one call's items as a plan says, with the plan's collectives;
`AutoEncoder` is the loop the model and the benchmark encode through. Every rank runs the same
plan on the same inputs, so the collectives line up.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import nn

from runtime.distributed import TPGroup
from vision.dp_encoder import frame_units, run_dp_sharded_mrope_vision_model
from vision.encoder_learner import Choice, EncoderLearner, size_class
from vision.encoder_plan import (
    EncoderCosts,
    EncoderPlan,
    Scale,
    TowerShape,
    plan_encoder,
    plans_by_kind,
)

CallObserver = Callable[[Choice, EncoderLearner], None]


class AutoEncoder:
    """The auto mode's loop for each encoder call: plan, run, time, learn (the rule is in
    vision/encoder_learner.py). The model and the benchmark both encode through it. Besides the
    plans' own collectives it adds one small CPU all-reduce per `feedback_every` calls: the
    slowest rank's time of each of those calls, which every rank then learns from in call
    order, so every rank's learner holds the same state and picks the same plans. (One
    all-reduce per call cost 0.4 ms at tp 2 and 5 ms at tp 4 on the 2-core CPU host: a sixth of
    a call of 16 small images.) A size class's first calls and its tries of another plan are
    shared at once (`EncoderLearner.eager`): the ranks agree on that from their common state.
    `observer`: called with each call's choice and the learner it was chosen from, before the
    call runs (a benchmark records the plans with it); `timer`: the clock calls are timed with
    (tests pass a fake device's)."""

    def __init__(
        self, tower: nn.Module, tp: TPGroup, shape: TowerShape, costs: EncoderCosts,
        feedback_every: int = 4, learner: EncoderLearner | None = None,
        observer: CallObserver | None = None, timer: Callable[[], float] = time.perf_counter,
    ):  # fmt: skip
        self.tower, self.tp, self.shape, self.costs = tower, tp, shape, costs
        self.learner, self.timer = learner or EncoderLearner(), timer
        self.feedback_every = feedback_every
        self.plan_counts: Counter[str] = Counter()
        self.observer = observer
        self._timed: list[tuple[Choice, float]] = []  # this rank's times, not yet shared

    def plan(self, grids: Sequence[Sequence[int]]) -> EncoderPlan:
        """The greedy plan over the call's frame units (see `frame_units`); no exploration,
        nothing counted."""
        units = frame_units(grids)
        return plan_encoder(units, self.tp.size, self.shape, self.costs, self._scale(units))

    def choose(self, units: list[list[int]]) -> Choice:
        """This call's plan (greedy or exploring); counts the call in the learner."""
        plans = plans_by_kind(units, self.tp.size, self.shape, self.costs, self._scale(units))
        return self.learner.choose(size_class(units), plans)

    def _scale(self, units: list[list[int]]) -> Scale:
        return Scale.of_ratios(self.learner.ratios_of(size_class(units)))

    def __call__(self, pixel_values: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        units = frame_units(grids)
        choice = self.choose(units)
        self._record(choice)
        start = self.timer()
        out = run_planned_encoder(self.tower, pixel_values, units, self.tp, choice.plan)
        if out.is_cuda:
            torch.cuda.synchronize()
        self._timed.append((choice, self.timer() - start))
        if len(self._timed) >= self.feedback_every or self.learner.eager(choice.klass):
            self._learn()
        return out

    def _record(self, choice: Choice) -> None:
        self.plan_counts[choice.plan.kind] += 1
        if self.observer is not None:
            self.observer(choice, self.learner)

    def _learn(self) -> None:
        local = torch.tensor([seconds for _, seconds in self._timed], dtype=torch.float64)
        slowest = self.tp.all_reduce_cpu(local, "max").tolist()
        for (choice, _), seconds in zip(self._timed, slowest):
            self.learner.observe(choice, seconds)
        self._timed.clear()


def run_planned_encoder(
    tower: nn.Module,
    pixel_values: torch.Tensor,
    grid_thw_list: Sequence[Sequence[int]],
    tp: TPGroup,
    plan: EncoderPlan,
) -> torch.Tensor:
    """Encode every item as `plan` says; returns rows in the original item order.

    `tower` holds full weights and takes `shard=` (vision/vit_common.py). Every rank must call
    this with the same inputs and plan."""
    grids = [[int(x) for x in g] for g in grid_thw_list]
    merge = tower.spatial_merge_size
    shard = tp if tp.size > 1 else None
    if not plan.tp_items:  # all DP (or nothing): no copy of the pixels
        return run_dp_sharded_mrope_vision_model(
            tower, pixel_values, grids, tp, spatial_merge_size=merge,
            assignment=plan.dp_ranks or None,
        )
    if not plan.dp_items:
        return tower(pixel_values, _grid(grids, range(len(grids))), shard=shard)
    return _run_hybrid(tower, pixel_values, grids, tp, plan)


def _run_hybrid(
    tower: nn.Module, pixel_values: torch.Tensor, grids: list[list[int]], tp: TPGroup,
    plan: EncoderPlan,
) -> torch.Tensor:
    """The TP items in one sharded call on every rank, then the DP items balanced."""
    merge = tower.spatial_merge_size
    sizes = [t * h * w for t, h, w in grids]
    items = pixel_values.split(sizes)
    tp_out = tower(_cat(items, plan.tp_items), _grid(grids, plan.tp_items), shard=tp)
    dp_out = run_dp_sharded_mrope_vision_model(
        tower, _cat(items, plan.dp_items), [grids[i] for i in plan.dp_items], tp,
        spatial_merge_size=merge, assignment=plan.dp_ranks or None,
    )
    rows: dict[int, torch.Tensor] = {}
    for chosen, out in ((plan.tp_items, tp_out), (plan.dp_items, dp_out)):
        rows.update(zip(chosen, out.split([sizes[i] // merge**2 for i in chosen])))
    return torch.cat([rows[i] for i in range(len(grids))])


def _cat(items: Sequence[torch.Tensor], chosen: Sequence[int]) -> torch.Tensor:
    return torch.cat([items[i] for i in chosen])


def _grid(grids: list[list[int]], chosen: Sequence[int]) -> torch.Tensor:
    return torch.tensor([grids[i] for i in chosen], dtype=torch.long)
