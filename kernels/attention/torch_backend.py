"""Reference attention in plain torch, in float32.

Extend (prefill) runs one request at a time, causal over its cached prefix and new tokens. Decode
(one new token per request) runs as one batched call: each request's K/V slots are gathered into
a [requests, longest, kv_heads, head_dim] block with a mask over the padding, built once per
forward and shared by all layers. A mixed step's decode tail takes the batched decode path too.
On a CPU pool a decode step instead attends over blocks kept between steps
(kernels/attention/running_kv.py): a steady batch writes one new key per request and gathers
nothing.

A local layer (`AttentionLayer.sliding_window` W) lets a query at position i see keys j with
i - j < W only; a token of a bidirectional item (`AttentionBatch.item_spans`) also sees every
key of its item, later ones included (the scheduler never splits an item across forwards, so
they are all in this step or cached). Decode tokens are never inside an item. The KV of a local
layer is kept whole; the window is a mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.base import AttentionLayer, store_kv
from kernels.attention.batch_view import AttentionBatch
from kernels.attention.running_kv import RunningKV


class TorchAttentionBackend:
    def __init__(self) -> None:
        self._decode_batch: AttentionBatch | None = None
        self._decode_index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._decode_lens = torch.zeros(0, dtype=torch.long)
        self.running = RunningKV()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: AttentionBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        store_kv(k, v, layer, batch, kv_stored)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        if batch.is_decode and self.running.covers(batch, layer):
            return self.running.attend(q, k, v, layer, batch).flatten(1)
        if batch.is_decode:  # a static decode, or blocks past their byte budget: gather
            self.running.reset()
            return self._decode(q, layer, batch).flatten(1)
        self.running.reset()  # the pool changes under an extend: the next decode rebuilds
        out = torch.empty_like(q)
        start = self._extend(q, out, layer, batch)
        if batch.decode_tail:
            out[start:] = self._decode(q[start:], layer, batch)
        return out.view(-1, layer.num_heads * layer.head_dim)

    def _extend(
        self, q: torch.Tensor, out: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch
    ) -> int:
        """Attend the extend requests (not a mixed step's decode tail) one at a time into out;
        returns the number of tokens they cover."""
        kv, start, spans = batch.kv_pool, 0, batch.item_spans
        lens = zip(batch.seq_lens_list, batch.extend_lens_list[: batch.extend_count])
        for i, (seq_len, ext_len) in enumerate(lens):
            slots = batch.req_to_token[batch.req_pool_indices_list[i], :seq_len]
            k_all, v_all = kv.get_kv(layer.layer_id, slots)
            items = None if spans is None else spans[start : start + ext_len]
            rows = slice(start, start + ext_len)
            out[rows] = _attend(q[rows], k_all, v_all, layer, items)
            start += ext_len
        return start

    def decode_index(self, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [requests, longest], valid [requests, 1, 1, longest]) of the decoding requests
        (all of a decode batch, the tail of a mixed one), once per forward.

        Padding positions point at the request's first slot, so every gathered value is finite
        and the mask alone keeps it out of the softmax."""
        if self._decode_index is None or self._decode_batch is not batch:
            rows, lens, width = _decode_rows(batch)
            slots = batch.req_to_token[rows, :width]
            valid = torch.arange(slots.shape[1], device=lens.device)[None, :] < lens[:, None]
            slots = torch.where(valid, slots, slots[:, :1])
            self._decode_index = (slots, valid[:, None, None, :])
            self._decode_lens = lens
            self._decode_batch = batch
        return self._decode_index

    def _decode(
        self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch
    ) -> torch.Tensor:
        slots, valid = self.decode_index(batch)
        if layer.sliding_window is not None:
            valid = valid & window_columns(self._decode_lens, slots.shape[1], layer)[:, None, None]
        k, v = batch.kv_pool.get_kv(layer.layer_id, slots)  # [requests, longest, kv_heads, dim]
        requests, heads, dim = q.shape
        kv_heads = k.shape[2]
        # The query heads that share a K/V head are that head's rows ([requests, kv_heads, group,
        # dim]): one product per K/V head, where `enable_gqa` repeated K and V for every query
        # head first (16 requests, 8 query and 2 K/V heads, 128 positions: 205 against 418 us
        # on one CPU thread; 512 positions: 0.84 against 3.0 ms).
        out = F.scaled_dot_product_attention(
            q.float().reshape(requests, kv_heads, heads // kv_heads, dim),
            k.transpose(1, 2).float(),
            v.transpose(1, 2).float(),
            attn_mask=valid,  # [requests, 1, 1, longest]: every row of a request alike
            scale=layer.scaling,
        )
        return out.reshape(requests, heads, dim).to(q.dtype)


def _decode_rows(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(request rows, lengths, columns to gather) of the decoding requests, on the device: from
    the batch's decode tables when it has them (a static decode), else from its host lists."""
    tables = batch.decode_tables
    if tables is not None:
        return tables.req_pool_indices, tables.seq_lens, tables.width
    first = 0 if batch.is_decode else batch.extend_count
    device = batch.req_to_token.device
    host_lens = batch.seq_lens_list[first:]  # the longest from the host: no device sync
    lens = torch.tensor(host_lens, device=device)
    rows = torch.tensor(batch.req_pool_indices_list[first:], device=device)
    return rows, lens, max(host_lens)


def window_columns(lens: torch.Tensor, width: int, layer: AttentionLayer) -> torch.Tensor:
    """[requests, width]: the key columns a decode query (at position len - 1) sees in a local
    layer, the last `sliding_window` of its request's keys."""
    assert layer.sliding_window is not None
    columns = torch.arange(width, device=lens.device)[None, :]
    return columns >= (lens - layer.sliding_window)[:, None]


def extend_mask(
    n: int, s: int, layer: AttentionLayer, items: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """[n, s] keys each of the last n of s positions sees: causal, within the layer's sliding
    window, or inside the query's item ([n, 2] absolute spans, (0, 0) outside any); None when
    that is plain causal attention without a cached prefix."""
    window = layer.sliding_window
    if n == s and items is None and (window is None or s <= window):
        return None
    q_pos = torch.arange(s - n, s, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    mask = q_pos >= k_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    if items is not None:
        start, end = items[:, :1].to(device), items[:, 1:].to(device)
        mask |= (k_pos >= start) & (k_pos < end)
    return mask


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayer,
    items: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [n, H, D] are the last n of the k/v rows [s, Hkv, D]; causal within the layer's
    sliding window, and bidirectional inside each query's item (`items`, [n, 2] spans).

    4-D inputs with grouped K/V heads (no repeated copies) keep SDPA on its fused kernels; with no
    cached prefix, window or item the causal mask is implicit, else a boolean mask says it."""
    n, s = q.shape[0], k.shape[0]
    q4, k4, v4 = (x.transpose(0, 1)[None].float() for x in (q, k, v))  # [1, heads, len, D]
    mask = extend_mask(n, s, layer, items, q.device)
    if mask is None:
        out = F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=layer.scaling, enable_gqa=True
        )
    else:
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, scale=layer.scaling, enable_gqa=True
        )
    return out[0].transpose(0, 1).to(q.dtype)
