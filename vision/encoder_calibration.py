"""Start-up calibration of the auto encoder mode's cost model on the real device and group.

Every rank runs the same short probes at the same time (so they compete for the device as in
service): the full tower and this rank's TP slice (compute only: a group whose all-reduce does
nothing) on three grids, fitted to call + patch + pair costs; then all-reduce and all-gather at
two sizes, fitted to latency + per-byte cost. Each probe keeps its fastest repeat. Rank 0's
costs are broadcast so every rank plans alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from runtime.distributed import TPGroup
from runtime.logging_utils import get_logger, log_rank0
from vision.encoder_plan import EncoderCosts, TowerShape, item_work

logger = get_logger(__name__)

# One frame of 16x16 patches, one of 32x32, and 4 frames of 16x16 (same patches as the second,
# a quarter of its attention pairs): enough to tell the call, per-patch and per-pair costs apart.
PROBE_GRIDS = ((1, 16, 16), (1, 32, 32), (4, 16, 16))
PROBE_BYTES = (1 << 14, 1 << 21)


class ComputeOnlyShard(TPGroup):
    """A rank's TP slice without communication: measures TP compute alone."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def calibrate_encoder_costs(
    tower: nn.Module, tp: TPGroup, shape: TowerShape, repeats: int = 3
) -> EncoderCosts:
    """Measure this device and group; every rank must call this; returns rank 0's costs."""
    with torch.inference_mode():
        dp = _fit_compute(tower, None, tp, shape, repeats)
        shard = ComputeOnlyShard(tp.rank, tp.size)
        tp_fit = _fit_compute(tower, shard, tp, shape, repeats) if tp.size > 1 else dp
        reduce = _fit_collective(lambda x: tp.all_reduce(x), tp, repeats, tower)
        gather = _fit_collective(lambda x: tp.all_gather(x, dim=0), tp, repeats, tower, gather=True)
    costs = EncoderCosts(*dp, *tp_fit, *reduce, *gather)
    agreed = tp.broadcast_pyobj(costs)
    assert isinstance(agreed, EncoderCosts)
    log_rank0(logger, tp.rank, "auto encoder mode: calibrated costs %s", agreed.to_json())
    return agreed


def _fit_compute(
    tower: nn.Module, shard: TPGroup | None, tp: TPGroup, shape: TowerShape, repeats: int
) -> tuple[float, float, float]:
    """(call_s, patch_s, pair_s) from timing the tower on PROBE_GRIDS."""
    rows, times = [], []
    for grid in PROBE_GRIDS:
        pixels = _probe_pixels(tower, grid[0] * grid[1] * grid[2])
        grid_t = torch.tensor([grid], dtype=torch.long)
        run = _bind(tower, pixels, grid_t, shard)
        times.append(_best_time(run, tp, repeats, tower))
        patches, pairs = item_work(grid, shape)
        rows.append([1.0, float(patches), float(pairs)])
    return _nonneg_solve(rows, times)


def _fit_collective(
    op: Callable[[torch.Tensor], torch.Tensor],
    tp: TPGroup,
    repeats: int,
    tower: nn.Module,
    gather: bool = False,
) -> tuple[float, float]:
    """(latency_s, byte_s) from two payload sizes; zero for a one-rank group."""
    if tp.size == 1:
        return 0.0, 0.0
    like = next(tower.parameters())
    points = []
    for nbytes in PROBE_BYTES:
        x = torch.zeros(nbytes // like.element_size(), dtype=like.dtype, device=like.device)
        moved = nbytes * (tp.size if gather else 1)
        points.append((moved, _best_time(_bind(op, x), tp, repeats, tower)))
    (b0, t0), (b1, t1) = points
    byte_s = max(0.0, (t1 - t0) / (b1 - b0))
    return max(0.0, t0 - byte_s * b0), byte_s


def _bind(fn: Callable[..., object], *args: object, **kw: object) -> Callable[[], object]:
    return lambda: fn(*args, **kw)


def _probe_pixels(tower: nn.Module, patches: int) -> torch.Tensor:
    like = next(tower.parameters())
    gen = torch.Generator().manual_seed(patches)
    pixels = torch.randn(patches, tower.cfg.patch_dim, generator=gen)
    return pixels.to(device=like.device, dtype=like.dtype)


def _best_time(fn: Callable[[], object], tp: TPGroup, repeats: int, tower: nn.Module) -> float:
    """Fastest of `repeats` timed runs after one warm-up, every rank starting together."""
    cuda = next(tower.parameters()).is_cuda
    best = float("inf")
    for i in range(repeats + 1):
        tp.all_reduce_cpu(torch.zeros(1))  # a barrier on the CPU group
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def _nonneg_solve(rows: list[list[float]], times: list[float]) -> tuple[float, float, float]:
    """Least squares for [call, patch, pair] >= 0: drop a negative term and refit the rest."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(times, dtype=torch.float64)
    scale = a.abs().amax(0).clamp_min(1e-30)  # columns differ by many orders of magnitude
    active = [0, 1, 2]
    while active:
        sol = torch.linalg.lstsq(a[:, active] / scale[active], b[:, None]).solution[:, 0]
        coef = sol / scale[active]
        if (coef >= 0).all():
            out = [0.0, 0.0, 0.0]
            for j, c in zip(active, coef.tolist()):
                out[j] = c
            return out[0], out[1], out[2]
        active.pop(int(coef.argmin()))
    return 0.0, 0.0, 0.0
