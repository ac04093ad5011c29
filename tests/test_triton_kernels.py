"""Triton kernels (attention, RMSNorm, rotary) against tessera's torch references.

On a CPU machine the kernels run in Triton's interpreter: TRITON_INTERPRET=1 must be set before
the kernel modules are imported (triton reads it when a kernel is decorated), so it is set here
at the top, and the kernel modules are imported inside the fixture. Sizes are tiny because the
interpreter costs about 1 ms per program instance.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
from numerics import assert_within_rounding, kernel_bound  # noqa: E402

from kernels.activation import silu_and_mul  # noqa: E402
from kernels.attention.base import AttentionLayer  # noqa: E402
from kernels.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kernels.attention.varlen import varlen_attention  # noqa: E402
from kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from kernels.rotary import apply_rotary, mrope_cos_sin  # noqa: E402
from runtime.forward_batch import DecodeTables, ForwardBatch, ForwardMode  # noqa: E402
from runtime.memory_pool import KVPool, ReqToTokenPool  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def tk() -> types.SimpleNamespace:
    """The kernel modules, or a skip when they cannot run here."""
    triton = pytest.importorskip("triton")
    from kernels.triton import activation, attention, norm, rotary, varlen_attention

    if not CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(attention._extend_kernel, InterpretedFunction):
            pytest.skip(
                "no CUDA and the Triton kernels were built without the interpreter: "
                "kernels.triton was imported before TRITON_INTERPRET=1 was set "
                f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}, "
                f"triton {triton.__version__})"
            )
    return types.SimpleNamespace(
        attention=attention, norm=norm, rotary=rotary, varlen=varlen_attention,
        activation=activation,
    )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return ((actual.float() - expected).norm() / expected.norm().clamp_min(1e-12)).item()


# ---------------------------------------------------------------- attention


@dataclasses.dataclass
class AttnCase:
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer: AttentionLayer


def make_case(
    prefix_lens: list[int],
    extend_lens: list[int],
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    mode: ForwardMode = ForwardMode.EXTEND,
    seed: int = 0,
) -> AttnCase:
    """A batch over a real KVPool/ReqToTokenPool whose cached prefixes sit at shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(prefix_lens) + sum(extend_lens)
    layer = AttentionLayer(1, heads, kv_heads, head_dim, head_dim**-0.5)
    longest = max(p + e for p, e in zip(prefix_lens, extend_lens))
    req_pool = ReqToTokenPool(len(prefix_lens) + 2, max(128, longest), device=DEVICE)
    kv_pool = KVPool(total + 16, 2, kv_heads, head_dim, dtype, device=DEVICE)
    kv_pool._free = kv_pool._free[torch.randperm(kv_pool.size, generator=gen)]
    req_pool.alloc()  # leave row 0 unused so pool rows differ from batch positions
    rows, new_slots = [], []
    for prefix, extend in zip(prefix_lens, extend_lens):
        row = req_pool.alloc()
        assert row is not None
        slots = kv_pool.alloc(prefix + extend)
        assert slots is not None
        req_pool.write(row, 0, slots.to(DEVICE))
        cached = torch.randn(2, prefix, kv_heads, head_dim, generator=gen).to(DEVICE)
        kv_pool.set_kv(layer.layer_id, slots[:prefix].to(DEVICE), cached[0], cached[1])
        rows.append(row)
        new_slots.append(slots[prefix:])
    tokens = sum(extend_lens)
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=DEVICE),
        positions=torch.zeros(3, tokens, dtype=torch.int64, device=DEVICE),
        out_cache_loc=torch.cat(new_slots).to(DEVICE),
        req_pool_indices_list=rows,
        prefix_lens_list=prefix_lens,
        extend_lens_list=extend_lens,
        req_pool=req_pool,
        kv_pool=kv_pool,
    )

    def rand(h: int) -> torch.Tensor:
        return torch.randn(tokens, h * head_dim, generator=gen).to(DEVICE, dtype)

    return AttnCase(batch, rand(heads), rand(kv_heads), rand(kv_heads), layer)


def attention_terms(case: AttnCase) -> int:
    """Sum lengths of attention: q.k over head_dim, the softmax and p.v over the longest
    sequence."""
    b = case.batch
    longest = max(p + e for p, e in zip(b.prefix_lens_list, b.extend_lens_list))
    return case.layer.head_dim + 2 * longest


def check_backend(case: AttnCase, backend: object, dtype: torch.dtype) -> None:
    """Run the Triton backend and the torch reference on copies of the same pool."""
    ref_batch = dataclasses.replace(case.batch, kv_pool=_copy_pool(case.batch.kv_pool))
    expected = TorchAttentionBackend().forward(case.q, case.k, case.v, case.layer, ref_batch)
    actual = backend.forward(case.q, case.k, case.v, case.layer, case.batch)  # type: ignore[attr-defined]
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    # other summation orders; in 16 bits the kernel rounds p and the output, the reference
    # its scores, p and the output
    assert rel_err(actual, expected) <= kernel_bound(dtype, attention_terms(case), 5)
    lid = case.layer.layer_id
    assert torch.equal(case.batch.kv_pool.k_buffers[lid], ref_batch.kv_pool.k_buffers[lid])
    assert torch.equal(case.batch.kv_pool.v_buffers[lid], ref_batch.kv_pool.v_buffers[lid])


def _copy_pool(pool: KVPool) -> KVPool:
    copy = KVPool.__new__(KVPool)
    copy.__dict__.update(pool.__dict__)
    copy.k_buffers = [b.clone() for b in pool.k_buffers]
    copy.v_buffers = [b.clone() for b in pool.v_buffers]
    return copy


def test_extend_backend_fp32(tk: types.SimpleNamespace) -> None:
    case = make_case([0, 5], [7, 3])
    check_backend(case, tk.attention.TritonAttentionBackend(block_m=16, block_n=16), torch.float32)


def test_extend_multiple_blocks(tk: types.SimpleNamespace) -> None:
    """Query and key blocks split inside the extend part, so causality crosses block edges."""
    case = make_case([11, 0, 3], [20, 17, 1], heads=4, kv_heads=1, seed=1)
    check_backend(case, tk.attention.TritonAttentionBackend(block_m=16, block_n=16), torch.float32)


def test_extend_bf16_pool(tk: types.SimpleNamespace) -> None:
    case = make_case([0, 5], [7, 3], dtype=torch.bfloat16, seed=2)
    backend = tk.attention.TritonAttentionBackend(block_m=16, block_n=16)
    check_backend(case, backend, torch.bfloat16)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (3, 1)])
def test_decode_backend(tk: types.SimpleNamespace, heads: int, kv_heads: int) -> None:
    case = make_case(
        [0, 8, 36, 19], [1, 1, 1, 1], heads, kv_heads, mode=ForwardMode.DECODE, seed=heads
    )
    check_backend(case, tk.attention.TritonAttentionBackend(block_n=16), torch.float32)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (3, 1)])
def test_torch_decode_is_batched_extend(heads: int, kv_heads: int) -> None:
    """The torch backend's batched decode equals its per-request extend path on the same
    tokens, and padding never reads a slot no request owns (those hold NaN here)."""
    case = make_case([0, 8, 36, 19], [1, 1, 1, 1], heads, kv_heads, mode=ForwardMode.DECODE)
    pool = case.batch.kv_pool
    owned = torch.zeros(pool.k_buffers[1].shape[0], dtype=torch.bool, device=DEVICE)
    for row, n in zip(case.batch.req_pool_indices_list, case.batch.seq_lens_list):
        owned[case.batch.req_to_token[row, :n].long()] = True
    for buf in (pool.k_buffers[1], pool.v_buffers[1]):
        buf[~owned] = float("nan")
    extend = dataclasses.replace(case.batch, mode=ForwardMode.EXTEND, kv_pool=_copy_pool(pool))
    expected = TorchAttentionBackend().forward(case.q, case.k, case.v, case.layer, extend)
    actual = TorchAttentionBackend().forward(case.q, case.k, case.v, case.layer, case.batch)
    assert not actual.isnan().any()
    # the decode batch sums in other orders than the extend path
    assert_within_rounding(actual, expected, attention_terms(case))


def test_torch_mixed_decode_tail_equals_extend() -> None:
    """A mixed step's decode tail (one-token extends over a cached prefix, batched as a decode)
    gives what the per-request extend path gives on the same tokens."""
    case = make_case([0, 5, 8, 36, 19], [7, 3, 1, 1, 1], seed=5)
    mixed = dataclasses.replace(case.batch, decode_tail=3)
    plain = dataclasses.replace(case.batch, kv_pool=_copy_pool(case.batch.kv_pool))
    expected = TorchAttentionBackend().forward(case.q, case.k, case.v, case.layer, plain)
    actual = TorchAttentionBackend().forward(case.q, case.k, case.v, case.layer, mixed)
    # the decode tail sums in other orders than the per-request extends
    assert_within_rounding(actual, expected, attention_terms(case))


def test_mixed_backend(tk: types.SimpleNamespace) -> None:
    """The Triton extend kernel runs a mixed step's decode tail as one-token extends."""
    case = make_case([0, 5, 8, 36], [7, 3, 1, 1], seed=6)
    case = dataclasses.replace(case, batch=dataclasses.replace(case.batch, decode_tail=2))
    check_backend(case, tk.attention.TritonAttentionBackend(block_m=16, block_n=16), torch.float32)


def test_metadata_built_once_per_forward(tk: types.SimpleNamespace) -> None:
    case = make_case([2, 4], [1, 1], mode=ForwardMode.DECODE)
    backend = tk.attention.TritonAttentionBackend(block_n=16)
    meta = backend.metadata(case.batch, torch.device(DEVICE))
    assert backend.metadata(case.batch, torch.device(DEVICE)) is meta
    assert meta.q_starts.tolist() == [0, 1] and meta.seq_lens.tolist() == [3, 5]
    other = dataclasses.replace(case.batch)
    assert backend.metadata(other, torch.device(DEVICE)) is not meta


def test_extend_kernel_direct(tk: types.SimpleNamespace) -> None:
    """The kernel entry point alone, on q that is a non-contiguous view of a fused qkv."""
    case = make_case([4, 0], [5, 6], seed=5)
    b, layer = case.batch, case.layer
    shape = (-1, layer.num_kv_heads, layer.head_dim)
    b.kv_pool.set_kv(layer.layer_id, b.out_cache_loc, case.k.view(shape), case.v.view(shape))
    qkv = torch.cat((case.q, case.k, case.v), dim=1)
    q = qkv[:, : case.q.shape[1]].view(-1, layer.num_heads, layer.head_dim)
    meta = tk.attention.AttentionMetadata.from_batch(b, torch.device(DEVICE))
    lid = layer.layer_id
    out = tk.attention.extend_attention(
        q, b.kv_pool.k_buffers[lid], b.kv_pool.v_buffers[lid], b.req_to_token, meta,
        layer.scaling, block_m=16, block_n=16,
    )
    ref_batch = dataclasses.replace(b, kv_pool=_copy_pool(b.kv_pool))
    expected = TorchAttentionBackend().forward(case.q, case.k, case.v, layer, ref_batch)
    # other summation orders of the same float32 sums
    bound = kernel_bound(torch.float32, attention_terms(case), 0)
    assert rel_err(out.reshape(expected.shape), expected) <= bound


def decode_direct(
    tk: types.SimpleNamespace,
    case: AttnCase,
    num_splits: int | None,
    block_n: int = 16,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode_attention with `num_splits` and `window`, the torch reference without a window)
    on one decode case, with the pool slots no request owns set to NaN so that a read past a
    request's tokens shows."""
    b, layer = case.batch, case.layer
    shape = (-1, layer.num_kv_heads, layer.head_dim)
    b.kv_pool.set_kv(layer.layer_id, b.out_cache_loc, case.k.view(shape), case.v.view(shape))
    k_buf, v_buf = b.kv_pool.k_buffers[layer.layer_id], b.kv_pool.v_buffers[layer.layer_id]
    owned = torch.zeros(k_buf.shape[0], dtype=torch.bool, device=DEVICE)
    for row, n in zip(b.req_pool_indices_list, b.seq_lens_list):
        owned[b.req_to_token[row, :n].long()] = True
    for buf in (k_buf, v_buf):
        buf[~owned] = float("nan")
    ref_batch = dataclasses.replace(b, kv_pool=_copy_pool(b.kv_pool))
    expected = TorchAttentionBackend().forward(case.q, case.k, case.v, layer, ref_batch)
    meta = tk.attention.AttentionMetadata.from_batch(b, torch.device(DEVICE))
    q = case.q.view(-1, layer.num_heads, layer.head_dim)
    out = tk.attention.decode_attention(
        q, k_buf, v_buf, b.req_to_token, meta.seq_lens, meta.req_pool_indices, layer.scaling,
        block_n, num_splits=num_splits, window=window,
    )
    return out.view(expected.shape), expected


@pytest.mark.parametrize(
    ("num_splits", "heads", "kv_heads", "dtype"),
    [
        (1, 28, 4, torch.float32),
        (2, 7, 1, torch.float32),
        (3, 28, 4, torch.bfloat16),
        (3, 7, 1, torch.float32),
        (8, 7, 1, torch.bfloat16),
        (8, 28, 4, torch.float32),
    ],
)
def test_decode_split_kv(
    tk: types.SimpleNamespace, num_splits: int, heads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    """Split-KV decode against the torch reference and the single-pass kernel, on requests of
    lengths 1, 5, 40 and 19 (blocks of 16 tokens: a split may be empty or partly filled, and
    at 8 splits every request has empty ones) and q-head groups of 7."""
    case = make_case(
        [0, 4, 39, 18], [1] * 4, heads, kv_heads, 8, dtype, ForwardMode.DECODE, seed=num_splits
    )
    out, expected = decode_direct(tk, case, num_splits)
    assert out.dtype == dtype and not out.isnan().any()
    # as in check_backend
    assert rel_err(out, expected) <= kernel_bound(dtype, attention_terms(case), 5)
    single, _ = decode_direct(tk, case, 1)
    # the splits sum in another order than one pass; each side rounds its output once
    assert rel_err(out, single) <= kernel_bound(dtype, attention_terms(case), 2)


def test_decode_split_kv_one_token(tk: types.SimpleNamespace) -> None:
    """A single request of one token over 8 splits: seven splits are empty, and the output is
    that token's values exactly."""
    case = make_case([0], [1], 7, 1, 8, mode=ForwardMode.DECODE, seed=11)
    out, expected = decode_direct(tk, case, 8)
    v = case.v.view(1, 1, 8).expand(1, 7, 8).reshape(expected.shape)
    assert torch.equal(out, v)
    assert rel_err(out, expected) <= kernel_bound(torch.float32, attention_terms(case), 0)


def test_decode_split_count(tk: types.SimpleNamespace) -> None:
    """The split count comes from shapes alone: splits at batch 1, none once the batch fills
    the GPU, capped, and never more than blocks in the longest possible request."""
    splits = tk.attention.decode_splits
    assert splits(1, 4, 32768, 64) == tk.attention.MAX_DECODE_SPLITS
    assert 1 < splits(8, 4, 32768, 64) < tk.attention.MAX_DECODE_SPLITS
    assert splits(64, 4, 32768, 64) == 1
    assert splits(256, 4, 32768, 64) == 1
    assert splits(1, 4, 100, 64) == 2
    assert splits(1, 4, 1, 64) == 1


# ---------------------------------------------------------------- sliding windows, item spans


def span_table(batch: ForwardBatch, items: list[list[tuple[int, int]]]) -> torch.Tensor:
    """item_spans for the batch's first len(items) requests (the rest are a decode tail):
    each token inside one of its request's items [start, end) gets that item, others (0, 0)."""
    parts = []
    for prefix, extend, spans in zip(batch.prefix_lens_list, batch.extend_lens_list, items):
        table = torch.zeros(extend, 2, dtype=torch.int32)
        pos = torch.arange(prefix, prefix + extend)
        for lo, hi in spans:
            table[(pos >= lo) & (pos < hi)] = torch.tensor([lo, hi], dtype=torch.int32)
        parts.append(table)
    return torch.cat(parts).to(DEVICE)


def masked_sdpa(case: AttnCase, window: int | None, spans: torch.Tensor | None) -> torch.Tensor:
    """The reference, request by request in float64 over the pool's K/V (new tokens stored):
    query i sees key j iff (j <= i and (no window or i - j < window)) or j is in i's item."""
    b, layer = case.batch, case.layer
    group = layer.num_heads // layer.num_kv_heads
    k_buf, v_buf = b.kv_pool.k_buffers[layer.layer_id], b.kv_pool.v_buffers[layer.layer_id]
    q = case.q.view(-1, layer.num_heads, layer.head_dim).double()
    out, first = torch.empty_like(q), 0
    for row, prefix, extend in zip(b.req_pool_indices_list, b.prefix_lens_list, b.extend_lens_list):
        slots = b.req_to_token[row, : prefix + extend].long()
        k, v = (buf[slots].double().repeat_interleave(group, dim=1) for buf in (k_buf, v_buf))
        i = torch.arange(prefix, prefix + extend, device=DEVICE)[:, None]
        j = torch.arange(prefix + extend, device=DEVICE)[None, :]
        visible = (j <= i) & ((i - j < window) if window else True)
        if spans is not None and first < spans.shape[0]:
            item = spans[first : first + extend].long()
            visible = visible | ((j >= item[:, :1]) & (j < item[:, 1:]))
        scores = torch.einsum("qhd,khd->hqk", q[first : first + extend], k) * layer.scaling
        weights = scores.masked_fill(~visible, -torch.inf).softmax(-1)
        out[first : first + extend] = torch.einsum("hqk,khd->qhd", weights, v)
        first += extend
    return out.view(case.q.shape)


def check_masked(
    tk: types.SimpleNamespace,
    case: AttnCase,
    window: int | None,
    items: list[list[tuple[int, int]]] | None,
    decode_tail: int = 0,
    dtype: torch.dtype = torch.float32,
    block: int = 16,
) -> torch.Tensor:
    """The Triton backend (`block`-token blocks) on a layer with `window` and a batch with
    `items` against masked_sdpa; returns the output."""
    spans = None if items is None else span_table(case.batch, items)
    batch = dataclasses.replace(case.batch, item_spans=spans, decode_tail=decode_tail)
    layer = dataclasses.replace(case.layer, sliding_window=window)
    backend = tk.attention.TritonAttentionBackend(block_m=block, block_n=block)
    out = backend.forward(case.q, case.k, case.v, layer, batch)
    case = dataclasses.replace(case, batch=batch, layer=layer)
    # as in check_backend, against a float64 reference
    bound = kernel_bound(dtype, attention_terms(case), 5)
    assert rel_err(out, masked_sdpa(case, window, spans)) <= bound
    return out


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_extend_sliding_window(tk: types.SimpleNamespace, window: int) -> None:
    """Windows of one token, inside one key block, of a whole block and past every request,
    over cached prefixes: query blocks start their key loop at the window's first block."""
    case = make_case([11, 0, 37], [20, 17, 3], heads=4, kv_heads=2, seed=20)
    check_masked(tk, case, window, None)


def test_extend_item_spans(tk: types.SimpleNamespace) -> None:
    """Items that cross a query block's causal end (req 0: [10, 19) with 16-token blocks), one
    that begins in the cached prefix (req 1: [4, 10) over 6 cached tokens), two in one
    request, and a request without items, all in one batch."""
    case = make_case([0, 6, 3], [20, 14, 9], seed=21)
    items = [[(10, 19)], [(4, 10), (12, 19)], []]
    out = check_masked(tk, case, None, items)
    causal = check_masked(tk, case, None, None)
    # only the item tokens with a later key in their item attend otherwise than causally
    changed = (out - causal).abs().amax(dim=1) > 1e-4
    pos = torch.cat([torch.arange(p, p + e) for p, e in zip([0, 6, 3], [20, 14, 9])])
    assert torch.equal(changed, span_table(case.batch, items)[:, 1] - 1 > pos.to(DEVICE))


def test_extend_window_and_spans(tk: types.SimpleNamespace) -> None:
    """A window of 4 with an item of 33 tokens: the item's tokens see all of it (earlier
    ones than the window too, from a third query block whose window starts two key blocks
    after the item), the tokens after it only the window."""
    case = make_case([5, 0], [40, 12], seed=22)
    check_masked(tk, case, 4, [[(7, 40)], [(0, 3)]])


def test_mixed_step_with_windows_and_spans(tk: types.SimpleNamespace) -> None:
    """A mixed step: two extends with items, then a decode tail of two requests with no spans
    (item_spans covers the extend tokens only), with and without a window."""
    case = make_case([0, 9, 8, 36], [18, 5, 1, 1], seed=23)
    for window in (None, 6):
        check_masked(tk, case, window, [[(2, 17)], [(7, 13)]], decode_tail=2)


def test_item_spans_of_the_wrong_length_are_refused(tk: types.SimpleNamespace) -> None:
    case = make_case([0, 9], [6, 1], seed=24)
    spans = span_table(case.batch, [[(1, 4)], [(9, 10)]])  # the tail's token given a row
    batch = dataclasses.replace(case.batch, item_spans=spans, decode_tail=1)
    backend = tk.attention.TritonAttentionBackend(block_m=16, block_n=16)
    with pytest.raises(ValueError, match="item_spans has 7 rows for 6 extend tokens"):
        backend.forward(case.q, case.k, case.v, case.layer, batch)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("window", [1, 7, 30])
def test_decode_sliding_window(tk: types.SimpleNamespace, num_splits: int, window: int) -> None:
    """Decode over the last `window` tokens, in one pass and split (a split of a short window
    may be empty), on requests shorter and longer than the window; slots no request owns are
    NaN, so a read outside a request shows."""
    case = make_case([0, 4, 39, 18], [1] * 4, 7, 1, 8, mode=ForwardMode.DECODE, seed=window)
    layer = dataclasses.replace(case.layer, sliding_window=window)
    out, _ = decode_direct(tk, case, num_splits, window=window)
    case = dataclasses.replace(case, layer=layer)
    assert not out.isnan().any()
    bound = kernel_bound(torch.float32, attention_terms(case), 5)
    assert rel_err(out, masked_sdpa(case, window, None)) <= bound


def test_static_decode_honours_the_window(tk: types.SimpleNamespace) -> None:
    """A decode batch over device tables (what a captured CUDA graph replays) reads the
    layer's window as the dynamic batch does, through the backend's automatic splits."""
    case = make_case([3, 40, 21], [1] * 3, mode=ForwardMode.DECODE, seed=25)
    b = case.batch
    rows = torch.tensor(b.req_pool_indices_list, device=DEVICE)
    lens = torch.tensor(b.seq_lens_list, device=DEVICE)
    tables = DecodeTables(rows, lens, b.req_to_token.shape[1])
    static = dataclasses.replace(case, batch=dataclasses.replace(b, decode_tables=tables))
    for window in (None, 9):
        check_masked(tk, static, window, None)
    check_masked(tk, case, 9, None)


# ---------------------------------------------------------------- vision varlen attention


def varlen_case(
    lengths: list[int], heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v as strided views of one merged QKV output, as the vision towers make them."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    qkv = torch.randn(tokens, 3, heads, head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize(
    ("lengths", "dtype"),
    [
        ([16, 40, 7], torch.float32),  # frames of mixed sizes; 40 spans two query blocks
        ([16, 16, 0, 4, 16, 9], torch.float32),  # windows, one of them empty
        ([24, 33], torch.bfloat16),
    ],
)
def test_varlen_attention(
    tk: types.SimpleNamespace, lengths: list[int], dtype: torch.dtype
) -> None:
    q, k, v, cu = varlen_case(lengths, 2, 20, dtype, seed=sum(lengths))
    out = tk.varlen.varlen_attention(q, k, v, cu, 20**-0.5)
    expected = varlen_attention(q.float(), k.float(), v.float(), cu, 20**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    # other summation orders; in 16 bits the kernel rounds p and its output
    assert rel_err(out, expected) <= kernel_bound(dtype, 20 + 2 * max(lengths), 2)


def test_varlen_attention_stays_in_segments(tk: types.SimpleNamespace) -> None:
    """Changing one segment's keys changes that segment's output only."""
    q, k, v, cu = varlen_case([12, 20], 2, 16, torch.float32, seed=3)
    before = tk.varlen.varlen_attention(q, k, v, cu, 0.25)
    k2 = k.clone()
    k2[12:] += 1.0
    after = tk.varlen.varlen_attention(q, k2, v, cu, 0.25)
    assert torch.equal(after[:12], before[:12])
    assert not torch.allclose(after[12:], before[12:])


def test_varlen_attention_rejects_bad_bounds(tk: types.SimpleNamespace) -> None:
    q, k, v, _ = varlen_case([8, 8], 1, 16, torch.float32, seed=4)
    with pytest.raises(ValueError, match="cu_seqlens ends at 12"):
        tk.varlen.varlen_attention(q, k, v, torch.tensor([0, 4, 12]), 0.25)


# ---------------------------------------------------------------- norm and rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(tk: types.SimpleNamespace, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=gen).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(40, generator=gen)).to(DEVICE, dtype)
    out = tk.norm.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    # the sum of 40 squares and the scaling in other orders; in 16 bits the kernel rounds its
    # output, the reference the normalised row and the weighted output
    assert rel_err(out, rms_norm(x, w, 1e-6)) <= kernel_bound(dtype, 40 + 3, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm(tk: types.SimpleNamespace, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, res = torch.randn(2, 5, 64, generator=gen).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(DEVICE, dtype)
    out, new_res = tk.norm.fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm(x, res, w, 1e-6)
    assert new_res.dtype == dtype
    if CUDA or dtype == torch.float32:
        assert torch.equal(new_res, ref_res)
    else:  # the interpreter's fp32 -> bf16 cast may round differently: allow one bf16 ulp
        torch.testing.assert_close(new_res, ref_res, rtol=2**-7, atol=0.0)
    # as in test_rms_norm, over 64 squares
    assert rel_err(out, ref_out) <= kernel_bound(dtype, 64 + 3, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_rotary(tk: types.SimpleNamespace, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    tokens, head_dim = 6, 16
    positions = torch.randint(0, 50, (3, tokens), generator=gen).to(DEVICE)
    cos, sin = mrope_cos_sin(positions, head_dim, 10000.0, (2, 3, 3))
    qkv = torch.randn(tokens, (4 + 2 + 2) * head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : 4 * head_dim].view(tokens, 4, head_dim)  # strided views, as in a model
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(tokens, 2, head_dim)
    q_out, k_out = tk.rotary.apply_rotary_qk(q, k, cos, sin)
    assert q_out.dtype == dtype and q_out.shape == q.shape
    # x*cos + y*sin (two products, one sum) in float32 on both sides, then one output rounding
    # on each side
    assert rel_err(q_out, apply_rotary(q, cos, sin)) <= kernel_bound(dtype, 3, 2)
    assert rel_err(k_out, apply_rotary(k, cos, sin)) <= kernel_bound(dtype, 3, 2)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_kv(tk: types.SimpleNamespace, dtype: torch.dtype, pool_dtype) -> None:
    """The fused decoder step: q and k rotated as apply_rotary_qk rotates them, the rotated k and
    the v written at the step's slots (cast to the pool's dtype) and nowhere else."""
    gen = torch.Generator().manual_seed(12)
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 16
    positions = torch.randint(0, 50, (3, tokens), generator=gen).to(DEVICE)
    cos, sin = mrope_cos_sin(positions, head_dim, 10000.0, (2, 3, 3))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(tokens, -1, head_dim) for x in (q, k, v))  # strided views, as in a model
    k_buf = torch.zeros(12, kv_heads, head_dim, dtype=pool_dtype, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    slots = torch.tensor([7, 2, 11, 4, 9])
    q_out, k_out = tk.rotary.rotary_store_kv(q, k, v, cos, sin, k_buf, v_buf, slots)
    ref_q, ref_k = tk.rotary.apply_rotary_qk(q, k, cos, sin)
    assert torch.equal(q_out, ref_q) and torch.equal(k_out, ref_k)  # the same float32 math
    # as in test_mrope_rotary
    assert rel_err(k_out, apply_rotary(k, cos, sin)) <= kernel_bound(dtype, 3, 2)
    stored_k, stored_v = k_buf[slots.to(DEVICE)], v_buf[slots.to(DEVICE)]
    if CUDA or pool_dtype == dtype:
        assert torch.equal(stored_k, ref_k.to(pool_dtype))
        assert torch.equal(stored_v, v.to(pool_dtype))
    else:  # the interpreter's fp32 -> bf16 cast may round differently: allow one bf16 ulp
        torch.testing.assert_close(stored_k, ref_k.to(pool_dtype), rtol=2**-7, atol=0.0)
        torch.testing.assert_close(stored_v, v.to(pool_dtype), rtol=2**-7, atol=0.0)
    others = torch.ones(12, dtype=torch.bool)
    others[slots] = False
    assert not k_buf[others.to(DEVICE)].any() and not v_buf[others.to(DEVICE)].any()


def test_rotary_store_kv_rejects_mismatched_pool(tk: types.SimpleNamespace) -> None:
    q, k = torch.zeros(3, 4, 16), torch.zeros(3, 2, 16)
    cos = torch.zeros(3, 16)
    with pytest.raises(ValueError, match="pool buffers"):
        tk.rotary.rotary_store_kv(
            q, k, k, cos, cos, torch.zeros(8, 4, 16), torch.zeros(8, 4, 16), torch.arange(3)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(tk: types.SimpleNamespace, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    hidden = 1030  # two column blocks, the second masked
    x = (3 * torch.randn(2, 3, 2 * hidden, generator=gen)).to(DEVICE, dtype)
    out = tk.activation.silu_and_mul(x)
    assert out.shape == (2, 3, hidden) and out.dtype == dtype
    # silu's exp and division, then the product, rounded on both sides (the kernel's exp may
    # differ from torch's by a few ulps of float32)
    assert rel_err(out, silu_and_mul(x)) <= kernel_bound(dtype, 4, 2)


# ---------------------------------------------------------------- GPU only: native, larger, bf16


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_extend_backend_gpu(tk: types.SimpleNamespace, dtype: torch.dtype) -> None:
    case = make_case([0, 100, 37], [300, 64, 129], 16, 4, 128, dtype=dtype, seed=7)
    check_backend(case, tk.attention.TritonAttentionBackend(), dtype)


@pytest.mark.gpu
def test_decode_backend_gpu(tk: types.SimpleNamespace) -> None:
    prefix = [0, 5, 63, 64, 120, 127]
    case = make_case(
        prefix, [1] * len(prefix), 28, 4, 128, torch.bfloat16, ForwardMode.DECODE, seed=8
    )
    check_backend(case, tk.attention.TritonAttentionBackend(), torch.bfloat16)


@pytest.mark.gpu
def test_decode_split_kv_gpu(tk: types.SimpleNamespace) -> None:
    """The 7B's shapes at batch 1 and 2 over a long context: the automatic split count against
    the reference and the single-pass kernel."""
    for prefix in ([1000], [700, 63]):
        case = make_case(
            prefix, [1] * len(prefix), 28, 4, 128, torch.bfloat16, ForwardMode.DECODE, seed=12
        )
        out, expected = decode_direct(tk, case, None, block_n=64)
        single, _ = decode_direct(tk, case, 1, block_n=64)
        terms = attention_terms(case)
        assert rel_err(out, expected) <= kernel_bound(torch.bfloat16, terms, 5)
        assert rel_err(out, single) <= kernel_bound(torch.bfloat16, terms, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_attention_gpu(tk: types.SimpleNamespace, dtype: torch.dtype) -> None:
    lengths = [1024, 64, 64, 64, 64, 256, 4096, 0, 300]  # frames and windows of a real batch
    q, k, v, cu = varlen_case(lengths, 16, 80, dtype, seed=10)
    out = tk.varlen.varlen_attention(q, k, v, cu, 80**-0.5)
    expected = varlen_attention(q.float(), k.float(), v.float(), cu, 80**-0.5)
    # as in test_varlen_attention
    assert rel_err(out, expected) <= kernel_bound(dtype, 80 + 2 * max(lengths), 2)


@pytest.mark.gpu
def test_windows_and_spans_gpu(tk: types.SimpleNamespace) -> None:
    """Gemma 3 4B's attention shapes (head_dim 256) in bf16 with the backend's 32-token blocks:
    a local layer's window over long prefixes, image items, and a mixed step's decode tail;
    then the windowed decode at batch 1 (split) and batch 64 (one pass)."""
    case = make_case([0, 300, 40, 700], [600, 90, 1, 1], 8, 4, 256, torch.bfloat16, seed=13)
    items = [[(5, 261), (300, 556)], [(290, 346)]]
    for window in (None, 128):
        check_masked(tk, case, window, items, 2, torch.bfloat16, block=32)
    for prefix in ([1500], list(range(0, 640, 10))):
        decode = make_case(
            prefix, [1] * len(prefix), 8, 4, 256, torch.bfloat16, ForwardMode.DECODE, seed=14
        )
        check_masked(tk, decode, 128, None, dtype=torch.bfloat16, block=32)


@pytest.mark.gpu
def test_norm_and_rotary_gpu(tk: types.SimpleNamespace) -> None:
    gen = torch.Generator().manual_seed(9)
    x, res = torch.randn(2, 257, 3584, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(3584, generator=gen).to(DEVICE, torch.bfloat16)
    out, new_res = tk.norm.fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm(x, res, w, 1e-6)
    # as in test_rms_norm, over 3584 squares
    bound = kernel_bound(torch.bfloat16, 3584 + 3, 3)
    assert torch.equal(new_res, ref_res) and rel_err(out, ref_out) <= bound
    positions = torch.randint(0, 4000, (3, 257), generator=gen).to(DEVICE)
    cos, sin = mrope_cos_sin(positions, 128, 1e6, (16, 24, 24))
    q = torch.randn(257, 28, 128, generator=gen).to(DEVICE, torch.bfloat16)
    # as in test_mrope_rotary
    bound = kernel_bound(torch.bfloat16, 3, 2)
    assert rel_err(tk.rotary.apply_rotary(q, cos, sin), apply_rotary(q, cos, sin)) <= bound
