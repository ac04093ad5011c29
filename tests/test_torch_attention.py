"""The torch attention backend against attention written out token by token; the vision
towers' variable-length attention against one segment at a time; the KV and request tables'
batched reads and writes against one row at a time."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_within_rounding

from kernels.attention.base import AttentionLayer
from kernels.attention.torch_backend import TorchAttentionBackend, _attend
from kernels.attention.varlen import varlen_attention
from runtime.forward_batch import ForwardBatch, ForwardMode
from runtime.memory_pool import KVPool, ReqToTokenPool


def naive_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, H, D], the last n positions of k/v [s, Hkv, D]; each query sees keys up to itself."""
    n, heads, _ = q.shape
    s, kv_heads, _ = k.shape
    out = torch.empty_like(q)
    for i in range(n):
        visible = s - n + i + 1
        for h in range(heads):
            g = h // (heads // kv_heads)
            weights = torch.softmax(k[:visible, g] @ q[i, h] * scale, dim=0)
            out[i, h] = weights @ v[:visible, g]
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("new,total", [(9, 9), (3, 11), (1, 5)])
def test_prefill_matches_token_by_token(heads: int, kv_heads: int, new: int, total: int) -> None:
    torch.manual_seed(heads * 100 + new * 10 + total)
    dim = 8
    layer = AttentionLayer(0, heads, kv_heads, dim, dim**-0.5)
    q = torch.randn(new, heads, dim)
    k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    expected = naive_causal(q, k, v, layer.scaling)
    # other summation orders of q.k (dim terms), the softmax and p.v (total terms each)
    assert_within_rounding(_attend(q, k, v, layer), expected, terms=dim + 2 * total)


def naive_segments(q, k, v, cu_seqlens, scale: float) -> torch.Tensor:
    """Full (bidirectional) attention inside each segment, one segment and head at a time."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        for h in range(q.shape[1]):
            weights = torch.softmax(q[start:end, h] @ k[start:end, h].T * scale, dim=-1)
            out[start:end, h] = weights @ v[start:end, h]
    return out


@pytest.mark.parametrize(
    "bounds",
    [[0, 24], [0, 8, 16, 24], [0, 5, 24], [0, 8, 8, 16, 24], [0, 3, 11, 19, 24]],
    ids=["one", "equal", "unequal", "empty-segment", "equal-and-not"],
)
def test_varlen_attention_stays_inside_each_segment(bounds: list[int]) -> None:
    """Equal segments take the no-copy path (views); others are gathered by length."""
    torch.manual_seed(len(bounds))
    q, k, v = (torch.randn(24, 3, 8) for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32)
    expected = naive_segments(q, k, v, cu, 0.3)
    # other summation orders of q.k (8 terms), the softmax and p.v (at most 24 terms each)
    assert_within_rounding(varlen_attention(q, k, v, cu, 0.3), expected, terms=8 + 2 * 24)


def test_kv_rows_gathered_by_a_2d_slot_table() -> None:
    pool = KVPool(32, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    torch.manual_seed(0)
    for layer in range(2):
        pool.k_buffers[layer].copy_(torch.randn(pool.k_buffers[layer].shape))
        pool.v_buffers[layer].copy_(torch.randn(pool.v_buffers[layer].shape))
    slots = torch.tensor([[3, 9, 9, 0], [31, 1, 2, 5]])
    k, v = pool.get_kv(1, slots)
    assert k.shape == v.shape == (2, 4, 2, 4)
    for r in range(2):
        for c in range(4):
            assert torch.equal(k[r, c], pool.k_buffers[1][slots[r, c]])
            assert torch.equal(v[r, c], pool.v_buffers[1][slots[r, c]])


def test_one_decode_slot_per_request_lands_at_its_position() -> None:
    pool = ReqToTokenPool(4, 16)
    pool.write(2, 0, torch.arange(5))
    pool.write_each([2, 0, 3], [5, 0, 7], torch.tensor([40, 41, 42]))
    assert pool.req_to_token[2, :6].tolist() == [0, 1, 2, 3, 4, 40]
    assert pool.req_to_token[0, 0] == 41 and pool.req_to_token[3, 7] == 42
    assert int(pool.req_to_token.count_nonzero()) == 7  # nothing else written


class DecodeRun:
    """Requests decoding over a real KV pool: each step allocates one slot per request, runs
    every layer's attention through one backend and checks it against `naive_causal` over the
    request's keys read back from the pool; counts the backend's pool gathers."""

    def __init__(
        self,
        prompt_lens: list[int],
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        window: int | None = None,
    ):
        """`window`: layer 0's sliding window (a local layer; the others global)."""
        self.gen = torch.Generator().manual_seed(sum(prompt_lens))
        self.layers = [AttentionLayer(i, heads, kv_heads, 8, 8**-0.5, window if i == 0 else None)
                       for i in range(layers)]  # fmt: skip
        self.kv = KVPool(512, layers, kv_heads, 8, torch.float32)
        self.kv._free = self.kv._free[torch.randperm(self.kv.size, generator=self.gen)]
        self.table = ReqToTokenPool(8, 300)
        self.table.alloc()  # row 0 unused: table rows differ from batch positions
        self.lens: dict[int, int] = {}
        self.backend = TorchAttentionBackend()
        self.gathers = 0
        get_kv = self.kv.get_kv

        def counted(layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.gathers += 1
            return get_kv(layer_id, slots)

        self.kv.get_kv = counted  # type: ignore[method-assign]
        for n in prompt_lens:
            self.admit(n)

    def admit(self, prompt_len: int) -> int:
        row = self.table.alloc()
        assert row is not None
        slots = self.kv.alloc(prompt_len)
        assert slots is not None
        self.table.write(row, 0, slots)
        for layer in self.layers:
            k, v = torch.randn(2, prompt_len, layer.num_kv_heads, 8, generator=self.gen)
            self.kv.set_kv(layer.layer_id, slots, k, v)
        self.lens[row] = prompt_len
        return row

    def step(self, rows: list[int]) -> None:
        slots = self.kv.alloc(len(rows))
        assert slots is not None
        self.table.write_each(rows, [self.lens[r] for r in rows], slots)
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.zeros(len(rows), dtype=torch.int64),
            positions=torch.zeros(3, len(rows), dtype=torch.int64),
            out_cache_loc=slots,
            req_pool_indices_list=list(rows),
            prefix_lens_list=[self.lens[r] for r in rows],
            extend_lens_list=[1] * len(rows),
            req_pool=self.table,
            kv_pool=self.kv,
        )
        for layer in self.layers:
            q, k, v = (
                torch.randn(len(rows), h * 8, generator=self.gen)
                for h in (layer.num_heads, layer.num_kv_heads, layer.num_kv_heads)
            )
            out = self.backend.forward(q, k, v, layer, batch).view(len(rows), -1, 8)
            for i, row in enumerate(rows):
                keys = self.table.req_to_token[row, : self.lens[row] + 1]
                keys = keys[-layer.sliding_window :] if layer.sliding_window else keys
                k_all = self.kv.k_buffers[layer.layer_id][keys]
                v_all = self.kv.v_buffers[layer.layer_id][keys]
                expected = naive_causal(q[i].view(1, -1, 8), k_all, v_all, layer.scaling)
                assert_within_rounding(out[i : i + 1], expected, terms=8 + 2 * len(keys))
        for row in rows:
            self.lens[row] += 1


def test_steady_decode_reads_no_pool_slot_and_attends_over_every_key() -> None:
    """The first step of a batch gathers each layer's keys once; while the same requests keep
    decoding, each step only appends its new key, and every step still attends over exactly
    the request's keys (the pool's, new ones included)."""
    run = DecodeRun([5, 17, 9])
    rows = list(run.lens)
    run.step(rows)
    assert run.gathers == len(run.layers)
    for _ in range(4):
        run.step(rows)
    assert run.gathers == len(run.layers)


def test_decode_batch_that_changes_rebuilds_from_the_pool() -> None:
    """A request leaving, a request joining, the order changing, an extend between two steps
    and a step cut short each make the next step read the pool again, and attention stays
    exact throughout."""
    run = DecodeRun([5, 17, 9])
    a, b, c = list(run.lens)
    run.step([a, b, c])
    for rows in ([a, c], [a, c, run.admit(3)], [c, a]):
        before = run.gathers
        run.step(rows)
        assert run.gathers == before + len(run.layers)
    run.backend.running.reset()  # what an extend forward does
    before = run.gathers
    run.step([c, a])
    assert run.gathers == before + len(run.layers)
    run.backend.running._blocks.layers_done = 1  # a step that stopped after its first layer
    run.step([c, a])
    assert run.gathers == before + 2 * len(run.layers)


def test_decode_blocks_grow_past_their_capacity() -> None:
    """A request outgrowing the kept columns gets larger blocks, rebuilt from the pool."""
    run = DecodeRun([254, 7], layers=1)
    rows = list(run.lens)
    for _ in range(4):  # lengths 255..258 cross the 256-column capacity
        run.step(rows)
    assert run.gathers == 2


def test_decode_blocks_past_their_budget_take_the_gathering_path() -> None:
    """With no room for kept blocks every step gathers from the pool, and stays exact."""
    run = DecodeRun([5, 17, 9])
    run.backend.running.max_bytes = 0
    rows = list(run.lens)
    for _ in range(3):
        run.step(rows)
    assert run.gathers == 3 * len(run.layers)
    assert run.backend.running._blocks is None


@pytest.mark.parametrize("gather", [False, True], ids=["kept_blocks", "gathering"])
def test_decode_in_a_local_layer_sees_only_its_window(gather: bool) -> None:
    """Layer 0 with a sliding window of 6: each decode query attends over its request's last 6
    keys only (requests shorter and longer than the window), through the kept blocks and
    through the gathering path; layer 1 stays global."""
    run = DecodeRun([3, 17, 9], window=6)
    if gather:
        run.backend.running.max_bytes = 0
    rows = list(run.lens)
    for _ in range(4):
        run.step(rows)


def naive_visible(q, k, v, scale: float, visible: torch.Tensor) -> torch.Tensor:
    """Attention of q [n, H, D] over k/v [s, Hkv, D] where visible[i, j] says query i sees j."""
    n, heads, _ = q.shape
    out = torch.empty_like(q)
    for i in range(n):
        for h in range(heads):
            g = h // (heads // k.shape[1])
            keys = visible[i].nonzero()[:, 0]
            weights = torch.softmax(k[keys, g] @ q[i, h] * scale, dim=0)
            out[i, h] = weights @ v[keys, g]
    return out


@pytest.mark.parametrize("window", [None, 4, 9])
@pytest.mark.parametrize("new,total", [(14, 14), (9, 14)])
def test_extend_with_a_window_and_bidirectional_items(window, new: int, total: int) -> None:
    """Query i sees key j when j <= i and i - j < window, or j lies in i's item: two items,
    [5, 8) and [10, 13), written out key by key; with a cached prefix the chunk starts at
    position 5 (the first item's start)."""
    torch.manual_seed(total + new)
    layer = AttentionLayer(0, 4, 2, 8, 8**-0.5, sliding_window=window)
    q = torch.randn(new, 4, 8)
    k, v = torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    spans = torch.zeros(total, 2, dtype=torch.int32)
    spans[5:8], spans[10:13] = torch.tensor([5, 8]), torch.tensor([10, 13])
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    visible |= (j >= spans[:, :1]) & (j < spans[:, 1:])
    expected = naive_visible(q, k, v, layer.scaling, visible[total - new :])
    out = _attend(q, k, v, layer, spans[total - new :])
    assert_within_rounding(out, expected, terms=8 + 2 * total)
