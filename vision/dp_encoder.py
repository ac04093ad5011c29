"""Data-parallel vision encoder: every rank holds the whole ViT and encodes a balanced share.

Every rank receives the same batch (all items' patch rows, concatenated in item order, and their
(t, h, w) grids) and computes the same plan: items are assigned greedily by patch count (largest
first, each to the least-loaded rank, ties to the lowest rank). Each rank encodes only its own
items, pads its output to the largest rank's row count, and one all-gather over the TP group
brings every rank every embedding; the padding is stripped and the original item order restored
with the inverse of the assignment permutation.

Collective rule: a rank with no items still joins the all-gather (with a padding-only tensor) and
never calls the tower on an empty input. A batch with no items issues no collective at all, which
is safe because every rank sees the same batch and so makes the same decision.

Numerics: the tower attends within each item only (per-frame `cu_seqlens`) and has no batch-level
statistics, so an item's embeddings do not depend on which other items share its call. The sharded
result is therefore bitwise the same as one direct call over the whole batch, up to that per-item
independence (a kernel whose rounding depends on the total row count can differ in the last bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from runtime.distributed import TPGroup


def get_dp_encoder_lb_assignment(
    sizes: Sequence[int], num_gpus: int
) -> tuple[list[int], list[int], list[int]]:
    """Greedy balance of items over ranks; returns (shuffle_indices, gpu_sample_counts, gpu_loads).

    Items are visited largest first (a stable sort, so equal sizes keep their index order) and
    each goes to the least-loaded rank, ties to the lowest rank. `shuffle_indices` lists the item
    indices grouped by rank (rank 0's first), each group in assignment order; `gpu_sample_counts[r]`
    and `gpu_loads[r]` are rank r's item count and total size. Pure function.
    """
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be at least 1, got {num_gpus}")
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])  # sorted() is stable
    per_rank: list[list[int]] = [[] for _ in range(num_gpus)]
    loads = [0] * num_gpus
    for i in order:
        rank = min(range(num_gpus), key=lambda r: (loads[r], r))
        per_rank[rank].append(i)
        loads[rank] += sizes[i]
    shuffle = [i for items in per_rank for i in items]
    return shuffle, [len(items) for items in per_rank], loads


def inverse_permutation(perm: Sequence[int]) -> list[int]:
    """`inv` with `inv[perm[k]] == k`: position k of the permuted order holds item perm[k]."""
    inv = [0] * len(perm)
    for k, item in enumerate(perm):
        inv[item] = k
    return inv


@dataclass(frozen=True)
class DPEncoderPlan:
    """How one batch's items are spread over the ranks; every rank computes the same plan."""

    shuffle_indices: tuple[int, ...]
    gpu_sample_counts: tuple[int, ...]
    gpu_loads: tuple[int, ...]  # patches per rank: what the benchmark reports as balance
    item_rows: tuple[int, ...]  # merged output rows per item, in the original item order

    @property
    def num_ranks(self) -> int:
        return len(self.gpu_sample_counts)

    def rank_items(self, rank: int) -> list[int]:
        """Rank `rank`'s item indices, in the order it encodes them."""
        start = sum(self.gpu_sample_counts[:rank])
        return list(self.shuffle_indices[start : start + self.gpu_sample_counts[rank]])

    @property
    def rank_rows(self) -> list[int]:
        """Merged output rows each rank produces (before padding)."""
        return [sum(self.item_rows[i] for i in self.rank_items(r)) for r in range(self.num_ranks)]

    @property
    def max_rows(self) -> int:
        return max(self.rank_rows)


def plan_dp_encoder(
    grid_thw_list: Sequence[Sequence[int]],
    num_ranks: int,
    spatial_merge_size: int = 2,
    assignment: Sequence[Sequence[int]] | None = None,
) -> DPEncoderPlan:
    """Balance items by patch count (t*h*w) over `num_ranks`, or take `assignment` (per rank,
    the item indices it encodes, every item once: the auto mode's balance by modeled time);
    pure, used also by benchmarks."""
    grids = _check_grids(grid_thw_list, spatial_merge_size)
    patches = [t * h * w for t, h, w in grids]
    if assignment is None:
        shuffle, counts, loads = get_dp_encoder_lb_assignment(patches, num_ranks)
    else:
        shuffle = [i for items in assignment for i in items]
        if len(assignment) != num_ranks or sorted(shuffle) != list(range(len(grids))):
            raise ValueError(f"assignment {assignment} does not give {len(grids)} items to "
                             f"{num_ranks} ranks once each")
        counts = [len(items) for items in assignment]
        loads = [sum(patches[i] for i in items) for items in assignment]
    rows = [n // spatial_merge_size**2 for n in patches]
    return DPEncoderPlan(tuple(shuffle), tuple(counts), tuple(loads), tuple(rows))


def run_dp_sharded_mrope_vision_model(
    vision_model: nn.Module,
    pixel_values: torch.Tensor,
    grid_thw_list: Sequence[Sequence[int]],
    tp: TPGroup,
    *,
    spatial_merge_size: int = 2,
    out_dim: int | None = None,
    assignment: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Encode every item with the work spread over `tp`; returns [sum of merged rows, out_dim].

    Every rank must call this with the same `pixel_values` ([sum of t*h*w, patch_dim]) and grids.
    `vision_model(pixels, grid_thw)` must encode items independently and return t*h*w // merge**2
    rows per item. `out_dim` defaults to `vision_model.out_hidden_size`. `assignment` (per
    rank, its item indices) replaces the patch-count balance. The tower runs with full weights
    and no TP collective inside; one all-gather after it (invariant 3).
    """
    grids = _check_grids(grid_thw_list, spatial_merge_size)
    _check_pixel_rows(pixel_values, grids)
    dim = _resolve_out_dim(vision_model, out_dim)
    if not grids:
        return _empty_output(vision_model, pixel_values, dim)
    if tp.size == 1:
        return vision_model(pixel_values, torch.tensor(grids, dtype=torch.long))
    plan = plan_dp_encoder(grids, tp.size, spatial_merge_size, assignment)
    mine = plan.rank_items(tp.rank)
    local = _encode_local(vision_model, pixel_values, grids, mine, dim)
    _check_local_output(local, sum(plan.item_rows[i] for i in mine), dim)
    return _restore_order(_gather_padded(local, plan.max_rows, tp), plan)


def _check_grids(grid_thw_list: Sequence[Sequence[int]], merge: int) -> list[list[int]]:
    grids = [[int(x) for x in g] for g in grid_thw_list]
    for g in grids:
        if len(g) != 3 or min(g) < 1 or g[1] % merge or g[2] % merge:
            raise ValueError(f"grid {g} is not a positive (t, h, w) with h, w divisible by {merge}")
    return grids


def _check_pixel_rows(pixel_values: torch.Tensor, grids: list[list[int]]) -> None:
    expected = sum(t * h * w for t, h, w in grids)
    if pixel_values.shape[0] != expected:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows, grids need {expected}")


def _resolve_out_dim(vision_model: nn.Module, out_dim: int | None) -> int:
    dim = out_dim if out_dim is not None else getattr(vision_model, "out_hidden_size", None)
    if dim is None:
        raise ValueError("pass out_dim or give the vision model an `out_hidden_size` attribute")
    return int(dim)


def _empty_output(vision_model: nn.Module, pixel_values: torch.Tensor, dim: int) -> torch.Tensor:
    """[0, dim] in the dtype and on the device of the tower's weights (else of the input)."""
    like = next(vision_model.parameters(), pixel_values)
    return torch.empty(0, dim, dtype=like.dtype, device=like.device)


def _encode_local(
    vision_model: nn.Module,
    pixel_values: torch.Tensor,
    grids: list[list[int]],
    mine: list[int],
    dim: int,
) -> torch.Tensor:
    """Run the tower on this rank's items only (never on an empty input)."""
    if not mine:
        return _empty_output(vision_model, pixel_values, dim)
    offsets = [0]
    for t, h, w in grids:
        offsets.append(offsets[-1] + t * h * w)
    local_pixels = torch.cat([pixel_values[offsets[i] : offsets[i + 1]] for i in mine])
    local_grid = torch.tensor([grids[i] for i in mine], dtype=torch.long)
    return vision_model(local_pixels, local_grid)


def _check_local_output(local: torch.Tensor, rows: int, dim: int) -> None:
    # A wrong shape here would make the all-gather sizes disagree across ranks; fail loudly first.
    if tuple(local.shape) != (rows, dim):
        raise RuntimeError(f"vision model returned {tuple(local.shape)}, expected {(rows, dim)}")


def _gather_padded(local: torch.Tensor, max_rows: int, tp: TPGroup) -> torch.Tensor:
    """All-gather [max_rows, D] from every rank (Gloo needs equal sizes); returns [size*max, D]."""
    padded = local.new_zeros(max_rows, local.shape[1])
    padded[: local.shape[0]] = local
    return tp.all_gather(padded, dim=0)


def _restore_order(gathered: torch.Tensor, plan: DPEncoderPlan) -> torch.Tensor:
    """Strip each rank's padding, then put the items back in their original order."""
    blocks = gathered.reshape(plan.num_ranks, plan.max_rows, -1)
    compact = torch.cat([blocks[r, :n] for r, n in enumerate(plan.rank_rows)])
    parts = compact.split([plan.item_rows[i] for i in plan.shuffle_indices])
    position = inverse_permutation(plan.shuffle_indices)  # item i sits at parts[position[i]]
    return torch.cat([parts[position[i]] for i in range(len(position))])


def frame_units(grids: Sequence[Sequence[int]]) -> list[list[int]]:
    """The call's items cut into temporal patches: a (t, h, w) item becomes t units (1, h, w).

    Every tower attends within one temporal patch only (per-frame `cu_seqlens`; windows and
    position embeddings repeat per frame), and an item's pixel rows and output rows run frame
    after frame, so the units' outputs, concatenated, are the items' outputs. Planned over
    units, a long video spreads over the ranks DP-style instead of leaving every rank but one
    idle (DP) or paying TP's per-layer all-reduces on every patch."""
    return [[1, int(h), int(w)] for t, h, w in grids for _ in range(int(t))]


def run_dp_over_frames(
    tower: nn.Module, pixels: torch.Tensor, grids: list[list[int]], tp: TPGroup, merge: int
) -> torch.Tensor:
    """DP mode as the server runs it: the items (`grids`, their (t, h, w)) balanced as their
    frame units (`frame_units`: a tile or a video frame each), so one many-tile image or one
    long video spreads over the ranks; the output rows are the items' own, in order."""
    units = frame_units(grids)
    return run_dp_sharded_mrope_vision_model(tower, pixels, units, tp, spatial_merge_size=merge)
