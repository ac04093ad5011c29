"""The DP encoder: its greedy balancer, its plan, and the sharded run against a direct run.

The sharded run is checked twice: in-process with one thread per simulated rank (many world
sizes and batches, counting collectives), and on real Gloo ranks at world sizes 2 and 4, with all
batches of one world size run inside a single spawned group to keep the spawn count low.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
import torch
from dist_utils import run_on_ranks
from torch import nn

from runtime.distributed import TPGroup
from vision.dp_encoder import (
    get_dp_encoder_lb_assignment,
    inverse_permutation,
    plan_dp_encoder,
    run_dp_sharded_mrope_vision_model,
)

# ---------------------------------------------------------------- balancer (pure)


def test_no_items() -> None:
    assert get_dp_encoder_lb_assignment([], 3) == ([], [0, 0, 0], [0, 0, 0])


def test_fewer_items_than_ranks() -> None:
    assert get_dp_encoder_lb_assignment([5, 9], 4) == ([1, 0], [1, 1, 0, 0], [9, 5, 0, 0])


def test_one_rank_keeps_everything_largest_first() -> None:
    assert get_dp_encoder_lb_assignment([3, 7, 5], 1) == ([1, 2, 0], [3], [15])


def test_equal_sizes_round_robin_ties_to_lowest_rank() -> None:
    shuffle, counts, loads = get_dp_encoder_lb_assignment([4, 4, 4, 4, 4], 2)
    assert shuffle == [0, 2, 4, 1, 3]
    assert counts == [3, 2] and loads == [12, 8]


def test_one_large_item_against_many_small() -> None:
    shuffle, counts, loads = get_dp_encoder_lb_assignment([1000, 100, 200, 50], 2)
    assert loads == [1000, 350]
    assert counts == [1, 3]
    assert shuffle == [0, 2, 1, 3]


def test_assignment_that_is_not_its_own_inverse() -> None:
    shuffle, counts, loads = get_dp_encoder_lb_assignment([1, 3, 2], 2)
    assert shuffle == [1, 2, 0]  # rank 0: item 1; rank 1: items 2 then 0
    assert counts == [1, 2] and loads == [3, 3]
    inverse = inverse_permutation(shuffle)
    assert inverse == [2, 0, 1]
    assert inverse != shuffle  # using shuffle as its own inverse would scramble the items
    assert [shuffle[inverse[i]] for i in range(3)] == [0, 1, 2]


def test_bad_rank_count() -> None:
    for n in (0, -1):
        with pytest.raises(ValueError):
            get_dp_encoder_lb_assignment([1], n)


@pytest.mark.parametrize("seed", range(30))
def test_random_sizes_keep_the_greedy_invariant(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randint(1, 5000), 64, 256]) for _ in range(rng.randint(0, 30))]
    ranks = rng.randint(1, 8)
    shuffle, counts, loads = get_dp_encoder_lb_assignment(sizes, ranks)
    assert sorted(shuffle) == list(range(len(sizes)))  # every item exactly once
    assert len(counts) == len(loads) == ranks and sum(counts) == len(sizes)
    start = 0
    for r in range(ranks):
        items = shuffle[start : start + counts[r]]
        start += counts[r]
        assert loads[r] == sum(sizes[i] for i in items)
        assert [sizes[i] for i in items] == sorted((sizes[i] for i in items), reverse=True)
        # greedy: when its last item arrived, rank r was the least loaded of all ranks
        if items:
            assert loads[r] - sizes[items[-1]] <= min(loads)


# ---------------------------------------------------------------- plan (pure)


def test_plan_rows_and_padding() -> None:
    plan = plan_dp_encoder([[1, 2, 2], [1, 2, 6], [1, 2, 4]], 2)  # patches 4, 12, 8
    assert plan.shuffle_indices == (1, 2, 0)
    assert plan.gpu_loads == (12, 12)
    assert plan.item_rows == (1, 3, 2)
    assert plan.rank_items(0) == [1] and plan.rank_items(1) == [2, 0]
    assert plan.rank_rows == [3, 3] and plan.max_rows == 3


def test_plan_rejects_bad_grids() -> None:
    for grid in ([1, 3, 4], [0, 2, 2], [1, 2]):
        with pytest.raises(ValueError):
            plan_dp_encoder([grid], 2)


# ---------------------------------------------------------------- a fake per-item tower

PATCH_DIM, OUT_DIM = 8, 6


class FakeTower(nn.Module):
    """A deterministic tower that treats items independently, exactly (bitwise).

    Per item: a fixed random linear map on each patch row, then the mean of each group of
    merge**2 consecutive rows, plus a tag made of the item's grid, so an item paired with the
    wrong grid shows up. It loops over items so an item's arithmetic never depends on its
    neighbours, and it refuses an empty input (the DP encoder must never send one).
    """

    def __init__(self, merge: int = 2, with_out_dim: bool = True) -> None:
        super().__init__()
        self.merge = merge
        if with_out_dim:
            self.out_hidden_size = OUT_DIM
        gen = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(PATCH_DIM, OUT_DIM, generator=gen))
        self.calls: list[list[list[int]]] = []

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if pixels.shape[0] == 0 or grid_thw.numel() == 0:
            raise AssertionError("the vision model was called on an empty input")
        grids = grid_thw.tolist()
        self.calls.append(grids)
        sizes = [t * h * w for t, h, w in grids]
        return torch.cat([self._item(p, g) for p, g in zip(pixels.split(sizes), grids)])

    def _item(self, pixels: torch.Tensor, grid: list[int]) -> torch.Tensor:
        merged = (pixels @ self.weight).view(-1, self.merge**2, OUT_DIM).mean(1)
        t, h, w = grid
        return merged + float(t * 10_000 + h * 100 + w)


BATCHES: dict[str, list[list[int]]] = {
    "mixed_with_video": [[1, 4, 4], [2, 4, 6], [1, 6, 8], [1, 2, 2], [3, 2, 4]],
    "video_only": [[4, 4, 4]],
    "not_an_involution": [[1, 2, 2], [1, 2, 6], [1, 2, 4]],
    "one_item": [[1, 2, 4]],
    "three_items": [[1, 2, 4], [1, 4, 2], [2, 2, 2]],
    "equal_sizes": [[1, 4, 4]] * 5,
    "empty": [],
}


def _pixels(grids: list[list[int]]) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(n))


def _direct(grids: list[list[int]], merge: int = 2) -> torch.Tensor:
    if not grids:
        return torch.empty(0, OUT_DIM)
    return FakeTower(merge)(_pixels(grids), torch.tensor(grids))


def test_one_rank_calls_the_model_directly() -> None:
    tower = FakeTower()
    grids = BATCHES["mixed_with_video"]
    out = run_dp_sharded_mrope_vision_model(tower, _pixels(grids), grids, TPGroup())
    assert torch.equal(out, _direct(grids)) and tower.calls == [grids]


def test_no_items_gives_an_empty_tensor_without_calling_the_model() -> None:
    tower = FakeTower().to(torch.float64)
    out = run_dp_sharded_mrope_vision_model(tower, torch.empty(0, PATCH_DIM), [], TPGroup())
    assert out.shape == (0, OUT_DIM) and out.dtype == torch.float64 and not tower.calls


def test_out_dim_is_required_somewhere() -> None:
    grids = [[1, 2, 2]]
    with pytest.raises(ValueError, match="out_dim"):
        run_dp_sharded_mrope_vision_model(
            FakeTower(with_out_dim=False), _pixels(grids), grids, TPGroup()
        )
    out = run_dp_sharded_mrope_vision_model(
        FakeTower(with_out_dim=False), _pixels(grids), grids, TPGroup(), out_dim=OUT_DIM
    )
    assert out.shape == (1, OUT_DIM)


def test_pixel_rows_must_match_the_grids() -> None:
    with pytest.raises(ValueError, match="rows"):
        run_dp_sharded_mrope_vision_model(
            FakeTower(), torch.zeros(5, PATCH_DIM), [[1, 2, 2]], TPGroup()
        )


# ---------------------------------------------------------------- simulated ranks (threads)


class ThreadGroup:
    """Stands in for a TPGroup on one thread per rank; counts all-gathers, demands equal shapes."""

    def __init__(self, rank: int, size: int, shared: dict[str, Any]) -> None:
        self.rank, self.size, self.shared = rank, size, shared
        self.gathers = 0

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        assert dim == 0
        self.gathers += 1
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = tensor.clone()
        barrier.wait()
        shapes = {tuple(t.shape) for t in slots}
        dtypes = {t.dtype for t in slots}
        out = torch.cat(slots)
        barrier.wait()
        assert len(shapes) == 1 and len(dtypes) == 1, f"unequal all-gather inputs: {shapes}"
        return out


def _run_threads(world: int, grids: list[list[int]], merge: int) -> list[tuple]:
    shared: dict[str, Any] = {
        "slots": [None] * world,
        "barrier": threading.Barrier(world, timeout=120),  # generous: a failing rank aborts it
    }

    def one_rank(rank: int) -> tuple:
        group, tower = ThreadGroup(rank, world, shared), FakeTower(merge)
        try:
            out = run_dp_sharded_mrope_vision_model(
                tower, _pixels(grids), grids, cast(TPGroup, group), spatial_merge_size=merge
            )
        except BaseException:
            shared["barrier"].abort()  # let the other ranks fail fast instead of waiting
            raise
        return out, group.gathers, tower.calls

    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(one_rank, r) for r in range(world)]
        errors = [f.exception(timeout=300) for f in futures]
    causes = [
        e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)
    ]
    if causes or any(errors):
        raise causes[0] if causes else errors[0]  # the rank that broke the barrier, not a bystander
    return [f.result() for f in futures]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("name", list(BATCHES))
def test_simulated_ranks_match_the_direct_run(world: int, name: str) -> None:
    grids = BATCHES[name]
    direct = _direct(grids)
    plan = plan_dp_encoder(grids, world)
    for rank, (out, gathers, calls) in enumerate(_run_threads(world, grids, 2)):
        assert torch.equal(out, direct), f"rank {rank} differs"
        assert gathers == (1 if grids else 0)  # exactly one collective, also on idle ranks
        mine = [grids[i] for i in plan.rank_items(rank)]
        assert calls == ([mine] if mine else [])  # its own items in one call; idle ranks none


@pytest.mark.parametrize("seed", range(6))
def test_simulated_ranks_random_batches(seed: int) -> None:
    rng = random.Random(seed)
    merge = rng.choice([1, 2])
    grids = [
        [rng.randint(1, 3), 2 * rng.randint(1, 4), 2 * rng.randint(1, 4)]
        for _ in range(rng.randint(0, 9))
    ]
    direct = _direct(grids, merge)
    for out, _, _ in _run_threads(rng.randint(2, 6), grids, merge):
        assert torch.equal(out, direct)


# ---------------------------------------------------------------- real Gloo ranks

def gloo_worker(tp: TPGroup) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """Every batch on this rank: (sharded output, direct output, number of tower calls)."""
    out = {}
    for name, grids in BATCHES.items():
        tower = FakeTower()
        sharded = run_dp_sharded_mrope_vision_model(tower, _pixels(grids), grids, tp)
        out[name] = (sharded, _direct(grids), len(tower.calls))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"ws{n}")
def gloo_results(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_on_ranks(gloo_worker, request.param, timeout=90)


@pytest.mark.parametrize("name", list(BATCHES))
def test_gloo_sharded_run_equals_direct_run(
    gloo_results: tuple[int, list[dict]], name: str
) -> None:
    world, per_rank = gloo_results
    grids = BATCHES[name]
    plan = plan_dp_encoder(grids, world)
    reference = _direct(grids)
    for rank, results in enumerate(per_rank):
        sharded, direct, calls = results[name]
        assert torch.equal(direct, reference)
        assert sharded.shape == (sum(plan.item_rows), OUT_DIM)
        assert torch.equal(sharded, direct), f"rank {rank} of {world} differs"
        assert calls == (1 if plan.rank_items(rank) else 0)  # idle ranks never call the tower
