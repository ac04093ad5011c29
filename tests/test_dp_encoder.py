"""The DP encoder's greedy balancer, and the sharded run against a direct run on Gloo ranks."""

from __future__ import annotations

import random

import pytest
import torch
from dist_utils import run_on_ranks
from torch import nn

from runtime.distributed import TPGroup
from vision.dp_encoder import get_dp_encoder_lb_assignment, run_dp_sharded_mrope_vision_model


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


def test_documented_example() -> None:
    shuffle, counts, loads = get_dp_encoder_lb_assignment([1000, 100, 200, 50], 2)
    assert loads == [1000, 350]
    assert counts == [1, 3]
    assert shuffle == [0, 2, 1, 3]


def test_assignment_that_is_not_its_own_inverse() -> None:
    shuffle, counts, loads = get_dp_encoder_lb_assignment([1, 3, 2], 2)
    assert shuffle == [1, 2, 0]  # rank 0: item 1; rank 1: items 2 then 0
    assert [shuffle[shuffle[i]] for i in range(3)] != [0, 1, 2]  # not an involution
    assert counts == [1, 2] and loads == [3, 3]


def test_bad_rank_count() -> None:
    with pytest.raises(ValueError):
        get_dp_encoder_lb_assignment([1], 0)


@pytest.mark.parametrize("seed", range(20))
def test_random_sizes_keep_the_greedy_invariant(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.randint(1, 5000) for _ in range(rng.randint(0, 30))]
    ranks = rng.randint(1, 8)
    shuffle, counts, loads = get_dp_encoder_lb_assignment(sizes, ranks)
    assert sorted(shuffle) == list(range(len(sizes)))
    assert sum(counts) == len(sizes)
    start = 0
    for r in range(ranks):
        assert loads[r] == sum(sizes[i] for i in shuffle[start : start + counts[r]])
        start += counts[r]
    if sizes:  # greedy bound: no rank exceeds the mean by more than the largest item
        assert max(loads) <= sum(sizes) / ranks + max(sizes)


class FakeTower(nn.Module):
    """Per-item deterministic encoder: a linear map per patch, then mean over merge groups.
    Depends on the grid too, so feeding an item the wrong grid shows up."""

    out_hidden_size = 6

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.randn(8, 6, generator=gen)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        out = (pixels @ self.weight).view(-1, 4, 6).mean(1)
        rows = (grid_thw.prod(-1) // 4).tolist()
        tags = torch.cat(
            [torch.full((n, 1), float(g[1] * 100 + g[2])) for n, g in zip(rows, grid_thw.tolist())]
        )
        return out + tags


BATCHES = {
    "mixed": [[1, 4, 4], [2, 4, 6], [1, 6, 8], [1, 2, 2], [3, 2, 4]],
    "video_only": [[4, 4, 4]],
    "fewer_than_ranks": [[1, 2, 4], [1, 4, 2]],
    "empty": [],
}


def _pixels(grids: list[list[int]]) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(n))


def sharded_worker(tp: TPGroup) -> dict[str, torch.Tensor]:
    tower = FakeTower()
    return {
        name: run_dp_sharded_mrope_vision_model(tower, _pixels(grids), grids, tp)
        for name, grids in BATCHES.items()
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"ws{n}")
def sharded(request: pytest.FixtureRequest) -> list[dict[str, torch.Tensor]]:
    return run_on_ranks(sharded_worker, request.param, timeout=120)


@pytest.mark.parametrize("name", list(BATCHES))
def test_sharded_run_equals_direct_run(sharded, name: str) -> None:
    grids = BATCHES[name]
    tower = FakeTower()
    if grids:
        direct = tower(_pixels(grids), torch.tensor(grids))
    else:
        direct = torch.empty(0, FakeTower.out_hidden_size)
    for rank_out in sharded:
        assert rank_out[name].shape == direct.shape
        torch.testing.assert_close(rank_out[name], direct, rtol=0, atol=1e-6)
