"""Data-parallel vision encoder: every rank holds the whole ViT and encodes a balanced share.

The batch's items are assigned greedily by patch count (largest first, each to the least-loaded
rank, ties to the lowest rank). Each rank encodes its own items, pads its output to the largest
rank's row count, and one all-gather brings every rank every embedding; padding is stripped and
the original item order restored. A rank with no items still joins the all-gather. Because the
tower attends within each item only, the result equals encoding the whole batch on one rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from runtime.distributed import TPGroup


def get_dp_encoder_lb_assignment(
    sizes: Sequence[int], num_gpus: int
) -> tuple[list[int], list[int], list[int]]:
    """Return (shuffle_indices, gpu_sample_counts, gpu_loads).

    shuffle_indices lists item indices grouped by rank (rank 0's first), each group in the order
    its items were assigned; gpu_sample_counts[r] and gpu_loads[r] are rank r's item count and
    total size.
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


def run_dp_sharded_mrope_vision_model(
    vision_model: nn.Module,
    pixel_values: torch.Tensor,
    grid_thw_list: Sequence[Sequence[int]],
    tp: TPGroup,
    *,
    spatial_merge_size: int = 2,
) -> torch.Tensor:
    """Encode all items with the work spread over `tp`; returns [sum merged rows, out dim]."""
    grids = [[int(x) for x in g] for g in grid_thw_list]
    if tp.size == 1:
        return vision_model(pixel_values, torch.tensor(grids, dtype=torch.long))
    if not grids:
        return pixel_values.new_empty(0, vision_model.out_hidden_size)
    patches = [t * h * w for t, h, w in grids]
    rows = [n // spatial_merge_size**2 for n in patches]
    shuffle, counts, _ = get_dp_encoder_lb_assignment(patches, tp.size)
    first = sum(counts[: tp.rank])
    mine = shuffle[first : first + counts[tp.rank]]
    offsets = [0, *torch.tensor(patches).cumsum(0).tolist()]
    local = _encode_local(vision_model, pixel_values, grids, mine, offsets)
    rank_rows = _rows_per_rank(shuffle, counts, rows)
    gathered = _gather_padded(local, max(rank_rows), tp)
    return _restore_order(gathered, rank_rows, shuffle, counts, rows)


def _encode_local(
    vision_model: nn.Module,
    pixel_values: torch.Tensor,
    grids: list[list[int]],
    mine: list[int],
    offsets: list[int],
) -> torch.Tensor:
    if not mine:
        dtype = pixel_values.dtype
        return torch.empty(0, vision_model.out_hidden_size, dtype=dtype, device=pixel_values.device)
    local_pixels = torch.cat([pixel_values[offsets[i] : offsets[i + 1]] for i in mine])
    local_grid = torch.tensor([grids[i] for i in mine], dtype=torch.long)
    return vision_model(local_pixels, local_grid)


def _rows_per_rank(shuffle: list[int], counts: list[int], rows: list[int]) -> list[int]:
    out, start = [], 0
    for n in counts:
        out.append(sum(rows[i] for i in shuffle[start : start + n]))
        start += n
    return out


def _gather_padded(local: torch.Tensor, max_rows: int, tp: TPGroup) -> torch.Tensor:
    """All-gather [max_rows, D] from every rank (Gloo needs equal sizes); returns [size*max, D]."""
    padded = local.new_zeros(max_rows, local.shape[1])
    padded[: local.shape[0]] = local
    return tp.all_gather(padded, dim=0)


def _restore_order(
    gathered: torch.Tensor,
    rank_rows: list[int],
    shuffle: list[int],
    counts: list[int],
    rows: list[int],
) -> torch.Tensor:
    """Strip each rank's padding and put the items back in their original order."""
    max_rows = max(rank_rows)
    per_item: dict[int, torch.Tensor] = {}
    start = 0
    for rank, n in enumerate(counts):
        block = gathered[rank * max_rows : rank * max_rows + rank_rows[rank]]
        items = shuffle[start : start + n]
        for i, part in zip(items, block.split([rows[i] for i in items])):
            per_item[i] = part
        start += n
    return torch.cat([per_item[i] for i in range(len(rows))])
