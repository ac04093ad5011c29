"""EncoderCache: LRU within a byte budget, pins, and hit/miss agreement across TP ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from dist_utils import run_on_ranks

from runtime.distributed import TPGroup
from runtime.multimodal import Modality, MultimodalDataItem
from scheduler.encoder_cache import EncoderCache, agree_on_misses

ROWS, DIM = 4, 8
ENTRY_BYTES = ROWS * DIM * 4  # one float32 embedding of a test item


def item(h: int) -> MultimodalDataItem:
    return MultimodalDataItem(Modality.IMAGE, feature=torch.full((2, 3), float(h)), hash=h)


def embedding(h: int) -> torch.Tensor:
    return torch.full((ROWS, DIM), float(h))


class FakeEncoder:
    """Records each call; returns embeddings that are views of one batch output, like the ViT."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, items: list[MultimodalDataItem]) -> dict[int, torch.Tensor]:
        self.calls.append([it.hash for it in items])
        out = torch.cat([embedding(it.hash) for it in items])
        return {it.hash: emb for it, emb in zip(items, out.split(ROWS))}


@dataclass(frozen=True)
class PeerGroup(TPGroup):
    """A two-rank group whose peer reports `peer_flags` (1 = the peer missed that item)."""

    size: int = 2
    peer_flags: tuple[int, ...] = ()
    reductions: list[list[int]] = field(default_factory=list)

    def all_reduce_cpu(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op == "max"
        self.reductions.append(tensor.tolist())
        return torch.maximum(tensor, torch.tensor(self.peer_flags, dtype=tensor.dtype), out=tensor)


def filled(capacity_entries: int, hashes: list[int]) -> EncoderCache:
    cache = EncoderCache(capacity_entries * ENTRY_BYTES)
    for h in hashes:
        assert cache.put(h, embedding(h))
    return cache


# ---------------------------------------------------------------------- LRU, bytes, pins


def test_lru_evicts_least_recently_used_within_byte_limit() -> None:
    cache = filled(3, [1, 2, 3])
    assert cache.get(1) is not None  # 1 is now the most recent; 2 is the oldest
    cache.put(4, embedding(4))
    assert [h for h in (1, 2, 3, 4) if h in cache] == [1, 3, 4]
    assert cache.bytes == 3 * ENTRY_BYTES <= cache.capacity_bytes
    assert cache.stats().evictions == 1 and cache.stats().entries == 3


def test_byte_limit_with_unequal_sizes() -> None:
    cache = filled(3, [1, 2, 3])
    cache.put(9, torch.zeros(2 * ROWS, DIM))  # two entries' worth: evicts 1 and 2
    assert [h for h in (1, 2, 3, 9) if h in cache] == [3, 9]
    assert cache.bytes == 3 * ENTRY_BYTES


def test_oversized_entry_is_not_stored() -> None:
    cache = filled(2, [1])
    assert not cache.put(7, torch.zeros(3 * ROWS, DIM))
    assert 7 not in cache and 1 in cache and cache.stats().not_stored == 1


def test_view_of_a_batch_output_is_stored_compactly() -> None:
    cache = EncoderCache(10 * ENTRY_BYTES)
    batch = torch.zeros(5 * ROWS, DIM)
    cache.put(1, batch[:ROWS])
    stored = cache.get(1)
    assert stored is not None and stored.untyped_storage().nbytes() == ENTRY_BYTES


def test_pinned_entry_survives_eviction() -> None:
    cache = filled(2, [1, 2])
    cache.acquire(1)  # 1 is the least recent but pinned
    cache.put(3, embedding(3))
    assert 1 in cache and 2 not in cache and 3 in cache
    cache.release(1)
    cache.put(4, embedding(4))
    assert 1 not in cache and cache.stats().pins == 0


def test_pins_that_fill_the_cache_refuse_new_entries_without_evicting() -> None:
    cache = filled(2, [1, 2])
    cache.acquire(1)
    cache.acquire(2)
    assert not cache.put(3, embedding(3))
    assert 1 in cache and 2 in cache and cache.stats().evictions == 0


def test_pin_taken_before_the_entry_exists_and_nested_pins() -> None:
    cache = EncoderCache(ENTRY_BYTES)
    cache.acquire(5)
    cache.acquire(5)
    cache.put(5, embedding(5))
    cache.release(5)
    assert not cache.put(6, embedding(6))  # 5 is still pinned once
    cache.release(5)
    assert cache.put(6, embedding(6)) and 5 not in cache
    with pytest.raises(ValueError, match="not pinned"):
        cache.release(5)


def test_clear_keeps_pinned_entries() -> None:
    cache = filled(3, [1, 2, 3])
    cache.acquire(2)
    cache.clear()
    assert len(cache) == 1 and 2 in cache and cache.bytes == ENTRY_BYTES


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        EncoderCache(-1)


# ---------------------------------------------------------------------- encode_with_cache


def test_second_call_hits_and_outputs_match() -> None:
    cache, enc = EncoderCache(10 * ENTRY_BYTES), FakeEncoder()
    first = cache.encode_with_cache([item(1), item(2)], enc, TPGroup())
    second = cache.encode_with_cache([item(2), item(1)], enc, TPGroup())
    assert enc.calls == [[1, 2]]
    for h in (1, 2):
        assert torch.equal(first[h], embedding(h)) and torch.equal(second[h], embedding(h))
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.items_encoded) == (2, 2, 2)


def test_only_misses_are_encoded() -> None:
    cache, enc = filled(10, [1]), FakeEncoder()
    out = cache.encode_with_cache([item(1), item(2)], enc, TPGroup())
    assert enc.calls == [[2]] and set(out) == {1, 2}


def test_duplicate_hashes_are_encoded_once() -> None:
    cache, enc = EncoderCache(10 * ENTRY_BYTES), FakeEncoder()
    out = cache.encode_with_cache([item(3), item(4), item(3), item(4), item(3)], enc, TPGroup())
    assert enc.calls == [[3, 4]] and set(out) == {3, 4}


def test_capacity_zero_always_encodes_with_the_same_outputs() -> None:
    cached, plain = EncoderCache(10 * ENTRY_BYTES), EncoderCache(0)
    enc_cached, enc_plain = FakeEncoder(), FakeEncoder()
    for _ in range(3):
        a = cached.encode_with_cache([item(1), item(2)], enc_cached, TPGroup())
        b = plain.encode_with_cache([item(1), item(2)], enc_plain, TPGroup())
        assert all(torch.equal(a[h], b[h]) for h in (1, 2))
    assert len(enc_cached.calls) == 1 and len(enc_plain.calls) == 3
    assert len(plain) == 0 and plain.bytes == 0 and plain.stats().hits == 0


def test_no_items_means_no_encode_and_no_collective() -> None:
    group, enc = PeerGroup(peer_flags=()), FakeEncoder()
    assert EncoderCache(ENTRY_BYTES).encode_with_cache([], enc, group) == {}
    assert enc.calls == [] and group.reductions == []


def test_wrap_keeps_the_encoder_signature() -> None:
    cache, enc = EncoderCache(10 * ENTRY_BYTES), FakeEncoder()
    encode = cache.wrap(enc, TPGroup())
    encode([item(1)])
    assert torch.equal(encode([item(1)])[1], embedding(1)) and enc.calls == [[1]]


def test_missing_embedding_from_the_encoder_is_an_error() -> None:
    with pytest.raises(KeyError, match="no embedding"):
        EncoderCache(ENTRY_BYTES).encode_with_cache([item(1)], lambda items: {}, TPGroup())


# ---------------------------------------------------------------------- agreement (fake peer)


def test_local_hit_with_peer_miss_is_encoded_here_too() -> None:
    cache, enc = filled(10, [1, 2]), FakeEncoder()
    group = PeerGroup(peer_flags=(0, 1))  # the peer has item 1 but lacks item 2
    out = cache.encode_with_cache([item(1), item(2)], enc, group)
    assert group.reductions == [[0, 0]]  # both local hits
    assert enc.calls == [[2]] and torch.equal(out[2], embedding(2))
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.peer_misses) == (1, 1, 1)


def test_all_ranks_hit_means_no_encode() -> None:
    cache, enc = filled(10, [1, 2]), FakeEncoder()
    group = PeerGroup(peer_flags=(0, 0))
    cache.encode_with_cache([item(1), item(2)], enc, group)
    assert enc.calls == [] and len(group.reductions) == 1


def test_agreement_is_one_flag_per_unique_item() -> None:
    group = PeerGroup(peer_flags=(1, 0, 0))
    assert agree_on_misses([5, 6, 7], {5, 6}, group) == [5, 7]
    assert group.reductions == [[0, 0, 1]]


def test_single_rank_runs_no_collective() -> None:
    class NoCollective(TPGroup):
        def all_reduce_cpu(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
            raise AssertionError("a one-rank group must not reduce")

    assert agree_on_misses([1, 2], {1}, NoCollective()) == [2]


# ---------------------------------------------------------------------- agreement (real Gloo)


def _two_rank_encode(tp: TPGroup) -> dict[str, object]:
    """Rank 0 has item 11 cached, rank 1 does not. The encoder all-reduces like a TP ViT, so a
    rank that skipped it would leave the other one waiting."""
    calls: list[list[int]] = []

    def encode(items: list[MultimodalDataItem]) -> dict[int, torch.Tensor]:
        calls.append([it.hash for it in items])
        out = {it.hash: tp.all_reduce(embedding(it.hash)) / tp.size for it in items}
        return out

    cache = EncoderCache(10 * ENTRY_BYTES)
    if tp.rank == 0:
        cache.put(11, embedding(11))
    out = cache.encode_with_cache([item(11)], encode, tp)
    again = cache.encode_with_cache([item(11)], encode, tp)
    return {
        "calls": calls,
        "out": out[11].tolist(),
        "again": again[11].tolist(),
        "stats": cache.stats(),
    }


def test_two_gloo_ranks_agree_when_only_one_has_the_item() -> None:
    results = run_on_ranks(_two_rank_encode, 2, timeout=120.0)
    expected = embedding(11).tolist()
    for rank, res in enumerate(results):
        assert res["calls"] == [[11]], f"rank {rank}"
        assert res["out"] == expected and res["again"] == expected
        assert res["stats"].misses == 1 and res["stats"].hits == 1
    assert results[0]["stats"].peer_misses == 1 and results[1]["stats"].peer_misses == 0
