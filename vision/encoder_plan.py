"""Auto encoder mode's plan: per encoder call, the vision tower runs DP, TP, or a hybrid of both.

Every rank holds the whole tower (as in DP mode). For each call every rank computes the same plan
from the items' grids and one shared cost model:

- "dp": every item goes to one rank (the greedy balancer of vision/dp_encoder.py), one all-gather;
- "tp": every item is split across all ranks (each rank runs its slice of the full weights, with
  the per-layer all-reduce), so every rank ends with every embedding and no gather is needed;
- "hybrid": the largest items run TP across all ranks first, then the rest are balanced DP.

The plan is the cheapest of "the k largest items TP, the rest DP" for k = 0..n under the cost
model (k = 0 is DP, k = n is TP). The costs come from a short calibration at start-up on the real
device and group (vision/encoder_calibration.py) or from a JSON override; rank 0's costs are
broadcast. Each kind of plan's modeled time is then corrected by what the calls of that kind and
size class really took, and a bounded share of calls explores a plan the model is unsure about
(vision/encoder_learner.py). Every rank learns from the same agreed times in the same order, so
every rank plans alike and the collectives line up.

This module is the pure part: the cost model and the plan choice, with no tensor, collective or
device in it. vision/auto_encoder.py runs the plans (`run_planned_encoder`) and holds the per-call
loop that times them and feeds the learner (`AutoEncoder`).

Collective rule (as in DP mode): every rank runs the same plan, so every rank joins the TP call's
all-reduces and the DP part's all-gather, also a rank that gets no DP item. The DP part calls the
tower without a shard, so it issues no TP collective inside the tower.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from runtime.model_config import VisionConfig
from vision.dp_encoder import get_dp_encoder_lb_assignment

ENCODER_MODES = ("tp", "dp", "auto")


@dataclass(frozen=True)
class EncoderCosts:
    """Seconds. `dp_*`: the full tower on one rank while every rank is busy; `tp_*`: one rank's
    slice at the group's size, compute only. `*_patch_s` per patch, `*_pair_s` per attention pair
    (a segment of L patches has L*L pairs per block), `*_call_s` once per tower call.
    `dp_alone_factor`: the full tower's time with the other ranks idle over its time with all
    busy (1 with a device per rank; below 1 when ranks share too few cores). Collectives: latency
    plus seconds per byte one rank hands in (all-reduce: its tensor; all-gather: the output)."""

    dp_call_s: float
    dp_patch_s: float
    dp_pair_s: float
    tp_call_s: float
    tp_patch_s: float
    tp_pair_s: float
    all_reduce_s: float
    all_reduce_byte_s: float
    all_gather_s: float
    all_gather_byte_s: float
    dp_alone_factor: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) >= 0:
                raise ValueError(f"encoder cost {f.name} must be a number >= 0")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text_or_path: str) -> EncoderCosts:
        """Inline JSON (starts with "{") or the path of a JSON file; every field required."""
        text = text_or_path.strip()
        if not text.startswith("{"):
            text = Path(text_or_path).read_text()
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if not required <= set(data) <= names:
            raise ValueError(f"encoder costs need the fields {sorted(required)}, may have "
                             f"{sorted(names - required)}, nothing else")
        return cls(**{k: float(v) for k, v in data.items()})


@dataclass(frozen=True)
class TowerShape:
    """What the cost model needs of a tower: sizes of the tensors the collectives carry and the
    attention segments (whole frames, or windows of `window_units` merge units per side for the
    blocks that are not full-attention blocks)."""

    depth: int
    embed_dim: int
    out_dim: int
    merge: int
    elem_bytes: int
    window_units: int  # 0: no windowed blocks
    full_blocks: int  # blocks attending over whole frames (all of them without windows)

    @classmethod
    def of(cls, cfg: VisionConfig, elem_bytes: int) -> TowerShape:
        windowed = cfg.window_size > 0
        units = cfg.window_size // (cfg.spatial_merge_size * cfg.patch_size) if windowed else 0
        full = len(cfg.fullatt_block_indexes) if windowed else cfg.depth
        return cls(cfg.depth, cfg.embed_dim, cfg.embed_row_dim, cfg.spatial_merge_size,
                   elem_bytes, units, full)


@dataclass(frozen=True)
class EncoderPlan:
    """`tp_items` run TP across all ranks (first), `dp_items` are balanced DP; item indices are
    in the call's original order. `est_s` is the cost model's estimate: `est_s / factor` is
    what the feedback learns this kind of plan's ratio against (`Scale.estimate`), `factor`
    that kind's learned ratio. `dp_ranks` gives each rank its DP items (`balance_by_cost`)."""

    kind: str
    tp_items: tuple[int, ...]
    dp_items: tuple[int, ...]
    est_s: float
    factor: float = 1.0
    dp_ranks: Assignment = ()  # positions in `dp_items` per rank; () balances by patch count


def item_work(grid: Sequence[int], shape: TowerShape) -> tuple[int, int]:
    """(patches, attention pairs summed over every block) of one (t, h, w) item."""
    t, h, w = (int(x) for x in grid)
    frame = h * w
    full_pairs = t * frame * frame * shape.full_blocks
    if shape.window_units <= 0:
        return t * frame, full_pairs
    unit = shape.merge**2
    rows = _window_square_sum(h // shape.merge, shape.window_units)
    cols = _window_square_sum(w // shape.merge, shape.window_units)
    windowed = t * rows * cols * unit * unit * (shape.depth - shape.full_blocks)
    return t * frame, full_pairs + windowed


def _window_square_sum(units: int, side: int) -> int:
    """Sum of squared window extents along one axis of `units` merge units."""
    whole, rest = divmod(units, side)
    return whole * side * side + rest * rest


Assignment = tuple[tuple[int, ...], ...]  # per rank, the item indices it encodes, in order


def dp_cost(works: Sequence[tuple[int, int]], ranks: int, shape: TowerShape,
            costs: EncoderCosts) -> float:
    """Slowest rank under `balance_by_cost` (faster when fewer ranks are busy, by
    `dp_alone_factor`), plus the all-gather of the padded outputs."""
    return dp_part(works, ranks, shape, costs)[0]


def dp_part(works: Sequence[tuple[int, int]], ranks: int, shape: TowerShape,
            costs: EncoderCosts, refine: bool = True) -> tuple[float, Assignment]:
    """`dp_cost` and the assignment it is the cost of (`refine`: see `balance_by_cost`)."""
    if not works:
        return 0.0, ()
    assignment = balance_by_cost(works, ranks, costs, refine)
    slowest, max_rows = 0.0, 0
    for mine in (tuple(works[i] for i in items) for items in assignment if items):
        n, q = sum(w[0] for w in mine), sum(w[1] for w in mine)
        slowest = max(slowest, costs.dp_call_s + costs.dp_patch_s * n + costs.dp_pair_s * q)
        max_rows = max(max_rows, n // shape.merge**2)
    if ranks == 1:
        return slowest, assignment
    busy = sum(1 for items in assignment if items)
    alone = costs.dp_alone_factor
    slowest *= alone + (1.0 - alone) * (busy - 1) / (ranks - 1)
    gathered = ranks * max_rows * shape.out_dim * shape.elem_bytes
    return slowest + costs.all_gather_s + costs.all_gather_byte_s * gathered, assignment


REFINE_ITEMS = 32  # more items balance well greedily, and the moves' search grows as n squared
REFINE_STEPS = 8


def balance_by_cost(works: Sequence[tuple[int, int]], ranks: int, costs: EncoderCosts,
                    refine: bool = True) -> Assignment:
    """Items over ranks by modeled time (patches and attention pairs), not patch count alone:
    the greedy balancer of vision/dp_encoder.py on each item's time, then (`refine`, up to
    `REFINE_ITEMS` items) at most `REFINE_STEPS` single moves or swaps off the slowest rank,
    each lowering it. Pure and deterministic, so every rank computes the same assignment. DP
    mode balances patch counts; on 8 random images the slowest rank's modeled time fell from
    0.1-7.2% above the mean to 0.1-3.0% at 2 ranks."""
    item_s = [costs.dp_patch_s * n + costs.dp_pair_s * q for n, q in works]
    if not any(item_s):
        item_s = [float(n) for n, _ in works]
    shuffle, counts, _ = get_dp_encoder_lb_assignment(item_s, ranks)
    groups, start = [], 0
    for count in counts:
        groups.append(list(shuffle[start : start + count]))
        start += count
    steps = REFINE_STEPS if refine and len(works) <= REFINE_ITEMS else 0
    for _ in range(steps):
        if not _improve_once(groups, item_s):
            break
    return tuple(tuple(g) for g in groups)


def _improve_once(groups: list[list[int]], item_s: list[float]) -> bool:
    """The move or swap off the slowest rank that lowers the larger of the two ranks' times
    the most; False when none does."""
    loads = [sum(item_s[i] for i in g) for g in groups]
    top = max(range(len(groups)), key=lambda r: (loads[r], -r))
    best: tuple[float, int, int, int | None] | None = None
    for other in range(len(groups)):
        if other == top:
            continue
        for a in groups[top]:
            for b in (None, *groups[other]):
                shift = item_s[a] - (item_s[b] if b is not None else 0.0)
                after = max(loads[top] - shift, loads[other] + shift)
                if shift > 0 and after < loads[top] * (1 - 1e-9) and (best is None
                                                                     or after < best[0]):
                    best = (after, other, a, b)
    if best is None:
        return False
    _, other, a, b = best
    groups[top].remove(a)
    groups[other].append(a)
    if b is not None:
        groups[other].remove(b)
        groups[top].append(b)
    return True


def tp_cost(works: Sequence[tuple[int, int]], shape: TowerShape, costs: EncoderCosts) -> float:
    """One tower call on every rank's slice, with 2 all-reduces per block and 1 in the merger."""
    if not works:
        return 0.0
    n, q = sum(w[0] for w in works), sum(w[1] for w in works)
    compute = costs.tp_call_s + costs.tp_patch_s * n + costs.tp_pair_s * q
    block_bytes = n * shape.embed_dim * shape.elem_bytes
    merger_bytes = n // shape.merge**2 * shape.out_dim * shape.elem_bytes
    reduces = 2 * shape.depth + 1
    moved = 2 * shape.depth * block_bytes + merger_bytes
    return compute + reduces * costs.all_reduce_s + costs.all_reduce_byte_s * moved


def plan_encoder(grids: Sequence[Sequence[int]], ranks: int, shape: TowerShape,
                 costs: EncoderCosts, scale: Scale | None = None) -> EncoderPlan:
    """The cheapest split "k largest items TP, the rest DP" (ties: fewer TP items). Pure.
    `scale` multiplies the modeled time of each kind of plan (what auto mode learned)."""
    plans = plans_by_kind(grids, ranks, shape, costs, scale)
    return min(plans.values(), key=lambda p: (p.est_s, len(p.tp_items)))


def plans_by_kind(grids: Sequence[Sequence[int]], ranks: int, shape: TowerShape,
                  costs: EncoderCosts, scale: Scale | None = None) -> dict[str, EncoderPlan]:
    """The cheapest plan of each kind that the call allows ("hybrid" needs two items and two
    ranks; one rank or no items: only "dp"), estimated under `scale`. Pure."""
    scale = scale or Scale()
    works = [item_work(g, shape) for g in grids]
    if ranks == 1 or not works:
        return {"dp": EncoderPlan("dp", (), tuple(range(len(works))), dp_cost(works, 1, shape,
                                                                              costs))}
    order = sorted(range(len(works)), key=lambda i: -works[i][0])  # stable: ties keep index order
    best: dict[str, tuple[float, int]] = {}  # kind -> (estimate, TP item count)
    for k in range(len(order) + 1):  # the splits compared on the greedy balance alone
        plan = _split_plan(works, order, k, ranks, shape, costs, scale, refine=False)
        if plan.kind not in best or plan.est_s < best[plan.kind][0]:
            best[plan.kind] = plan.est_s, k
    return {kind: _split_plan(works, order, k, ranks, shape, costs, scale)
            for kind, (_, k) in best.items()}


def _split_plan(works: Sequence[tuple[int, int]], order: Sequence[int], k: int, ranks: int,
                shape: TowerShape, costs: EncoderCosts, scale: Scale,
                refine: bool = True) -> EncoderPlan:
    """The plan that runs the `k` first items of `order` TP and the rest DP."""
    tp_s = tp_cost([works[i] for i in order[:k]], shape, costs)
    dp_items = tuple(sorted(order[k:]))
    dp_s, dp_ranks = dp_part([works[i] for i in dp_items], ranks, shape, costs, refine)
    kind = _kind(k, len(order))
    est, base = scale.estimate(kind, tp_s, dp_s)
    factor = est / base if base > 0 else 1.0
    return EncoderPlan(kind, tuple(sorted(order[:k])), dp_items, est, factor, dp_ranks)


def _kind(tp_count: int, total: int) -> str:
    return "dp" if tp_count == 0 else "tp" if tp_count == total else "hybrid"


@dataclass(frozen=True)
class Scale:
    """Factors on the modeled time of each kind of plan: measured over modeled, learned while
    serving (vision/encoder_learner.py, per size class). A hybrid is a TP call followed by a DP
    call, so its TP part always takes TP's factor and its DP part DP's; `hybrid` is a further
    factor on that sum, what hybrids measured beyond their parts (1 until one is measured).
    With one flat factor per kind instead, a hybrid's factor learned on one split was applied
    to every other split (the model's best hybrid is often another split once a factor moves),
    and auto kept running hybrids that measured 30% slower than DP.

    The hybrid's factor prices a plan only when it is above 1: a hybrid costs at least its two
    parts at their own kinds' factors. Below 1 it is a discount learned on the splits that were
    run and applied to every other: on the DP part of a hybrid that moves one item to TP it
    priced that work under what DP itself pays, so such a hybrid looked cheaper than DP (one
    lucky try measured 0.69 of its parts at tp 2, the benchmark's random workload, and a hybrid
    slower than DP ran for four rounds), and on one that moves all but two items to TP it
    undercut TP the same way. The factor is still learned against the parts' sum (`estimate`'s
    base), and above 1 it keeps a hybrid that measured slow from being chosen again."""

    dp: float = 1.0
    tp: float = 1.0
    hybrid: float | None = None

    @classmethod
    def of_ratios(cls, ratios: Mapping[str, float]) -> Scale:
        """The scale of a learner's ratios for one size class (`EncoderLearner.ratios_of`)."""
        return cls(ratios.get("dp", 1.0), ratios.get("tp", 1.0), ratios.get("hybrid"))

    def of(self, kind: str) -> float:
        value = getattr(self, kind)
        return 1.0 if value is None else value

    def estimate(self, kind: str, tp_s: float, dp_s: float) -> tuple[float, float]:
        """A plan's (estimate, base) from its modeled TP and DP parts: the estimate is the
        kind's factor times the base, the time that factor is learned against."""
        if kind == "hybrid":
            base = self.tp * tp_s + self.dp * dp_s
            return max(1.0, self.of(kind)) * base, base
        base = tp_s + dp_s
        return self.of(kind) * base, base
