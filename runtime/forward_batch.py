"""ForwardBatch: everything one model forward needs, built by the scheduler (or a test)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from runtime.memory_pool import KVPool, ReqToTokenPool
from runtime.multimodal import MultimodalInputs


@dataclass(frozen=True)
class DecodeTables:
    """A decode step's per-request metadata as device tensors of a fixed shape, for a step that
    must not read the host (a replayed CUDA graph: runtime/decode_graphs.py). When a batch
    carries them, backends read these and not the batch's host lists.

    req_pool_indices / seq_lens: [batch] int64 (a padded row: the padding row, length 1);
    width: how many request-table columns every gather covers (fixed for the graph)."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    width: int


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of a chunk of new tokens over a (possibly empty) cached prefix
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    """Tokens of all requests, concatenated in request order.

    positions: [3, tokens] positions: MRoPE rows (temporal, height, width), or three equal rows
    for a family whose position kind is plain 1-D (runtime/families/ `PositionKind`).
    out_cache_loc: the KV slot of every new token.
    prefix_lens / extend_lens / seq_lens are per request; seq_len = prefix_len + extend_len.
    mm_inputs[i] is request i's multimodal inputs (None for text-only requests).
    decode_tables: set for a static decode (see DecodeTables); its host lists are then only
    placeholders of the right length.
    item_spans: each extend token's bidirectional media item, [start, end) in its sequence
    (kernels/attention/batch_view.py `AttentionBatch.item_spans`), or None when there is none.
    A mixed step is an EXTEND whose last `decode_tail` requests are decodes riding along: one
    new token each over their cached tokens (an extend of length 1 with a prefix), which a
    backend may batch as it batches a decode.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices_list: list[int]
    prefix_lens_list: list[int]
    extend_lens_list: list[int]
    req_pool: ReqToTokenPool
    kv_pool: KVPool
    mm_inputs: list[MultimodalInputs | None] = field(default_factory=list)
    decode_tail: int = 0
    decode_tables: DecodeTables | None = None
    item_spans: torch.Tensor | None = None

    @property
    def extend_count(self) -> int:
        """Requests before the decode tail (all of them outside a mixed step)."""
        return self.batch_size - self.decode_tail

    @property
    def is_decode(self) -> bool:
        return self.mode == ForwardMode.DECODE

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices_list)

    @property
    def seq_lens_list(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_list, self.extend_lens_list)]

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_pool.req_to_token

    @property
    def last_token_indices(self) -> torch.Tensor:
        ends = torch.tensor(self.extend_lens_list, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)


def _pack(parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The parts, flattened in order and as int64, written into `out` (returned)."""
    return torch.cat([p.reshape(-1).to(torch.int64) for p in parts], out=out)


class HostStager:
    """A step's host-built integer inputs reach the device in one copy.

    `stage` packs the parts (any shapes, integer dtypes, on the host) into one int64 buffer,
    copies it once with `non_blocking` and returns device views in the parts' shapes. On CUDA
    the buffer is page-locked (so the copy is truly asynchronous) and reused: before it is
    written again, the event recorded after its last copy is waited on. Elsewhere the views are
    of a fresh host buffer (no copy at all on CPU). The one place host bookkeeping meets the
    device in a step (invariant 19)."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._pinned: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def stage(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [p.numel() for p in parts]
        host = _pack(parts, self._host_buffer(sum(sizes)))
        staged = host.to(self.device, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return [v.view(p.shape) for v, p in zip(staged.split(sizes), parts)]

    def stage_into(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        """Pack the parts, flattened in order, into the front of `out` (int64, on this
        stager's device) with one copy: the inputs of a replayed graph that reads `out`."""
        n = sum(p.numel() for p in parts)
        if self.device.type == "cpu":
            _pack(parts, out[:n])
            return
        out[:n].copy_(_pack(parts, self._host_buffer(n)), non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _host_buffer(self, n: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.empty(n, dtype=torch.int64)
        if self._pinned is None or self._pinned.numel() < n:
            size = max(n, 2 * (0 if self._pinned is None else self._pinned.numel()), 4096)
            self._pinned = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._copied = torch.cuda.Event()
        elif self._copied is not None:
            self._copied.synchronize()  # the previous step's copy out of this buffer is done
        return self._pinned[:n]
