"""Decode steps over static buffers, replayed as CUDA graphs on a GPU.

A decode step of `bs` requests is padded to the next captured size (1, 2, 4, 8, then every
multiple of 8 up to `--cuda-graph-max-bs`). Its inputs reach one buffer that never moves in one
host-to-device copy; the step's forward, the request-table writes of its new tokens included,
reads views of that buffer and a ForwardBatch whose per-request metadata are device tensors
(`DecodeTables`), so nothing in the forward reads the host. On CUDA each padded size is captured
once, on first use, and replayed after (one launch per step besides the copy); elsewhere the
same static path runs eagerly, which is how CPU tests prove it equal to the dynamic path.

Padded rows take token 0 at position 0, write their K/V to slot 0 (the KV pool's padding slot,
never handed out) and read through the request table's padding row (all slot 0) with length 1:
they touch no real KV slot, and each row's attention is its own, so they change no real output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.forward_batch import DecodeTables, ForwardBatch, ForwardMode, HostStager
from runtime.memory_pool import KVPool, ReqToTokenPool


def padded_batch_sizes(max_bs: int) -> tuple[int, ...]:
    """The captured batch sizes: 1, 2, 4, 8, then multiples of 8, and max_bs itself."""
    if max_bs < 1:
        raise ValueError("the largest captured batch size must be at least 1")
    sizes = {b for b in (1, 2, 4) if b <= max_bs} | set(range(8, max_bs + 1, 8)) | {max_bs}
    return tuple(sorted(sizes))


def padded_size(bs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `bs` rows, None when none does."""
    return next((s for s in sizes if s >= bs), None)


def pad_step(
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    size: int,
    padding_row: int,
) -> list[torch.Tensor]:
    """A decode step's host inputs padded to `size` rows: token ids, [3, size] positions, KV
    slots, request rows and sequence lengths (the new token's column plus one). Padded rows:
    token 0, position 0, slot 0, the padding row, length 1."""
    pad = size - ids.numel()
    out_positions = torch.zeros(3, size, dtype=torch.long)
    out_positions[:, : positions.shape[1]] = positions
    return [
        _padded(ids, pad, 0),
        out_positions,
        _padded(slots, pad, 0),
        _padded(rows, pad, padding_row),
        _padded(cols + 1, pad, 1),
    ]


def _padded(t: torch.Tensor, pad: int, value: int) -> torch.Tensor:
    return torch.cat((t.long(), torch.full((pad,), value, dtype=torch.long)))


@dataclass
class StaticDecodeBuffers:
    """The inputs of every captured size in one int64 device buffer that never moves. A step of
    padded size `size` fills its front in `pad_step`'s order: token ids [size], positions
    [3, size], KV slots [size], request rows [size], sequence lengths [size] (7 * size values),
    so one host-to-device copy loads a step, and the graph of that size reads its views."""

    flat: torch.Tensor  # [7 * max_bs]

    @staticmethod
    def allocate(max_bs: int, device: torch.device | str) -> StaticDecodeBuffers:
        return StaticDecodeBuffers(torch.zeros(7 * max_bs, dtype=torch.long, device=device))

    def views(self, size: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots, rows, lens) of a step of padded size `size`."""
        ids, positions, slots, rows, lens = self.flat[: 7 * size].split(
            [size, 3 * size, size, size, size]
        )
        return ids, positions.view(3, size), slots, rows, lens


class DecodeGraphRunner:
    """Runs decode steps of up to `max_bs` requests over static buffers: replayed CUDA graphs
    when `capture` (CUDA only), else the same static path eagerly."""

    def __init__(
        self,
        model: nn.Module,
        req_pool: ReqToTokenPool,
        kv_pool: KVPool,
        max_bs: int,
        capture: bool,
    ) -> None:
        self.model = model
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.sizes = padded_batch_sizes(max_bs)
        self.capture = capture
        self.buffers = StaticDecodeBuffers.allocate(self.sizes[-1], req_pool.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: object | None = None  # the graphs' shared memory pool

    def fits(self, bs: int) -> bool:
        return padded_size(bs, self.sizes) is not None

    def decode(
        self,
        stager: HostStager,
        host: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        gather: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [bs, vocab] of one decode step from its host inputs (ids, positions, slots,
        rows, cols as `step_inputs` and the KV allocator give them): one copy into the static
        buffer, then the padded forward (its request-table writes included) as one graph.

        With `gather` (a device tensor), the host ids are indices into it and each row's input
        id is `gather[id]`, taken on the device (scheduler/overlap.py); padded rows take
        `gather[0]`, which, like their usual token 0, changes no real row."""
        bs = host[0].numel()
        size = padded_size(bs, self.sizes)
        if size is None:
            raise ValueError(f"decode batch of {bs} is over the largest captured size")
        stager.stage_into(pad_step(*host, size, self.req_pool.padding_row), self.buffers.flat)
        if gather is not None:
            ids = self.buffers.flat[:size]
            ids.copy_(gather.index_select(0, ids))
        return self._forward(size)[:bs].clone()

    def static_forward(self, size: int) -> torch.Tensor:
        """One decode forward of the step in the buffers (what a graph of `size` records): the
        request-table entries of its new tokens (padded rows write the padding row's slot 0,
        which stays 0), then the model over a fresh batch of the buffers' views."""
        _, _, slots, rows, lens = self.buffers.views(size)
        self.req_pool.write_tokens(rows, lens - 1, slots)
        return self.model(self.static_batch(size))

    def static_batch(self, size: int) -> ForwardBatch:
        """A decode ForwardBatch over the buffers' views for `size` rows. Its host lists are
        placeholders: every value the forward uses comes from the device tensors."""
        ids, positions, slots, rows, lens = self.buffers.views(size)
        tables = DecodeTables(rows, lens, self.req_pool.max_context_len)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=ids,
            positions=positions,
            out_cache_loc=slots,
            req_pool_indices_list=[self.req_pool.padding_row] * size,
            prefix_lens_list=[0] * size,
            extend_lens_list=[1] * size,
            req_pool=self.req_pool,
            kv_pool=self.kv_pool,
            mm_inputs=[None] * size,
            decode_tables=tables,
        )

    def _forward(self, size: int) -> torch.Tensor:
        if not self.capture:
            return self.static_forward(size)
        entry = self._graphs.get(size)
        if entry is None:
            entry = self._graphs[size] = self._capture(size)
        graph, logits = entry
        graph.replay()
        return logits

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (kernel compiles, allocator), then capture one forward of
        the current buffers; the graphs of all sizes share one memory pool.

        Every forward gets a batch of its own: the attention backends build their per-forward
        metadata once per batch object and reuse it in later layers, so a captured forward
        given the warm-up's batch would not build it inside the graph, and every replay would
        read the lengths and rows of the step that was captured."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.static_forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.static_forward(size)
        self._pool = graph.pool()
        return graph, logits
