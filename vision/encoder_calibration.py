"""Start-up calibration of the auto encoder mode's cost model on the real device and group.

Every rank runs the same short probes at the same time (so they compete for the device as in
service): all-reduce and all-gather at two sizes, fitted to latency + per-byte cost; then the
full tower (every rank busy, as in DP) and a real TP call on this rank's slice (with its
all-reduces) on five grids. DP is fitted to call + patch + pair costs. For TP the modeled
all-reduce time is taken off each probe first, so what the per-layer synchronisation costs beyond
the bytes (waiting for the slowest rank on a busy machine) counts as TP compute; that compute is
fitted to a call cost plus one factor on DP's per-patch and per-pair costs (a rank's slice does
the same work per patch and pair, split over the heads and features, at some efficiency). Left
free, TP's per-patch and per-pair terms trade places on noisy probes (the probes' patch and pair
counts rise together): one quiet tp 2 calibration put TP's per-patch cost at zero, so every item
moved from DP to TP looked nearly free and auto ran a hybrid 30% slower than DP for five rounds.
Each probe keeps its fastest repeat. Rank 0's costs are broadcast so every rank plans alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from runtime.distributed import TPGroup
from runtime.logging_utils import get_logger, log_rank0
from vision.encoder_plan import EncoderCosts, TowerShape, item_work, tp_cost
from vision.vit_common import FRAME_PROBES

logger = get_logger(__name__)

PROBE_GRIDS = FRAME_PROBES  # a tower's own probes: `VisionTower.calibration_grids`
PROBE_BYTES = (1 << 14, 1 << 21)


def calibrate_encoder_costs(
    tower: nn.Module, tp: TPGroup, shape: TowerShape, repeats: int = 3
) -> EncoderCosts:
    """Measure this device and group; every rank must call this; returns rank 0's costs."""
    with torch.inference_mode():
        reduce = _fit_collective(lambda x: tp.all_reduce(x), tp, repeats, tower)
        gather = _fit_collective(lambda x: tp.all_gather(x, dim=0), tp, repeats, tower, gather=True)
        times = _probe_times(tower, tp, repeats)
    comm = EncoderCosts(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, *reduce, 0.0, 0.0)
    works = [item_work(g, shape) for g in tower.calibration_grids()]
    dp = fit_free(works, times["dp"])
    tp_times = [max(0.0, t - tp_cost([w], shape, comm)) for w, t in zip(works, times["tp"])]
    tp_fit = fit_tp(works, tp_times, dp)
    alone = min(1.0, sum(times["alone"]) / sum(times["dp"]))
    costs = EncoderCosts(*dp, *tp_fit, *reduce, *gather, alone)
    agreed = tp.broadcast_pyobj(costs)
    assert isinstance(agreed, EncoderCosts)
    log_rank0(logger, tp.rank, "auto encoder mode: calibrated costs %s", agreed.to_json())
    return agreed


def _probe_times(tower: nn.Module, tp: TPGroup, repeats: int) -> dict[str, list[float]]:
    """Fastest time per probe grid of: the full tower on every rank ("dp"), a real TP call
    ("tp"), and the full tower on rank 0 with the others idle ("alone"). The three take turns
    on every repeat, so a change of load on the machine hits them alike."""
    out: dict[str, list[float]] = {"dp": [], "tp": [], "alone": []}
    for grid in tower.calibration_grids():
        pixels = _probe_pixels(tower, grid[0] * grid[1] * grid[2])
        grid_t = torch.tensor([grid], dtype=torch.long)
        full = _bind(tower, pixels, grid_t)
        runs = {
            "dp": full,
            "tp": _bind(tower, pixels, grid_t, tp if tp.size > 1 else None),
            "alone": full if tp.rank == 0 else _bind(int),
        }
        best = {name: float("inf") for name in runs}
        for i in range(repeats + 1):
            for name, run in runs.items():
                elapsed = _timed(run, tp, tower)
                best[name] = min(best[name], elapsed) if i else best[name]
        for name in out:
            out[name].append(best[name])
    return out


def fit_free(works: list[tuple[int, int]], times: list[float]) -> tuple[float, float, float]:
    """(call_s, patch_s, pair_s) >= 0 fitted to the probe times."""
    call, patch, pair = _nonneg_solve([[1.0, float(n), float(q)] for n, q in works], times)
    return call, patch, pair


def fit_tp(
    works: list[tuple[int, int]], times: list[float], dp: tuple[float, float, float]
) -> tuple[float, float, float]:
    """TP's (call_s, patch_s, pair_s): a call cost plus one factor on DP's per-patch and
    per-pair costs (`dp` is DP's fit), fitted >= 0 to the probes' TP compute times. Pure.
    Falls back to a free fit when DP's fit has no per-patch or per-pair cost to scale."""
    _, dp_patch, dp_pair = dp
    if dp_patch <= 0 and dp_pair <= 0:
        return fit_free(works, times)
    work = [dp_patch * n + dp_pair * q for n, q in works]
    call, factor = _nonneg_solve([[1.0, w] for w in work], times)
    return call, factor * dp_patch, factor * dp_pair


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
    """Fastest of `repeats` timed runs after one warm-up."""
    _timed(fn, tp, tower)
    return min(_timed(fn, tp, tower) for _ in range(repeats))


def _timed(fn: Callable[[], object], tp: TPGroup, tower: nn.Module) -> float:
    """Seconds of one run, every rank starting together."""
    cuda = next(tower.parameters()).is_cuda
    tp.all_reduce_cpu(torch.zeros(1))  # a barrier on the CPU group
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _nonneg_solve(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares for coefficients >= 0 (one per column): drop a negative term and refit
    the rest."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(times, dtype=torch.float64)
    scale = a.abs().amax(0).clamp_min(1e-30)  # columns differ by many orders of magnitude
    active = list(range(a.shape[1]))
    out = [0.0] * a.shape[1]
    while active:
        sol = torch.linalg.lstsq(a[:, active] / scale[active], b[:, None]).solution[:, 0]
        coef = sol / scale[active]
        if (coef >= 0).all():
            for j, c in zip(active, coef.tolist()):
                out[j] = c
            return out
        active.pop(int(coef.argmin()))
    return out
