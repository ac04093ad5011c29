"""Auto encoder mode: the cost model and plan (pure), the per-call shard of full-weight layers,
every plan against the direct single-rank run on real Gloo ranks, and the start-up calibration.
"""

from __future__ import annotations

import ast
import json
import random
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_on_ranks
from numerics import assert_within_rounding, max_abs_diff, rounding_bound, vision_terms

from runtime.distributed import TPGroup
from runtime.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    prepare_shard_weights,
)
from runtime.model_config import ModelConfig
from runtime.server_args import ServerArgs
from vision import encoder_plan
from vision.auto_encoder import AutoEncoder, CallObserver, run_planned_encoder
from vision.dp_encoder import frame_units, get_dp_encoder_lb_assignment, plan_dp_encoder
from vision.encoder_calibration import PROBE_GRIDS, calibrate_encoder_costs, fit_free, fit_tp
from vision.encoder_learner import EncoderLearner
from vision.encoder_plan import (
    EncoderCosts,
    EncoderPlan,
    Scale,
    TowerShape,
    balance_by_cost,
    dp_cost,
    item_work,
    plan_encoder,
    plans_by_kind,
    tp_cost,
)
from vision.qwen2_5_vl_vit import Qwen2_5_VisionTransformer, window_index
from vision.qwen2_vl_vit import Qwen2VisionTransformer

SHAPE = TowerShape(depth=2, embed_dim=32, out_dim=64, merge=2, elem_bytes=4, window_units=0,
                   full_blocks=2)
ZERO = EncoderCosts(*[0.0] * (len(fields(EncoderCosts)) - 1))  # dp_alone_factor 1
# TP on 2 ranks does 3/4 of the per-patch work of the full tower: it beats DP on one item that
# leaves the other rank idle, and loses to DP on many items that keep both ranks busy.
COSTS = replace(ZERO, dp_patch_s=1e-6, tp_patch_s=0.75e-6, all_reduce_s=1e-5, all_gather_s=1e-5)


def fixed_plan(kind: str, num_items: int) -> EncoderPlan:
    """The static modes (everything DP, or everything TP) as plans."""
    items = tuple(range(num_items))
    if kind == "dp":
        return EncoderPlan("dp", (), items, 0.0)
    if kind == "tp":
        return EncoderPlan("tp", items, (), 0.0)
    raise ValueError(f"no fixed plan {kind!r}")


def costs(**kw: float) -> EncoderCosts:
    return replace(COSTS, **kw)


# ---------------------------------------------------------------- plan (pure)


def test_one_rank_and_no_items_plan_dp() -> None:
    assert plan_encoder([[1, 64, 64]], 1, SHAPE, COSTS).kind == "dp"
    assert plan_encoder([], 4, SHAPE, COSTS) == EncoderPlan("dp", (), (), 0.0)


def test_one_large_item_runs_tp() -> None:
    plan = plan_encoder([[1, 64, 64]], 2, SHAPE, COSTS)
    assert (plan.kind, plan.tp_items, plan.dp_items) == ("tp", (0,), ())


def test_many_equal_items_run_dp() -> None:
    plan = plan_encoder([[1, 8, 8]] * 8, 2, SHAPE, COSTS)
    assert (plan.kind, plan.tp_items) == ("dp", ())
    assert plan.dp_items == tuple(range(8))


def test_one_large_many_small_runs_the_large_item_tp() -> None:
    grids = [[1, 8, 8]] * 3 + [[1, 64, 64]] + [[1, 8, 8]] * 5
    plan = plan_encoder(grids, 2, SHAPE, COSTS)
    assert (plan.kind, plan.tp_items) == ("hybrid", (3,))
    assert plan.dp_items == (0, 1, 2, 4, 5, 6, 7, 8)


def test_two_dominant_items_both_run_tp() -> None:
    grids = [[1, 8, 8]] * 4 + [[1, 64, 64], [1, 60, 64]] + [[1, 8, 8]] * 4
    plan = plan_encoder(grids, 4, SHAPE, costs(tp_patch_s=0.4e-6))
    assert (plan.kind, plan.tp_items) == ("hybrid", (4, 5))


def test_expensive_all_reduce_keeps_one_item_dp() -> None:
    assert plan_encoder([[1, 64, 64]], 2, SHAPE, costs(all_reduce_s=1.0)).kind == "dp"
    per_byte = costs(all_reduce_byte_s=1e-6)  # every patch moves 2*2*32*4 + 64 bytes
    assert plan_encoder([[1, 64, 64]], 2, SHAPE, per_byte).kind == "dp"


def test_expensive_all_gather_pushes_to_tp() -> None:
    grids = [[1, 8, 8]] * 8
    assert plan_encoder(grids, 2, SHAPE, costs(all_gather_s=1.0)).kind == "tp"


def test_an_idle_rank_speeds_up_the_busy_one() -> None:
    # Ranks sharing too few cores: one item alone on its rank runs at 60% of the all-busy time.
    shared = costs(dp_alone_factor=0.6)
    assert plan_encoder([[1, 64, 64]], 2, SHAPE, shared).kind == "dp"
    works = [item_work([1, 64, 64], SHAPE)]
    assert dp_cost(works, 2, SHAPE, shared) == pytest.approx(0.6 * 4096e-6 + 1e-5)
    two = works * 2  # both ranks busy: no speed-up
    assert dp_cost(two, 2, SHAPE, shared) == pytest.approx(4096e-6 + 1e-5)
    three_of_four = works * 3  # 3 of 4 ranks busy: 0.6 + 0.4 * 2/3 of the all-busy time
    assert dp_cost(three_of_four, 4, SHAPE, shared) == pytest.approx(
        (0.6 + 0.4 * 2 / 3) * 4096e-6 + 1e-5
    )


def test_attention_pairs_decide_for_large_items() -> None:
    # Per patch TP is no faster, but it splits the heads, so attention pairs cost half.
    quad = replace(ZERO, dp_patch_s=1e-6, tp_patch_s=1e-6, dp_pair_s=1e-8, tp_pair_s=0.5e-8)
    assert plan_encoder([[1, 64, 64]], 2, SHAPE, quad).kind == "tp"
    assert plan_encoder([[1, 4, 4]], 2, SHAPE, replace(quad, all_reduce_s=1e-4)).kind == "dp"


def test_video_counts_attention_per_frame() -> None:
    assert item_work([4, 8, 8], SHAPE) == (256, 4 * 64 * 64 * 2)
    assert item_work([1, 16, 16], SHAPE) == (256, 256 * 256 * 2)


def test_window_pairs_match_the_tower_windows() -> None:
    shape = replace(SHAPE, depth=4, window_units=2, full_blocks=1)
    for grid in ([1, 6, 10], [2, 8, 12], [1, 2, 2]):
        _, cu = window_index(torch.tensor([grid]), window_size=56, patch_size=14, merge=2)
        windowed = int((cu.diff().long() ** 2).sum())
        t, h, w = grid
        assert item_work(grid, shape) == (t * h * w, 3 * windowed + t * (h * w) ** 2)


def test_tower_shape_from_configs() -> None:
    assert TowerShape.of(_cfg("qwen2_vl"), 4) == TowerShape(2, 64, 64, 2, 4, 0, 2)
    assert TowerShape.of(_cfg("qwen2_5_vl"), 2) == TowerShape(3, 64, 64, 2, 2, 2, 1)


def test_cost_terms() -> None:
    works = [item_work(g, SHAPE) for g in ([1, 4, 4], [1, 4, 8], [1, 4, 4])]
    c = replace(ZERO, dp_call_s=1.0, dp_patch_s=0.01, all_gather_s=5.0, all_gather_byte_s=1e-3)
    # ranks: [32 patches] and [16 + 16]: one call each, 32 patches; gather 2 * 8 rows * 64 * 4
    assert dp_cost(works, 2, SHAPE, c) == pytest.approx(1.0 + 0.32 + 5.0 + 4.096)
    t = replace(ZERO, tp_call_s=1.0, tp_patch_s=0.01, all_reduce_s=2.0, all_reduce_byte_s=1e-4)
    moved = 2 * 2 * 64 * 32 * 4 + 16 * 64 * 4
    assert tp_cost(works, SHAPE, t) == pytest.approx(1.0 + 0.64 + 5 * 2.0 + moved * 1e-4)


@pytest.mark.parametrize("seed", range(20))
def test_plan_is_the_cheapest_prefix_split(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.choice([2, 3, 4])
    grids = [[rng.randint(1, 3), 2 * rng.randint(1, 20), 2 * rng.randint(1, 20)]
             for _ in range(rng.randint(1, 10))]
    c = replace(ZERO, **{f.name: rng.choice([0.0, 1e-7, 1e-6, 1e-4]) for f in fields(ZERO)})
    plan = plan_encoder(grids, ranks, SHAPE, c)
    works = [item_work(g, SHAPE) for g in grids]
    assert sorted(plan.tp_items + plan.dp_items) == list(range(len(grids)))
    assert plan.est_s <= dp_cost(works, ranks, SHAPE, c) + 1e-12
    assert plan.est_s <= tp_cost(works, SHAPE, c) + 1e-12
    tp_works = [works[i] for i in plan.tp_items]
    dp_works = [works[i] for i in plan.dp_items]
    est = tp_cost(tp_works, SHAPE, c) + dp_cost(dp_works, ranks, SHAPE, c)
    assert plan.est_s == pytest.approx(est)
    if plan.tp_items and plan.dp_items:  # the TP items are the largest ones
        assert min(works[i][0] for i in plan.tp_items) >= max(works[i][0] for i in plan.dp_items)
    assert plan == plan_encoder(grids, ranks, SHAPE, c)  # deterministic: every rank agrees


@pytest.mark.parametrize("seed", range(30))
def test_balance_by_cost_never_loses_to_the_patch_balance(seed: int) -> None:
    """Each item once; the slowest rank's modeled time no higher than under the patch-count
    balancer of DP mode, often lower; the same on every call (every rank computes it)."""
    rng = random.Random(seed)
    ranks = rng.choice([2, 3, 4])
    works = [item_work([1, 2 * rng.randint(2, 24), 2 * rng.randint(2, 24)], SHAPE)
             for _ in range(rng.randint(1, 12))]
    c = costs(dp_pair_s=rng.choice([0.0, 1e-9, 1e-8]))
    assignment = balance_by_cost(works, ranks, c)
    assert len(assignment) == ranks
    assert sorted(i for mine in assignment for i in mine) == list(range(len(works)))
    assert assignment == balance_by_cost(works, ranks, c)

    def slowest(groups: Sequence[Sequence[int]]) -> float:
        return max(sum(c.dp_patch_s * works[i][0] + c.dp_pair_s * works[i][1] for i in g)
                   for g in groups)

    shuffle, counts, _ = get_dp_encoder_lb_assignment([n for n, _ in works], ranks)
    by_patches = [shuffle[sum(counts[:r]) : sum(counts[: r + 1])] for r in range(ranks)]
    assert slowest(assignment) <= slowest(by_patches) * (1 + 1e-12)


def test_balance_by_cost_weighs_attention() -> None:
    """Two 24x24 frames and one 32x32 against nine 8x8: by patches the big frames' rank looks
    even, but their attention pairs make it the slowest; by modeled time that rank sheds work.
    The plan's DP part carries the assignment it was costed with."""
    grids = [[1, 24, 24]] * 2 + [[1, 32, 32]] + [[1, 8, 8]] * 9
    works = [item_work(g, SHAPE) for g in grids]
    c = costs(dp_pair_s=2e-9)
    shuffle, counts, _ = get_dp_encoder_lb_assignment([n for n, _ in works], 2)
    by_patches = [shuffle[: counts[0]], shuffle[counts[0] :]]
    assignment = balance_by_cost(works, 2, c)

    def seconds(group: Sequence[int]) -> float:
        return sum(c.dp_patch_s * works[i][0] + c.dp_pair_s * works[i][1] for i in group)

    assert max(map(seconds, assignment)) < 0.97 * max(map(seconds, by_patches))
    plan = plans_by_kind(grids, 2, SHAPE, replace(c, tp_call_s=1.0))["dp"]
    assert plan.dp_ranks == assignment
    assert plan.est_s == pytest.approx(dp_cost(works, 2, SHAPE, replace(c, tp_call_s=1.0)))


def test_planning_refines_only_the_chosen_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """The splits are compared on the greedy balance; only each kind's best is refined, and
    only up to REFINE_ITEMS items (refining every split of 128 frame units took 50-160 ms a
    call, more than a GPU's encoder call)."""
    calls = []
    improve = encoder_plan._improve_once
    monkeypatch.setattr(encoder_plan, "_improve_once",
                        lambda *a: calls.append(1) or improve(*a))  # fmt: skip
    rng = random.Random(1)
    c = costs(dp_pair_s=1e-9, tp_patch_s=0.4e-6)
    grids = [[1, 2 * rng.randint(2, 24), 2 * rng.randint(2, 24)] for _ in range(24)]
    plans = plans_by_kind(grids, 2, SHAPE, c)
    assert 0 < len(calls) <= len(plans) * encoder_plan.REFINE_STEPS
    calls.clear()
    many = [item_work([1, 8, 8 + 2 * (i % 3)], SHAPE) for i in range(encoder_plan.REFINE_ITEMS + 1)]
    balance_by_cost(many, 2, c)
    assert calls == []


def test_a_dp_assignment_must_give_every_item_once() -> None:
    with pytest.raises(ValueError, match="once each"):
        plan_dp_encoder([[1, 4, 4]] * 3, 2, assignment=[[0, 1], [1]])
    with pytest.raises(ValueError, match="once each"):
        plan_dp_encoder([[1, 4, 4]] * 3, 2, assignment=[[0, 1, 2]])
    plan = plan_dp_encoder([[1, 4, 4], [1, 8, 8], [1, 4, 4]], 2, assignment=[[2], [0, 1]])
    assert plan.shuffle_indices == (2, 0, 1) and plan.gpu_loads == (16, 80)


def test_fixed_plans() -> None:
    assert fixed_plan("dp", 3) == EncoderPlan("dp", (), (0, 1, 2), 0.0)
    assert fixed_plan("tp", 2) == EncoderPlan("tp", (0, 1), (), 0.0)
    with pytest.raises(ValueError):
        fixed_plan("hybrid", 2)


# ---------------------------------------------------------------- costs JSON, server args


def test_costs_json_inline_and_file(tmp_path: Path) -> None:
    assert EncoderCosts.from_json(COSTS.to_json()) == COSTS
    path = tmp_path / "costs.json"
    path.write_text(COSTS.to_json())
    assert EncoderCosts.from_json(str(path)) == COSTS
    data = json.loads(COSTS.to_json())
    del data["dp_pair_s"]
    with pytest.raises(ValueError, match="need the fields"):
        EncoderCosts.from_json(json.dumps(data))
    with pytest.raises(ValueError, match=">= 0"):
        replace(COSTS, tp_patch_s=-1.0)


def test_an_untried_hybrid_is_costed_with_what_tp_and_dp_taught() -> None:
    """DP measured 30% slower than modeled. A hybrid of many equal small items then only looks
    cheaper than DP if it is priced at the model's word while DP pays its learned factor."""
    batch, scale = [[1, 8, 8]] * 16, Scale(dp=1.3)
    works = [item_work(g, SHAPE) for g in batch]
    slow = costs(tp_patch_s=0.9e-6)
    dp_s = dp_cost(works, 2, SHAPE, slow)
    hybrids = [tp_cost(works[:k], SHAPE, slow) + dp_cost(works[k:], 2, SHAPE, slow)
               for k in range(1, len(works))]
    assert plan_encoder(batch, 2, SHAPE, slow).kind == "dp"
    assert min(hybrids) < 1.3 * dp_s  # a flat factor of 1 for the hybrid would pick it
    plan = plan_encoder(batch, 2, SHAPE, slow, scale)
    assert plan.kind == "dp" and plan.factor == pytest.approx(1.3)
    # A hybrid measured under its parts' price is still priced at its parts: a factor below 1
    # would price its DP part under what DP pays for the same work.
    lucky = plans_by_kind(batch, 2, SHAPE, slow, replace(scale, hybrid=0.5))
    assert lucky["hybrid"].factor == pytest.approx(1.0)
    assert plan_encoder(batch, 2, SHAPE, slow, replace(scale, hybrid=0.5)).kind == "dp"
    # Above 1 the factor prices it.
    costly = plans_by_kind(batch, 2, SHAPE, slow, replace(scale, hybrid=1.5))["hybrid"]
    assert costly.factor == pytest.approx(1.5)


def test_the_planner_is_pure() -> None:
    """The planner's module names no tensor library, collective or device (the runner,
    vision/auto_encoder.py, does): every rank plans from numbers alone."""
    tree = ast.parse(Path(encoder_plan.__file__).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names, "no imports parsed"
    assert not {n for n in names if n.split(".")[0] == "torch" or "auto_encoder" in n}, names


def test_a_video_spreads_its_frames_over_the_ranks() -> None:
    """A 4-frame video as one item: DP leaves a rank idle, so TP wins. Auto plans over frame
    units, and DP with two frames per rank beats both."""
    video = [[4, 32, 32]]
    whole = plan_encoder(video, 2, SHAPE, COSTS)
    assert whole.kind == "tp"
    auto = AutoEncoder(torch.nn.Identity(), TPGroup(rank=0, size=2), SHAPE, COSTS)
    plan = auto.plan(video)
    assert (plan.kind, plan.dp_items) == ("dp", (0, 1, 2, 3))
    assert plan.est_s < whole.est_s
    assert frame_units([[2, 4, 6], [1, 2, 2]]) == [[1, 4, 6], [1, 4, 6], [1, 2, 2]]


def test_server_args_encoder_mode() -> None:
    assert ServerArgs.from_cli(["--device", "cpu"]).mm_encoder_mode == "tp"
    auto = ServerArgs.from_cli(["--device", "cpu", "--mm-encoder-mode", "auto"])
    assert auto.mm_encoder_mode == "auto" and not auto.mm_enable_dp_encoder
    legacy = ServerArgs.from_cli(["--device", "cpu", "--mm-enable-dp-encoder"])
    assert legacy.mm_encoder_mode == "dp" and legacy.mm_enable_dp_encoder
    assert ServerArgs(mm_enable_dp_encoder_flag=True).mm_enable_dp_encoder
    with pytest.raises(ValueError, match="contradicts"):
        ServerArgs.from_cli(["--mm-enable-dp-encoder", "--mm-encoder-mode", "auto"])
    with pytest.raises(ValueError, match="only to"):
        ServerArgs.from_cli(["--device", "cpu", "--mm-encoder-costs", COSTS.to_json()])
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--mm-encoder-mode", "hybrid"])


# ---------------------------------------------------------------- real towers on Gloo ranks

CONFIG = {
    "qwen2_vl": dict(depth=2, embed_dim=64, num_heads=4, mlp_ratio=2, hidden_size=64,
                     hidden_act="quick_gelu"),
    "qwen2_5_vl": dict(depth=3, hidden_size=64, num_heads=4, intermediate_size=128,
                       out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
                       hidden_act="silu"),
}
TOWERS = {"qwen2_vl": Qwen2VisionTransformer, "qwen2_5_vl": Qwen2_5_VisionTransformer}
# (grids, plan per name); "hybrid" leaves the DP part fewer items than ranks at tp 4.
BATCHES = {
    "one_image": [[1, 8, 12]],
    "video": [[3, 6, 10]],
    "image_and_video": [[1, 6, 10], [2, 4, 6], [1, 2, 4]],
    "many": [[1, 4, 4], [1, 8, 12], [1, 2, 2], [2, 4, 4], [1, 4, 6]],
}
HYBRID_TP = {"one_image": (0,), "video": (0,), "image_and_video": (0,), "many": (1, 3)}


def _cfg(arch: str):
    vision = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3,
                  **CONFIG[arch])
    raw = dict(model_type=arch, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, vocab_size=512,
               rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
               image_token_id=500, video_token_id=501, vision_start_token_id=502,
               vision_end_token_id=503, eos_token_id=505, vision_config=vision)
    return ModelConfig.from_dict(raw).vision


def _tower(arch: str) -> torch.nn.Module:
    """Full weights, the same on every rank (a fixed seed), unit-scale activations."""
    tower = TOWERS[arch](_cfg(arch), TPGroup()).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                p.copy_(0.1 * noise if p.dim() == 1 else noise / p[0].numel() ** 0.5)
    return tower


def _terms(arch: str, grids: list[tuple[int, int, int]]) -> int:
    """The tower's sum lengths (tests/numerics.py), attention over its largest item."""
    return vision_terms(_cfg(arch), max(t * h * w for t, h, w in grids))


def _plans(name: str, n: int, ranks: int) -> dict[str, EncoderPlan]:
    """The static plans, a hybrid, and DP with an assignment of its own (items backwards,
    round robin from the last rank: ranks with none, and an order the balancer never makes)."""
    tp_items = HYBRID_TP[name]
    dp_items = tuple(i for i in range(n) if i not in tp_items)
    assigned = tuple(tuple(j for j in reversed(range(n)) if j % ranks == ranks - 1 - r)
                     for r in range(ranks))
    return {"dp": fixed_plan("dp", n), "tp": fixed_plan("tp", n),
            "hybrid": EncoderPlan("hybrid", tp_items, dp_items, 0.0),
            "dp-assigned": EncoderPlan("dp", (), tuple(range(n)), 0.0, 1.0, assigned)}


class CountingGroup(TPGroup):
    """Counts the device-group collectives this rank joins."""

    def __init__(self, base: TPGroup):
        super().__init__(base.rank, base.size, base.device_group, base.cpu_group)
        object.__setattr__(self, "counts", {"all_reduce": 0, "all_gather": 0})

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.counts["all_reduce"] += 1
        return super().all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.counts["all_gather"] += 1
        return super().all_gather(tensor, dim)


def plans_worker(tp: TPGroup) -> dict:
    """(arch, batch, plan) -> (planned output, direct output, collective counts) on this rank."""
    out = {}
    with torch.inference_mode():
        for arch in TOWERS:
            tower = _tower(arch)
            for name, grids in BATCHES.items():
                n = sum(t * h * w for t, h, w in grids)
                gen = torch.Generator().manual_seed(n)
                pixels = torch.randn(n, tower.cfg.patch_dim, generator=gen)
                direct = tower(pixels, torch.tensor(grids))
                for kind, plan in _plans(name, len(grids), tp.size).items():
                    group = CountingGroup(tp)
                    planned = run_planned_encoder(tower, pixels, grids, group, plan)
                    out[arch, name, kind] = (planned, direct, dict(group.counts))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"ws{n}")
def plan_results(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_on_ranks(plans_worker, request.param, timeout=240)


@pytest.mark.parametrize("kind", ["dp", "tp", "hybrid", "dp-assigned"])
@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("arch", list(TOWERS))
def test_every_plan_equals_the_direct_run(
    plan_results: tuple[int, list[dict]], arch: str, name: str, kind: str
) -> None:
    world, per_rank = plan_results
    depth = CONFIG[arch]["depth"]
    plan = _plans(name, len(BATCHES[name]), world)[kind]
    for rank, results in enumerate(per_rank):
        planned, direct, counts = results[arch, name, kind]
        assert direct.abs().max() > 0.1
        # TP items sum each projection in parts over the ranks: within the tower's rounding bound
        assert_within_rounding(planned, direct, _terms(arch, BATCHES[name]))
        # every rank joins the same collectives; none inside the tower for DP items
        assert counts["all_reduce"] == ((2 * depth + 1) if plan.tp_items else 0), rank
        assert counts["all_gather"] == (1 if plan.dp_items else 0), rank


def test_dp_plan_is_exact_per_item(plan_results: tuple[int, list[dict]]) -> None:
    """DP items are encoded by the full tower alone, so only per-item batching can differ."""
    _, per_rank = plan_results
    planned, direct, _ = per_rank[0]["qwen2_vl", "one_image", "dp"]
    assert torch.equal(planned, direct)


def test_shard_needs_full_weights() -> None:
    tower = Qwen2VisionTransformer(_cfg("qwen2_vl"), TPGroup(rank=0, size=2))
    with pytest.raises(RuntimeError, match="full weights"):
        tower.blocks[0].mlp.fc1(torch.zeros(1, 64), TPGroup(rank=0, size=2))


class FakeDevice(torch.nn.Module):
    """The real tower (exact outputs) on a fake clock: each call advances this rank's clock by
    what the call would take on a device whose true costs are `truth` (TP calls on a slice at
    `truth.tp_patch_s`, full-tower calls at `truth.dp_patch_s`, per patch). Rank 1 is 2% slower,
    so the ranks measure different times and must agree on what they learn."""

    def __init__(self, tower: torch.nn.Module, truth: EncoderCosts, rank: int):
        super().__init__()
        self.inner, self.truth, self.slow = tower, truth, 1.0 + 0.02 * rank
        self.spatial_merge_size = tower.spatial_merge_size
        self.out_hidden_size = tower.out_hidden_size
        self.now = 0.0

    def forward(self, pixels: torch.Tensor, grid: torch.Tensor, shard: TPGroup | None = None
                ) -> torch.Tensor:
        per_patch = self.truth.tp_patch_s if shard is not None else self.truth.dp_patch_s
        self.now += self.slow * per_patch * pixels.shape[0]
        return self.inner(pixels, grid, shard=shard)

    def clock(self) -> float:
        return self.now


# The calibration against a device where TP's per-patch cost is 3x higher or lower, and
# collectives are free; each truth flips the calibration's choice for one of the two shapes.
AUTO_BATCHES = {"one_large": [[1, 32, 32]], "many_small": [[1, 4, 4]] * 8}
AUTO_TRUTHS = {
    "tp 3x slower": replace(ZERO, dp_patch_s=1e-6, tp_patch_s=2.25e-6),
    "tp 3x faster": replace(ZERO, dp_patch_s=1e-6, tp_patch_s=0.25e-6),
}
AUTO_CALLS = 96  # the two shapes taking turns: 48 calls each


class Call(NamedTuple):
    """One auto call as the observer saw it: the plan's kind and whether it explored."""

    kind: str
    explored: bool


def record_into(calls: list[Call]) -> CallObserver:
    """An AutoEncoder observer that appends each call's `Call` to `calls`."""
    return lambda choice, _learner: calls.append(Call(choice.plan.kind, choice.explored))


def auto_worker(tp: TPGroup) -> dict:
    """Every call through AutoEncoder on the fake device: per truth, the calls' plans and
    what was learned, and the largest error against the direct run as a fraction of the
    tower's rounding bound."""
    tower = _tower("qwen2_vl")
    shape = TowerShape.of(tower.cfg, 4)
    out = {}
    with torch.inference_mode():
        inputs = {}
        for name, grids in AUTO_BATCHES.items():
            n = sum(t * h * w for t, h, w in grids)
            pixels = torch.randn(n, tower.cfg.patch_dim, generator=torch.Generator().manual_seed(n))
            direct = tower(pixels, torch.tensor(grids))
            bound = rounding_bound(_terms("qwen2_vl", grids), float(direct.abs().max()))
            inputs[name] = (pixels, grids, direct, bound)
        for truth_name, truth in AUTO_TRUTHS.items():
            device = FakeDevice(tower, truth, tp.rank)
            calls: list[Call] = []
            auto = AutoEncoder(device, tp, shape, COSTS, observer=record_into(calls),
                               timer=device.clock)
            errors, names = [], []
            for i in range(AUTO_CALLS):
                names.append(list(AUTO_BATCHES)[i % 2])
                pixels, grids, direct, bound = inputs[names[-1]]
                errors.append(max_abs_diff(auto(pixels, grids), direct) / bound)
            out[truth_name] = {"history": list(zip(names, calls)), "error": max(errors),
                               "explored": auto.learner.explored, "calls": auto.learner.calls}
    return out


@pytest.mark.parametrize("truth", list(AUTO_TRUTHS))
def test_auto_truth_flips_the_calibration(truth: str) -> None:
    for grids in AUTO_BATCHES.values():
        if _truly_best(grids, AUTO_TRUTHS[truth]) != _truly_best(grids, COSTS):
            return
    pytest.fail("the fake device agrees with the calibration: the test below would prove nothing")


def _truly_best(grids: list[list[int]], costs: EncoderCosts) -> str:
    return plan_encoder(frame_units(grids), 2, TowerShape.of(_cfg("qwen2_vl"), 4), costs).kind


@pytest.fixture(scope="module")
def auto_results() -> list[dict]:
    return run_on_ranks(auto_worker, 2, timeout=240)


@pytest.mark.parametrize("truth", list(AUTO_TRUTHS))
def test_auto_converges_alike_on_every_rank(auto_results: list[dict], truth: str) -> None:
    """Both ranks take the same plan on every call (they learn from the slowest rank's time)
    and, within 32 calls of each shape, run the truly faster plan for good; explorations stay
    within their share of the calls."""
    first, second = auto_results[0][truth], auto_results[1][truth]
    assert first["history"] == second["history"]
    # TP plans sum projections in parts: within the tower's rounding bound (see auto_worker)
    assert max(first["error"], second["error"]) <= 1.0
    assert first["explored"] <= EncoderLearner().explore_fraction * first["calls"]
    for name, grids in AUTO_BATCHES.items():
        calls = [record for shape_name, record in first["history"] if shape_name == name]
        assert calls[0].kind == _truly_best(grids, COSTS)  # the calibration's choice first
        late = {r.kind for r in calls[32:] if not r.explored}
        assert late == {_truly_best(grids, AUTO_TRUTHS[truth])}, (name, calls)


@pytest.mark.parametrize("truth", list(AUTO_TRUTHS))
def test_a_wrong_calibration_costs_one_call_per_shape(auto_results: list[dict],
                                                      truth: str) -> None:
    """A class's first calls are learned from at once, not with the next batch of times: from
    each shape's second call on, every greedy call runs the truly faster plan (the calibration
    is 3x wrong for one of the two shapes)."""
    history = auto_results[0][truth]["history"]
    for name, grids in AUTO_BATCHES.items():
        calls = [record for shape_name, record in history if shape_name == name]
        greedy = {r.kind for r in calls[1:] if not r.explored}
        assert greedy == {_truly_best(grids, AUTO_TRUTHS[truth])}, (name, calls[:4])


def calibration_worker(tp: TPGroup) -> tuple[EncoderCosts, EncoderPlan]:
    tower = _tower("qwen2_vl")
    shape = TowerShape.of(tower.cfg, 4)
    costs = calibrate_encoder_costs(tower, tp, shape, repeats=1)
    return costs, plan_encoder(BATCHES["many"], tp.size, shape, costs)


def test_calibration_agrees_across_ranks() -> None:
    (costs0, plan0), (costs1, plan1) = run_on_ranks(calibration_worker, 2, timeout=120)
    assert costs0 == costs1 and plan0 == plan1
    assert costs0.dp_patch_s + costs0.dp_pair_s > 0 and costs0.tp_patch_s + costs0.tp_pair_s > 0
    assert costs0.all_reduce_s + costs0.all_reduce_byte_s > 0
    assert 0 < costs0.dp_alone_factor <= 1


def test_a_tiled_tower_is_calibrated_on_whole_tiles(tmp_path: Path) -> None:
    """InternViT encodes only tiles of its position table's size: the calibration times it on
    whole tiles (it raised on the first frame probe, so auto mode could not start on InternVL
    without --mm-encoder-costs)."""
    from runtime.tiny_checkpoint import make_checkpoint
    from vision.internvl_vit import InternVisionTransformer

    cfg = ModelConfig.from_dir(str(make_checkpoint("internvl", tmp_path / "internvl"))).vision
    tower = InternVisionTransformer(cfg, TPGroup()).eval()
    side = cfg.image_size // cfg.patch_size
    assert {g[1:] for g in tower.calibration_grids()} == {(side, side)}
    costs = calibrate_encoder_costs(tower, TPGroup(), TowerShape.of(cfg, 4), repeats=1)
    shape = TowerShape.of(cfg, 4)
    one, six = (dp_cost([item_work((n, side, side), shape)], 1, shape, costs) for n in (1, 6))
    assert 0 < one <= six


def test_tp_calibration_keeps_the_shape_of_the_work() -> None:
    """TP compute probes of a tower whose slice does 60% of DP's work per patch and pair plus
    20 ms a call, with one probe 10% slow and one 20% fast (a busy 2-core machine): a free fit
    of call + patch + pair puts the per-patch cost at zero (a quiet tp 2 calibration did: 44.5
    ms a call, 0 per patch), so TP of 16 small images looks 2.3x cheaper than it is. Tied to
    DP's per-patch and per-pair costs, the fit stays within 10% there."""
    shape = TowerShape(depth=4, embed_dim=320, out_dim=64, merge=2, elem_bytes=4,
                       window_units=0, full_blocks=4)
    works = [item_work(g, shape) for g in PROBE_GRIDS]
    dp = (4e-3, 87.6e-6, 2.16e-8)
    noise = (1.0, 1.0, 1.0, 1.1, 0.8)
    times = [(20e-3 + 0.6 * (dp[1] * n + dp[2] * q)) * f for (n, q), f in zip(works, noise)]
    free = fit_free(works, times)
    assert free[1] == 0.0  # what the free fit does with these probes
    call, patch, pair = fit_tp(works, times, dp)
    assert patch / dp[1] == pytest.approx(pair / dp[2]) and 0.5 < patch / dp[1] < 0.75
    many = [item_work([1, 16, 16], shape)] * 16
    n, q = sum(w[0] for w in many), sum(w[1] for w in many)
    truth = 20e-3 + 0.6 * (dp[1] * n + dp[2] * q)
    assert call + patch * n + pair * q == pytest.approx(truth, rel=0.1)
    assert free[0] + free[1] * n + free[2] * q < 0.5 * truth


class SumGroup(TPGroup):
    """rank/size of a shard with every collective the identity: each rank's partial result."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def test_a_shard_runs_on_one_contiguous_copy_of_its_slice() -> None:
    """A sharded call computes with its rank's slice of the full weights (q, k and v parts
    together) made contiguous once and reused; the ranks' partial sums add up to the full
    layer's output."""
    torch.manual_seed(0)
    block = Qwen2VisionTransformer(_cfg("qwen2_vl"), TPGroup()).blocks[0]
    for p in block.parameters():
        p.data.normal_()
    x = torch.randn(5, block.attn.qkv.weight.shape[1])
    qkv, fc2 = block.attn.qkv, block.mlp.fc2
    hidden = torch.randn(5, fc2.weight.shape[1])
    local = hidden.shape[1] // 2  # each rank holds its half of the input features
    partial = [fc2(hidden[:, r * local : (r + 1) * local], SumGroup(rank=r, size=2))
               for r in range(2)]
    full_sum = F.linear(hidden, fc2.weight) + 2 * fc2.bias  # each partial adds the bias once
    # two partial sums against one: float32 summation order only
    torch.testing.assert_close(partial[0] + partial[1], full_sum, rtol=1e-5, atol=1e-4)
    for rank in range(2):
        shard = SumGroup(rank=rank, size=2)
        want = torch.cat([
            F.linear(x, qkv.weight.narrow(0, s, n), qkv.bias.narrow(0, s, n))
            for s, n in qkv.shard_parts(shard)
        ], dim=-1)  # fmt: skip
        # the same dot products, blocked into one matmul instead of three
        torch.testing.assert_close(qkv(x, shard), want, rtol=1e-6, atol=1e-5)
        cached = qkv._shard_cache["weight", 2, rank]
        assert cached.is_contiguous() and cached.shape[0] == want.shape[1]
        qkv(x, shard)
        assert qkv._shard_cache["weight", 2, rank] is cached  # made once


def test_auto_mode_makes_its_shard_copies_at_start_up() -> None:
    """Every full-weight parallel layer of the tower has its rank's copy before any call, so a
    GPU's memory plan (made after the model is built) sees those bytes."""
    tower = Qwen2VisionTransformer(_cfg("qwen2_vl"), TPGroup())
    shard = TPGroup(rank=1, size=2)
    prepare_shard_weights(tower, shard)
    layers = [m for m in tower.modules() if isinstance(m, (ColumnParallelLinear,
                                                            RowParallelLinear))]
    assert layers and all(("weight", 2, 1) in m._shard_cache for m in layers)
