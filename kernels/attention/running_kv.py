"""Decode attention over K/V kept in one block per layer between steps (the torch backend on CPU).

A decode step over the token-indexed pool gathers every running request's K/V from scattered
slots, in every layer, into a padded block, then attends over it. In a steady batch (the same
requests decoding again, each one token longer) only one column of that block changed since the
last step. `RunningKV` keeps each layer's block between steps, laid out for two batched matmuls:
K transposed, [requests * kv_heads, head_dim, capacity], V as [requests * kv_heads, capacity,
head_dim], and one additive mask row per request (0 where a key is the request's, -inf after
its length). A step whose requests are those of the last complete step, in the same order, each
exactly one token longer, writes the new token's column and its mask entry and reads no pool
slot. Any other step (a request joined, left, was retracted or refilled; an extend or a mixed
step ran; the block is full; the last step stopped half way) rebuilds the blocks from the pool
once. Blocks past `max_bytes` are not kept: those steps take the gathering path. A local layer
(`AttentionLayer.sliding_window`) adds a mask over the keys before its window.

The pool stays the only source of truth: a rebuild reads it, an append writes the same K/V the
pool got this step. Padding columns hold finite values (zeros or another key of the request), so
the -inf mask alone keeps them out of the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention.base import AttentionLayer
from kernels.attention.batch_view import AttentionBatch

DEFAULT_MAX_BYTES = 256 << 20  # the kept blocks of all layers together
CAPACITY_STEP = 256  # columns are allocated in multiples of this


@dataclass
class _Blocks:
    """The kept state: whose keys, how many each, and the per-layer blocks."""

    rows: tuple[int, ...]  # request-table rows, in batch order
    lens: list[int]  # keys held per request
    k_t: list[torch.Tensor]  # per layer [requests * kv_heads, head_dim, capacity], float32
    v: list[torch.Tensor]  # per layer [requests * kv_heads, capacity, head_dim], float32
    mask: torch.Tensor  # [requests, capacity]: 0 for a held key, -inf after
    layers_done: int  # layers that have taken the current step

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]


class RunningKV:
    """Per-layer decode blocks kept between steps; see the module docstring."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._blocks: _Blocks | None = None
        self._batch: AttentionBatch | None = None
        self._rebuild = True
        self._mask_view: torch.Tensor | None = None  # this step's mask, [rows*kv_heads, 1, width]
        self._new_keys: tuple[torch.Tensor, torch.Tensor] | None = None  # (request, column)
        self._slots: torch.Tensor | None = None  # a rebuild's pool slots, [requests, width]

    def reset(self) -> None:
        """Forget the blocks (an extend ran: the next decode rebuilds)."""
        self._blocks, self._batch, self._mask_view = None, None, None

    def covers(self, batch: AttentionBatch, layer: AttentionLayer) -> bool:
        """Whether this decode step can use kept blocks: a host pool (CPU), host lists (no
        static decode tables), and blocks within the byte budget."""
        if batch.decode_tables is not None or batch.kv_pool.device.type != "cpu":
            return False
        kv = batch.kv_pool
        width = _round_up(max(batch.seq_lens_list) + 1)  # as _blocks_for sizes them
        columns = batch.batch_size * layer.num_kv_heads * layer.head_dim * width
        return 2 * 4 * columns * len(kv.k_buffers) <= self.max_bytes

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """q: [requests, heads, head_dim]; k, v: this step's new rows, [requests, kv_heads *
        head_dim], already stored in the pool. Returns [requests, heads, head_dim]."""
        if self._batch is not batch:
            self._start(batch, layer)
        blocks = self._blocks
        assert blocks is not None
        if self._rebuild:
            self._gather_layer(blocks, layer, batch)
        else:
            self._append_layer(blocks, layer, k, v)
        blocks.layers_done += 1
        return self._attend(blocks, q, layer)

    def _start(self, batch: AttentionBatch, layer: AttentionLayer) -> None:
        """First layer of a step: append to the kept blocks, or rebuild them."""
        rows, lens = tuple(batch.req_pool_indices_list), batch.seq_lens_list
        old = self._blocks
        layers = len(batch.kv_pool.k_buffers)
        steady = (
            old is not None
            and old.rows == rows
            and old.layers_done == layers
            and max(lens) <= old.capacity
            and all(n == held + 1 for n, held in zip(lens, old.lens))
        )
        self._new_keys = (torch.arange(len(rows)), torch.tensor(lens, dtype=torch.long) - 1)
        if steady:
            assert old is not None
            old.mask[self._new_keys] = 0.0
            old.lens, old.layers_done = lens, 0
        else:
            self._blocks = _blocks_for(old, rows, lens, layer, layers)
            self._slots = _held_slots(batch, rows, lens)
        self._rebuild = not steady
        self._batch = batch
        self._mask_view = _mask_view(self._blocks, layer.num_kv_heads, max(lens))

    def _gather_layer(self, blocks: _Blocks, layer: AttentionLayer, batch: AttentionBatch) -> None:
        """Copy this layer's keys of every request from the pool into the blocks."""
        assert self._slots is not None
        width = self._slots.shape[1]
        k, v = batch.kv_pool.get_kv(layer.layer_id, self._slots)  # [requests, width, heads, dim]
        n, d = len(blocks.rows) * layer.num_kv_heads, layer.head_dim
        blocks.k_t[layer.layer_id][:, :, :width] = k.permute(0, 2, 3, 1).reshape(n, d, width)
        blocks.v[layer.layer_id][:, :width] = v.permute(0, 2, 1, 3).reshape(n, width, d)

    def _append_layer(
        self, blocks: _Blocks, layer: AttentionLayer, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write the step's one new key per request at its column."""
        requests, heads, d = len(blocks.rows), layer.num_kv_heads, layer.head_dim
        assert self._new_keys is not None
        each, at = self._new_keys
        k_t = blocks.k_t[layer.layer_id].view(requests, heads, d, -1)
        v_all = blocks.v[layer.layer_id].view(requests, heads, -1, d)
        k_t[each, :, :, at] = k.reshape(requests, heads, d).float()
        v_all[each, :, at] = v.reshape(requests, heads, d).float()

    def _attend(self, blocks: _Blocks, q: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """Scores as one batched matmul per kv head group, softmax, then one over V."""
        requests, heads, d = q.shape
        groups = heads // layer.num_kv_heads
        width = max(blocks.lens)
        q_g = q.reshape(requests * layer.num_kv_heads, groups, d).float()
        k_t = blocks.k_t[layer.layer_id][:, :, :width]
        mask = self._mask_view
        if layer.sliding_window is not None:  # a local layer: only the last keys of each
            mask = mask + _window_mask(blocks.lens, layer.sliding_window, layer.num_kv_heads)
        scores = torch.baddbmm(mask, q_g, k_t, alpha=layer.scaling)
        out = torch.bmm(torch.softmax(scores, dim=-1), blocks.v[layer.layer_id][:, :width])
        return out.view(requests, heads, d).to(q.dtype)


def _round_up(n: int) -> int:
    return -(-n // CAPACITY_STEP) * CAPACITY_STEP


def _blocks_for(
    old: _Blocks | None,
    rows: tuple[int, ...],
    lens: list[int],
    layer: AttentionLayer,
    layers: int,
) -> _Blocks:
    """Blocks to rebuild into, sized for `lens` plus room to grow, and their mask: the old
    tensors when they have the right shape and room (their stale values are finite keys), else
    zeroed ones (finite padding)."""
    n, d = len(rows) * layer.num_kv_heads, layer.head_dim
    fits = old is not None and old.k_t[0].shape[0] == n and max(lens) < old.capacity
    if old is not None and fits:
        k_t, v, capacity = old.k_t, old.v, old.capacity
    else:
        capacity = _round_up(max(lens) + 1)
        k_t = [torch.zeros(n, d, capacity) for _ in range(layers)]
        v = [torch.zeros(n, capacity, d) for _ in range(layers)]
    mask = torch.full((len(rows), capacity), float("-inf"))
    mask[torch.arange(capacity)[None, :] < torch.tensor(lens)[:, None]] = 0.0
    return _Blocks(rows=rows, lens=lens, k_t=k_t, v=v, mask=mask, layers_done=0)


def _held_slots(batch: AttentionBatch, rows: tuple[int, ...], lens: list[int]) -> torch.Tensor:
    """The pool slots of every request's keys, [requests, longest]; padding reads the request's
    first key (finite, masked)."""
    width = max(lens)
    table = batch.req_to_token[list(rows), :width]
    held = torch.arange(width)[None, :] < torch.tensor(lens)[:, None]
    return torch.where(held, table, table[:, :1].expand(-1, width))


def _window_mask(lens: list[int], window: int, kv_heads: int) -> torch.Tensor:
    """[requests * kv_heads, 1, longest]: -inf on the keys a decode query of a local layer no
    longer sees (more than `window` - 1 positions before it), else 0."""
    held = torch.tensor(lens)[:, None]
    hidden = torch.arange(max(lens))[None, :] < held - window
    mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
    return mask[:, None, :].expand(-1, kv_heads, -1).reshape(-1, 1, hidden.shape[1])


def _mask_view(blocks: _Blocks, kv_heads: int, width: int) -> torch.Tensor:
    """The mask's first `width` columns, one row per (request, kv head), broadcast over the
    query heads of the group: [requests * kv_heads, 1, width]."""
    rows = blocks.mask[:, None, :width].expand(-1, kv_heads, -1)
    return rows.reshape(-1, 1, width)
