"""FlashInfer attention over tessera's token-indexed KV pool, seen as pages of one token.

A KV slot is a page: the pool's per-layer buffers [slots + 1, kv_heads, head_dim] are, viewed as
[pages, 1, kv_heads, head_dim], FlashInfer's "NHD" paged layout with page size 1. A request's
pages are its request-table row, so the metadata is (`paged_metadata`, pure, tested on CPU):

- qo_indptr [requests + 1]: where each request's new tokens start in q (prefix sums);
- kv_indptr [requests + 1]: where each request's pages start in kv_indices (prefix sums of the
  sequence lengths);
- kv_indices [sum of sequence lengths]: req_to_token[row, :seq_len] of each request, in order;
- kv_last_page_len [requests]: all ones (every page holds its one token).

An extend (a mixed step's decode tail included, as one-token extends) runs
BatchPrefillWithPagedKVCacheWrapper with a causal mask, which FlashInfer aligns to the end of
each request's KV (the new tokens are its last ones); a decode runs
BatchDecodeWithPagedKVCacheWrapper. A layer's sliding window W is FlashInfer's `window_left`
(W - 1: the keys at most W - 1 positions before a query; -1 for a global layer), which is part
of the plan: each window value a model's layers use gets a wrapper of its own, planned once per
forward on the first layer with that window and run by every such layer (a model that
interleaves local and global layers plans twice per forward).

An extend with bidirectional item spans (`AttentionBatch.item_spans`) does not fit FlashInfer's
causal or windowed masks; it runs through the Triton extend kernel (kernels/triton/attention.py),
which reads the same pool and honours both the spans and the window. Only such extends do:
decodes and plain extends stay on FlashInfer.

flashinfer is imported here only, when the backend is built: it needs CUDA, and a CPU machine
never imports it (`--attention-backend flashinfer` is refused there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.attention.base import AttentionLayer, store_kv
from kernels.attention.batch_view import AttentionBatch
from kernels.availability import flashinfer_problem

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partial results)


@dataclass(frozen=True)
class PagedMetadata:
    """FlashInfer's page table of one forward (see the module docstring). The indptrs and page
    lengths stay on the host, where `plan` reads them; the indices are on the table's device."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def prefix_sums(lengths: list[int]) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as a host int32 tensor."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out


def paged_metadata(
    req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], q_lens: list[int]
) -> PagedMetadata:
    """The page table of requests at request-table `rows` with `seq_lens` tokens in KV (their
    new ones included) and `q_lens` new tokens each. Host lists in, no device value read: the
    indices are gathered on the table's device in one indexing op."""
    kv_indptr = prefix_sums(seq_lens)
    total = int(kv_indptr[-1])
    device = req_to_token.device
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    row_of = torch.tensor(rows, dtype=torch.int64).repeat_interleave(lens, output_size=total)
    starts = kv_indptr[:-1].long().repeat_interleave(lens, output_size=total)
    col_of = torch.arange(total) - starts
    indices = req_to_token[row_of.to(device), col_of.to(device)]
    return PagedMetadata(
        qo_indptr=prefix_sums(q_lens),
        kv_indptr=kv_indptr,
        kv_indices=indices.to(torch.int32),
        kv_last_page_len=torch.ones(len(rows), dtype=torch.int32),
    )


def batch_metadata(batch: AttentionBatch) -> PagedMetadata:
    return paged_metadata(
        batch.req_to_token, batch.req_pool_indices_list, batch.seq_lens_list,
        batch.extend_lens_list,
    )


def window_left(layer: AttentionLayer) -> int:
    """FlashInfer's window_left for the layer: W - 1 for a sliding window of W, -1 for none."""
    if layer.sliding_window is None:
        return -1
    if layer.sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {layer.sliding_window}")
    return layer.sliding_window - 1


def plan_arguments(
    meta: PagedMetadata,
    layer: AttentionLayer,
    decode: bool,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The positional and keyword arguments of the decode or prefill wrapper's `plan` for a
    batch's page table and one layer's shapes and window."""
    dims = (layer.num_heads, layer.num_kv_heads, layer.head_dim, 1)  # page size 1
    kwargs: dict[str, object] = dict(
        q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=layer.scaling,
        window_left=window_left(layer),
    )
    pages = (meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
    if decode:
        return (*pages, *dims), kwargs
    return (meta.qo_indptr, *pages, *dims), {**kwargs, "causal": True}


def as_pages(buffer: torch.Tensor) -> torch.Tensor:
    """A pool buffer [slots + 1, kv_heads, head_dim] as NHD pages of one token (a view)."""
    return buffer.unsqueeze(1)


# builds a (decode if True else prefill) FlashInfer wrapper
WrapperFactory = Callable[[bool], Any]


class FlashInferAttentionBackend:
    """The AttentionBackend protocol on FlashInfer's paged prefill and decode wrappers (one of
    each per window value), with extends that carry item spans on `span_backend`."""

    def __init__(self, device: str = "cuda") -> None:
        problem = flashinfer_problem("cuda" if torch.cuda.is_available() else "cpu")
        if problem:
            raise RuntimeError(problem)
        import flashinfer  # only here: a CUDA machine with the package

        from kernels.triton.attention import TritonAttentionBackend

        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

        def make_wrapper(decode: bool) -> Any:  # the wrappers share one float workspace
            if decode:
                return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

        self._setup(make_wrapper, TritonAttentionBackend())

    @classmethod
    def over(cls, make_wrapper: WrapperFactory, span_backend: Any) -> FlashInferAttentionBackend:
        """The backend over other wrappers and span backend (CPU tests pass recording ones)."""
        backend = cls.__new__(cls)
        backend._setup(make_wrapper, span_backend)
        return backend

    def _setup(self, make_wrapper: WrapperFactory, span_backend: Any) -> None:
        self._make_wrapper = make_wrapper
        self._span_backend = span_backend
        self._wrappers: dict[tuple[bool, int], Any] = {}  # (decode, window_left) -> wrapper
        self._planned: dict[tuple[bool, int], AttentionBatch] = {}
        self._meta: tuple[AttentionBatch, PagedMetadata] | None = None  # the last batch's

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: AttentionBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if batch.item_spans is not None:
            if batch.is_decode:
                raise ValueError("a decode batch has no item spans")
            return self._span_backend.forward(q, k, v, layer, batch, kv_stored)
        k_buf, v_buf = store_kv(k, v, layer, batch, kv_stored)
        wrapper = self._plan(batch, layer, q.dtype, k_buf.dtype)
        pages = (as_pages(k_buf), as_pages(v_buf))
        out = wrapper.run(q.view(-1, layer.num_heads, layer.head_dim), pages)
        return out.reshape(-1, layer.num_heads * layer.head_dim)

    def _plan(
        self,
        batch: AttentionBatch,
        layer: AttentionLayer,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
    ) -> Any:
        """The wrapper for this batch and the layer's window, planned on the first layer with
        that window (every layer shares the shapes on a rank)."""
        key = (batch.is_decode, window_left(layer))
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            wrapper = self._wrappers[key] = self._make_wrapper(batch.is_decode)
        if self._planned.get(key) is batch:
            return wrapper
        if batch.decode_tables is not None:
            raise ValueError("the FlashInfer backend plans on the host: no static decode batches")
        if self._meta is None or self._meta[0] is not batch:
            self._meta = (batch, batch_metadata(batch))
        args, kwargs = plan_arguments(self._meta[1], layer, batch.is_decode, q_dtype, kv_dtype)
        wrapper.plan(*args, **kwargs)
        self._planned[key] = batch
        return wrapper
