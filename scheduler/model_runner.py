"""The TP worker: owns this rank's model shard and KV pools, turns sequences into ForwardBatches.

Every rank builds the same batches from the same decisions, so each rank's collectives line up.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from runtime.decode_graphs import DecodeGraphRunner
from runtime.forward_batch import ForwardBatch, ForwardMode, HostStager
from runtime.memory_pool import ReqToTokenPool
from runtime.multimodal import ItemEncoder
from scheduler.req import Req

# A step's new prompt tokens with less work than this (multiply-adds: weights times tokens, plus
# attention over the KV) take about a millisecond of one core: on a CPU the step runs on one
# thread, as a decode step does. Splitting it gains less than the fork and join cost, and the
# cores it leaves free serve the media workers, the detokenizer and the HTTP server
# (docs/benchmarks.md: +5 to 8% requests/s for a small model on 2 cores).
SMALL_STEP_MACS = 1 << 24
# A CPU decode step (with under SMALL_STEP_MACS of prompt tokens riding along) under this many
# multiply-adds runs on one intra-op thread, as vLLM's CPU worker does: with the server's own
# front end, detokenizer and clients on the same cores, a second OpenMP thread waits at every
# barrier for a core that is busy (docs/benchmarks.md, "Decode step: one thread and compiled
# small ops": one thread cost less CPU and less wall time at 0.2 and 1.3 G multiply-adds a
# step). A 7B model's single decode token (7 G) is above it and keeps every thread.
DECODE_ONE_THREAD_MACS = 1 << 32


def step_threads(threads: int, prompt_macs: int, macs: int, decode_threads: int = 0) -> int:
    """Intra-op threads of one CPU step of `macs` multiply-adds, `prompt_macs` of them for new
    prompt tokens (the rest: decode tokens), in a rank of `threads` threads. A step whose prompt
    part is small is a decode step: `decode_threads` of them when set (capped at `threads`), else
    one under DECODE_ONE_THREAD_MACS. A larger prompt part (a prefill) keeps every thread."""
    if prompt_macs >= SMALL_STEP_MACS:
        return threads
    if decode_threads:
        return min(decode_threads, threads)
    return 1 if macs < DECODE_ONE_THREAD_MACS else threads


class OutOfKVError(RuntimeError):
    """Not enough free KV slots for the requested forward."""


class ModelRunner:
    graphs: DecodeGraphRunner | None = None  # static decodes (see __init__); None: never
    decode_threads: int = 0  # a CPU decode step's threads (see __init__); 0: step_threads' rule

    def __init__(
        self,
        model: nn.Module,
        *,
        max_total_tokens: int,
        max_running_requests: int,
        max_context_len: int,
        device: str = "cpu",
        item_encoder: ItemEncoder | None = None,
        cuda_graph_max_bs: int = 0,
        decode_threads: int = 0,
    ):
        """`item_encoder` encodes the media a prefill needs (default: the model's own
        `encode_items`; the scheduler gives its encoder cache in front of it).
        `cuda_graph_max_bs`: decodes of up to this many requests run over static buffers
        (runtime/decode_graphs.py), as CUDA graphs on CUDA, eagerly elsewhere; 0: never.
        `decode_threads`: intra-op threads of a CPU decode step (0: by `step_threads`' rule)."""
        self.model = model
        self.device = device
        self.decode_threads = decode_threads
        self.item_encoder = item_encoder or model.encode_items
        self.req_pool = ReqToTokenPool(max_running_requests, max_context_len, device)
        layout = model.language_model.kv_layout
        self.kv_pool = layout.pool(max_total_tokens, device)
        # per decoded token: about one per local weight; per token of context: q.k and p.v
        # for this rank's heads in every layer
        self.macs_per_token = sum(p.numel() for p in model.language_model.parameters())
        heads = model.language_model.model.layers[0].self_attn.layer.num_heads
        self.macs_per_context = 2 * layout.num_layers * heads * layout.head_dim
        # the family's media tokens see their whole item (AttentionBatch.item_spans)
        config = getattr(model, "config", None)
        family = getattr(config, "family", None)
        self.bidirectional_items = getattr(family, "image_attention", "") == "bidirectional_item"
        if cuda_graph_max_bs:
            self.graphs = DecodeGraphRunner(
                model, self.req_pool, self.kv_pool, cuda_graph_max_bs, device.startswith("cuda")
            )

    @functools.cached_property
    def stager(self) -> HostStager:
        """Stages each step's inputs in one copy to this runner's device."""
        return HostStager(self.device)

    def admit(self, seq: Req) -> None:
        index = self.req_pool.alloc()
        if index is None:
            raise OutOfKVError("no free request slot")
        seq.req_pool_index = index

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.kv_pool.alloc(n)
        if slots is None:
            raise OutOfKVError(f"need {n} KV slots, {self.kv_pool.available_size} free")
        return slots

    def decode(self, seqs: list[Req]) -> torch.Tensor:
        """One step: each sequence's last token (not yet in KV) goes through the model."""
        lens = [1] * len(seqs)
        with self._threads_for(seqs, lens, len(seqs)):
            return self._run(ForwardMode.DECODE, seqs, lens)

    def decode_after(
        self, seqs: list[Req], rows: list[int] | None, tokens: torch.Tensor | None
    ) -> torch.Tensor:
        """One decode step over the static buffers whose input ids may still be on the device:
        with `rows`, sequence i's input is `tokens[rows[i]]` (the sampled token of a step not
        read yet, at index kv_len); without, its last token from the host, as in `decode`."""
        assert self.graphs is not None
        n = len(seqs)
        with self._threads_for(seqs, [1] * n, n):
            slots = self._alloc(n)
            if rows is None:
                ids = torch.tensor([seq.token_ids[seq.kv_len] for seq in seqs], dtype=torch.long)
            else:
                ids = torch.tensor(rows, dtype=torch.long)
            positions, table_rows, cols = decode_places(seqs)
            host = (ids, positions, slots, table_rows, cols)
            logits = self.graphs.decode(self.stager, host, tokens)
        for seq in seqs:
            seq.kv_len += 1
        return logits

    @contextlib.contextmanager
    def _threads_for(self, seqs: list[Req], lens: list[int], tail: int) -> Iterator[None]:
        """A CPU step's intra-op threads by `step_threads`' rule (the last `tail` of `seqs`
        decode one token each); the rank's own count again afterwards."""
        threads = torch.get_num_threads()
        if self.device != "cpu" or threads == 1:
            yield
            return
        head = len(seqs) - tail
        prompt = self._step_macs(seqs[:head], lens[:head])
        macs = prompt + self._step_macs(seqs[head:], lens[head:])
        torch.set_num_threads(step_threads(threads, prompt, macs, self.decode_threads))
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _step_macs(self, seqs: list[Req], lens: list[int]) -> int:
        """Multiply-adds of `seqs`' new tokens: weights per new token, plus each new token's
        attention over its request's keys (what the KV holds, and the step's own)."""
        context = sum(n * (seq.kv_len + n) for seq, n in zip(seqs, lens))
        return sum(lens) * self.macs_per_token + context * self.macs_per_context

    def mixed(
        self, seqs: list[Req], extend_lens: list[int], decodes: list[Req]
    ) -> torch.Tensor:
        """One forward for an extend of `seqs` (the next extend_lens[i] tokens of each over
        what its KV holds) plus one decode token of each of `decodes` (none: a plain extend);
        returns the last-token logits of seqs, then of decodes."""
        lens = [*extend_lens, *[1] * len(decodes)]
        with self._threads_for([*seqs, *decodes], lens, len(decodes)):
            return self._run(ForwardMode.EXTEND, [*seqs, *decodes], lens, len(decodes))

    def _run(
        self,
        mode: ForwardMode,
        seqs: list[Req],
        lens: list[int],
        decode_tail: int = 0,
    ) -> torch.Tensor:
        slots = self._alloc(sum(lens))
        tail = len(seqs) if mode is ForwardMode.DECODE else decode_tail
        ids, positions, rows, cols = step_inputs(seqs, lens, tail)
        if mode is ForwardMode.DECODE and self.graphs and self.graphs.fits(len(seqs)):
            logits = self.graphs.decode(self.stager, (ids, positions, slots, rows, cols))
        else:
            host = (ids, positions, slots, rows, cols)
            logits = self._forward(mode, seqs, lens, decode_tail, host)
        for seq, n in zip(seqs, lens):
            seq.kv_len += n
        return logits

    def _forward(
        self,
        mode: ForwardMode,
        seqs: list[Req],
        lens: list[int],
        decode_tail: int,
        host: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """The dynamic path: a ForwardBatch shaped to this step, its host lists included."""
        ids, positions, slots, rows, cols = host
        input_ids, device_positions, out_cache_loc, row_t, col_t = self.stager.stage(
            [ids, positions, slots, rows, cols]
        )  # one host-to-device copy for the step's inputs and its request-table entries
        self.req_pool.write_tokens(row_t, col_t, out_cache_loc)
        spans = None
        if self.bidirectional_items:
            head = len(seqs) - decode_tail
            spans = item_spans(seqs[:head], lens[:head])
        batch = ForwardBatch(
            mode=mode,
            input_ids=input_ids,
            positions=device_positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices_list=[s.req_pool_index for s in seqs],
            prefix_lens_list=[s.kv_len for s in seqs],
            extend_lens_list=list(lens),
            req_pool=self.req_pool,
            kv_pool=self.kv_pool,
            mm_inputs=[s.mm for s in seqs],
            decode_tail=decode_tail,
            item_spans=None if spans is None else spans.to(input_ids.device),
        )
        return self.model(batch, self.item_encoder)


def step_inputs(
    seqs: list[Req], lens: list[int], tail: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host tensors of one step: token ids, [3, tokens] positions, and the request-table row and
    column of every new token. The first requests extend by lens[i] tokens; the last `tail`
    decode one token each, past its prompt, at its index plus the request's MRoPE delta."""
    head = len(seqs) - tail
    ids, positions, rows, cols = [], [], [], []
    for seq, n in zip(seqs[:head], lens[:head]):
        start = seq.kv_len
        ids.extend(seq.token_ids[start : start + n])
        positions.append(seq.positions(start, start + n))
        rows.extend([seq.req_pool_index] * n)
        cols.extend(range(start, start + n))
    decoding = seqs[head:]
    ids.extend(seq.token_ids[seq.kv_len] for seq in decoding)
    tail_positions, tail_rows, tail_cols = decode_places(decoding)
    positions.append(tail_positions)
    as_long = [torch.tensor(x, dtype=torch.long) for x in (ids, rows, cols)]
    return (
        as_long[0],
        torch.cat(positions, dim=1),
        torch.cat((as_long[1], tail_rows)),
        torch.cat((as_long[2], tail_cols)),
    )


def item_spans(seqs: list[Req], lens: list[int]) -> torch.Tensor | None:
    """[tokens, 2] int32: for each new token of the extending `seqs` (the next lens[i] tokens
    of each), the [start, end) of the media item it lies in, (0, 0) outside any; None when no
    token lies in one. A chunk may start inside an item (the item's earlier tokens cached) but
    must not end inside one: its later tokens would be missing (RuntimeError)."""
    parts, found = [], False
    for seq, n in zip(seqs, lens):
        start, part = seq.kv_len, torch.zeros(n, 2, dtype=torch.int32)
        for item in seq.mm.items if seq.mm is not None else []:
            for lo, hi in item.offsets:
                if lo < start + n and hi > start:
                    if hi > start + n:
                        raise RuntimeError(f"a prefill chunk ends at {start + n}, inside the "
                                           f"bidirectional item [{lo}, {hi})")
                    part[max(lo, start) - start : hi - start] = torch.tensor([lo, hi])
                    found = True
        parts.append(part)
    return torch.cat(parts) if found else None


def decode_places(seqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each sequence's decode token goes: [3, n] positions (its index kv_len plus the
    request's MRoPE delta), and its request-table row and column."""
    indices = [seq.kv_len for seq in seqs]
    values = [i + seq.mrope_delta for seq, i in zip(seqs, indices)]
    positions = torch.tensor(values, dtype=torch.long).expand(3, -1)
    rows = torch.tensor([seq.req_pool_index for seq in seqs], dtype=torch.long)
    return positions, rows, torch.tensor(indices, dtype=torch.long)
