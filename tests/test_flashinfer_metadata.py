"""The FlashInfer backend's page table, built and checked on CPU; the backend itself on CUDA.

The page table is checked twice: against a per-request reading of the request table, and by
running attention the way FlashInfer reads it (each request's q rows from qo_indptr, its pages
from kv_indptr/kv_indices, causal aligned to the end of its KV) against the torch backend."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys

import pytest
import torch
from device_check import DeviceRules

from kernels.attention import AttentionLayer, create_attention_backend
from kernels.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    PagedMetadata,
    as_pages,
    batch_metadata,
    paged_metadata,
    plan_arguments,
    prefix_sums,
)
from kernels.attention.torch_backend import TorchAttentionBackend
from kernels.availability import flashinfer_problem
from kernels.ops import get_kernel_ops
from runtime.forward_batch import ForwardBatch, ForwardMode
from runtime.memory_pool import KVPool, ReqToTokenPool
from runtime.server_args import ServerArgs

LAYER = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=8**-0.5)


def reference_indices(table: torch.Tensor, rows: list[int], lens: list[int]) -> list[int]:
    return [int(s) for r, n in zip(rows, lens) for s in table[r, :n]]


def test_prefix_sums() -> None:
    assert prefix_sums([3, 0, 5]).tolist() == [0, 3, 3, 8]
    assert prefix_sums([]).tolist() == [0]
    assert prefix_sums([1]).dtype == torch.int32


def test_page_table_reads_each_request_row() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(1, 1000, (6, 20), generator=gen)
    rows, lens, q_lens = [4, 0, 2, 5], [7, 1, 20, 3], [7, 1, 4, 1]
    meta = paged_metadata(table, rows, lens, q_lens)
    assert meta.kv_indices.tolist() == reference_indices(table, rows, lens)
    assert meta.kv_indptr.tolist() == [0, 7, 8, 28, 31]
    assert meta.qo_indptr.tolist() == [0, 7, 8, 12, 13]
    assert meta.kv_last_page_len.tolist() == [1, 1, 1, 1]  # one token per page
    assert all(t.dtype == torch.int32 for t in vars(meta).values())


def test_page_table_reads_no_device_value() -> None:
    """On the meta device under DeviceRules: the indices are gathered on the table's device
    from host lists, with no host read of a device value; the indptrs stay on the host for
    FlashInfer's plan."""
    table = torch.zeros(4, 16, dtype=torch.int64, device="meta")
    with DeviceRules():
        meta = paged_metadata(table, [1, 3], [5, 9], [5, 1])
    assert meta.kv_indices.device.type == "meta" and meta.kv_indices.shape == (14,)
    assert meta.kv_indptr.device.type == meta.qo_indptr.device.type == "cpu"


def paged_attention(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: PagedMetadata
) -> torch.Tensor:
    """Attention as FlashInfer reads a page table (page size 1, NHD, causal from the end of each
    request's KV), written out request by request in float64."""
    out = torch.empty_like(q)
    group = LAYER.num_heads // LAYER.num_kv_heads
    for b in range(meta.qo_indptr.numel() - 1):
        q0, q1 = int(meta.qo_indptr[b]), int(meta.qo_indptr[b + 1])
        pages = meta.kv_indices[int(meta.kv_indptr[b]) : int(meta.kv_indptr[b + 1])].long()
        k = k_pages[pages, 0].double().repeat_interleave(group, dim=1)  # [kv, heads, D]
        v = v_pages[pages, 0].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) * LAYER.scaling
        n, s = q1 - q0, pages.numel()
        visible = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
        scores = scores.masked_fill(~visible, -math.inf)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def make_batch(mode: ForwardMode, prefix: list[int], extend: list[int], tail: int) -> ForwardBatch:
    """Requests with `prefix[i]` random tokens already in KV and `extend[i]` new ones."""
    gen = torch.Generator().manual_seed(1)
    req_pool, kv_pool = ReqToTokenPool(4, 32), KVPool(96, 1, 2, 8, torch.float32)
    rows, new_slots = [], []
    for p, e in zip(prefix, extend):
        row = req_pool.alloc()
        assert row is not None
        slots = kv_pool.alloc(p + e)
        assert slots is not None
        req_pool.write(row, 0, slots)
        old = torch.randn(p, 2, 8, generator=gen)
        kv_pool.set_kv(0, slots[:p], old, -old)
        rows.append(row)
        new_slots.append(slots[p:])
    tokens = sum(extend)
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(tokens, dtype=torch.long),
        positions=torch.zeros(3, tokens, dtype=torch.long), out_cache_loc=torch.cat(new_slots),
        req_pool_indices_list=rows, prefix_lens_list=prefix, extend_lens_list=extend,
        req_pool=req_pool, kv_pool=kv_pool, decode_tail=tail,
    )


@pytest.mark.parametrize(
    "mode, prefix, extend, tail",
    [
        (ForwardMode.EXTEND, [0, 5, 3], [6, 4, 1], 0),  # a prompt, a chunk over a prefix
        (ForwardMode.DECODE, [7, 1, 12], [1, 1, 1], 0),
        (ForwardMode.EXTEND, [2, 9, 4], [5, 1, 1], 2),  # a mixed step: two decodes ride along
    ],
)
def test_page_table_gives_the_torch_attention(
    mode: ForwardMode, prefix: list[int], extend: list[int], tail: int
) -> None:
    batch = make_batch(mode, prefix, extend, tail)
    gen = torch.Generator().manual_seed(2)
    tokens = sum(extend)
    q = torch.randn(tokens, LAYER.num_heads * LAYER.head_dim, generator=gen)
    k = torch.randn(tokens, LAYER.num_kv_heads * LAYER.head_dim, generator=gen)
    v = torch.randn(tokens, LAYER.num_kv_heads * LAYER.head_dim, generator=gen)
    expected = TorchAttentionBackend().forward(q, k, v, LAYER, batch)  # also writes the new K/V
    meta = batch_metadata(batch)
    pools = batch.kv_pool
    got = paged_attention(
        q.view(tokens, LAYER.num_heads, LAYER.head_dim),
        as_pages(pools.k_buffers[0]), as_pages(pools.v_buffers[0]), meta,
    )
    torch.testing.assert_close(got.view(tokens, -1), expected, rtol=1e-5, atol=1e-5)


def test_plan_carries_the_layer_window() -> None:
    """window_left is W - 1 (keys up to W - 1 before the query), -1 for a global layer, in
    the prefill plan (causal, after qo_indptr) and the decode plan alike."""
    meta = batch_metadata(make_batch(ForwardMode.EXTEND, [0, 5], [6, 4], 0))
    local = dataclasses.replace(LAYER, sliding_window=4)
    for decode in (False, True):
        args, kwargs = plan_arguments(meta, local, decode, torch.bfloat16, torch.bfloat16)
        assert kwargs["window_left"] == 3 and kwargs["sm_scale"] == LAYER.scaling
        assert args[-4:] == (4, 2, 8, 1) and (args[0] is meta.qo_indptr) != decode
        assert kwargs.get("causal") is (None if decode else True)
        _, kwargs = plan_arguments(meta, LAYER, decode, torch.bfloat16, torch.bfloat16)
        assert kwargs["window_left"] == -1
    with pytest.raises(ValueError, match="at least 1"):
        plan_arguments(meta, dataclasses.replace(LAYER, sliding_window=0), True, *[torch.float] * 2)


class RecordingWrapper:
    """A FlashInfer wrapper that records its plans and runs."""

    def __init__(self, decode: bool) -> None:
        self.decode = decode
        self.windows: list[int] = []
        self.runs = 0

    def plan(self, *args: object, **kwargs: object) -> None:
        self.windows.append(int(kwargs["window_left"]))  # type: ignore[call-overload]

    def run(self, q: torch.Tensor, pages: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.runs += 1
        return torch.zeros_like(q)


class RecordingSpanBackend:
    def __init__(self) -> None:
        self.windows: list[int | None] = []

    def forward(self, q, k, v, layer, batch, kv_stored=False) -> torch.Tensor:  # noqa: ANN001
        self.windows.append(layer.sliding_window)
        return torch.zeros_like(q)


def run_layers(
    backend: FlashInferAttentionBackend, batch: ForwardBatch, windows: list[int | None]
) -> None:
    """One forward's layers, with `windows[i]` as layer i's sliding window."""
    tokens = batch.input_ids.numel()
    q = torch.zeros(tokens, LAYER.num_heads * LAYER.head_dim)
    kv = torch.zeros(tokens, LAYER.num_kv_heads * LAYER.head_dim)
    for window in windows:
        layer = dataclasses.replace(LAYER, sliding_window=window)
        assert backend.forward(q, kv, kv, layer, batch).shape == q.shape


def test_local_and_global_layers_plan_once_each_per_forward() -> None:
    """Interleaved local and global layers: one wrapper per (kind, window), each planned on
    its first layer of a forward and run by all of its layers; the next forward plans again."""
    made: list[RecordingWrapper] = []

    def make(decode: bool) -> RecordingWrapper:
        made.append(RecordingWrapper(decode))
        return made[-1]

    backend = FlashInferAttentionBackend.over(make, RecordingSpanBackend())
    layers = [4, None, 4, None, 4]
    for mode, extend in ((ForwardMode.EXTEND, [6, 4, 1]), (ForwardMode.DECODE, [1, 1, 1])):
        for _ in range(2):
            run_layers(backend, make_batch(mode, [0, 5, 3], extend, 0), layers)
    assert [(w.decode, w.windows, w.runs) for w in made] == [
        (False, [3, 3], 6), (False, [-1, -1], 4), (True, [3, 3], 6), (True, [-1, -1], 4),
    ]


def test_extends_with_item_spans_run_on_the_span_backend() -> None:
    """An extend with item spans goes, every layer and its window, to the span backend
    (FlashInfer plans nothing for it); a decode batch with spans is refused."""
    made: list[bool] = []
    spans = RecordingSpanBackend()
    backend = FlashInferAttentionBackend.over(lambda d: made.append(d), spans)
    batch = make_batch(ForwardMode.EXTEND, [0, 5], [6, 4], 0)
    batch.item_spans = torch.tensor([[0, 0]] * 2 + [[2, 5]] * 3 + [[0, 0]] * 5, dtype=torch.int32)
    run_layers(backend, batch, [4, None])
    assert spans.windows == [4, None] and made == []
    decode = make_batch(ForwardMode.DECODE, [3], [1], 0)
    decode.item_spans = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="no item spans"):
        run_layers(backend, decode, [None])


def test_flashinfer_is_refused_without_cuda_and_never_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "--device cuda" in (flashinfer_problem("cpu") or "")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "pip install" in (flashinfer_problem("cuda") or "")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="--attention-backend flashinfer"):
        ServerArgs(device="cpu", attention_backend="flashinfer").resolve()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            create_attention_backend("flashinfer")
        assert "flashinfer" not in sys.modules


def test_flashinfer_uses_triton_for_the_rest_and_no_graphs() -> None:
    assert get_kernel_ops("flashinfer").name == "triton"
    args = ServerArgs(device="cuda", attention_backend="flashinfer")
    assert args.decode_graph_bs == 0
    assert ServerArgs(device="cuda", attention_backend="triton").decode_graph_bs > 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode, prefix, extend, tail",
    [
        (ForwardMode.EXTEND, [0, 5, 3], [6, 4, 1], 0),
        (ForwardMode.DECODE, [7, 1, 12], [1, 1, 1], 0),
        (ForwardMode.EXTEND, [2, 9, 4], [5, 1, 1], 2),
    ],
)
def test_flashinfer_backend_matches_torch(
    mode: ForwardMode, prefix: list[int], extend: list[int], tail: int
) -> None:
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed (pip install -e '.[gpu]')")
    layer = AttentionLayer(0, 4, 2, 64, 64**-0.5)  # FlashInfer's kernels want head_dim >= 64
    batch = make_batch(mode, prefix, extend, tail)
    kv = KVPool(96, 1, 2, 64, torch.bfloat16, "cuda")
    batch.kv_pool, batch.req_pool.req_to_token = kv, batch.req_to_token.cuda()
    batch.out_cache_loc = batch.out_cache_loc.cuda()
    gen = torch.Generator(device="cuda").manual_seed(3)
    tokens = sum(extend)
    q, k, v = (
        torch.randn(tokens, n * 64, generator=gen, device="cuda", dtype=torch.bfloat16)
        for n in (4, 2, 2)
    )
    got = create_attention_backend("flashinfer").forward(q, k, v, layer, batch)
    expected = TorchAttentionBackend().forward(q, k, v, layer, batch)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_flashinfer_window_matches_triton(mode: ForwardMode) -> None:
    """A local layer's window on FlashInfer (window_left) equals the Triton kernels' window,
    and a batch with item spans gives the Triton backend's output (it runs there)."""
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed (pip install -e '.[gpu]')")
    from kernels.triton.attention import TritonAttentionBackend

    layer = AttentionLayer(0, 4, 2, 64, 64**-0.5, sliding_window=5)
    extend = [6, 4, 1] if mode == ForwardMode.EXTEND else [1, 1, 1]
    batch = make_batch(mode, [2, 9, 20], extend, 0)
    kv = KVPool(96, 1, 2, 64, torch.bfloat16, "cuda")
    batch.kv_pool, batch.req_pool.req_to_token = kv, batch.req_to_token.cuda()
    batch.out_cache_loc = batch.out_cache_loc.cuda()
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (
        torch.randn(sum(extend), n * 64, generator=gen, device="cuda", dtype=torch.bfloat16)
        for n in (4, 2, 2)
    )
    flashinfer = create_attention_backend("flashinfer")
    expected = TritonAttentionBackend().forward(q, k, v, layer, batch)
    got = flashinfer.forward(q, k, v, layer, batch)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    if mode == ForwardMode.EXTEND:
        spans = [[0, 0]] * 6 + [[8, 12]] * 3 + [[0, 0]] * 2
        batch.item_spans = torch.tensor(spans, dtype=torch.int32, device="cuda")
        assert torch.equal(
            create_attention_backend("flashinfer").forward(q, k, v, layer, batch),
            TritonAttentionBackend().forward(q, k, v, layer, batch),
        )
