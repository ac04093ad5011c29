"""The radix prefix cache on CPU: matching, splitting, locks, LRU eviction and slot ownership."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from runtime.io_struct import PrefixCut, prefix_digest
from runtime.memory_pool import KVPool
from scheduler.radix_cache import RadixCache, TreeNode

IMG_A, IMG_B = 1_000_123, 1_000_999


def make_pool(size: int = 64) -> KVPool:
    return KVPool(size, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)


def alloc(pool: KVPool, n: int) -> torch.Tensor:
    slots = pool.alloc(n)
    assert slots is not None, f"test pool ran out of slots ({pool.available_size} < {n})"
    return slots


def free_slot_set(pool: KVPool) -> set[int]:
    """The pool's free slots, read through its public API (take them all, give them back)."""
    slots = alloc(pool, pool.available_size)
    pool.free(slots)
    return set(slots.tolist())


def tree_slot_list(cache: RadixCache) -> list[int]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.extend(node.value.tolist())
        stack.extend(node.children.values())
    return out


def path_slots(cache: RadixCache, node: TreeNode) -> list[int]:
    parts = []
    while node is not cache.root:
        parts.append(node.value.tolist())
        assert node.parent is not None
        node = node.parent
    return [slot for part in reversed(parts) for slot in part]


def cache_with_pool(size: int = 64) -> tuple[RadixCache, KVPool]:
    pool = make_pool(size)
    return RadixCache(pool), pool


def insert_fresh(cache: RadixCache, pool: KVPool, key: list[int]) -> torch.Tensor:
    """Insert `key` with new slots like a finished request would; free the duplicates."""
    slots = alloc(pool, len(key))
    already = cache.insert(key, slots)
    pool.free(slots[:already])
    return slots


def assert_idle(cache: RadixCache, pool: KVPool) -> None:
    cache.check_integrity()
    assert cache.protected_size == 0
    assert pool.available_size + cache.evictable_size == pool.size


# ---------------------------------------------------------------------- matching and splitting
def test_insert_and_exact_match() -> None:
    cache, pool = cache_with_pool()
    slots = alloc(pool, 3)
    assert cache.insert([1, 2, 3], slots) == 0
    assert torch.equal(cache.match_prefix([1, 2, 3]).slots, slots)
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).slots, slots)
    miss = cache.match_prefix([9, 1])
    assert miss.slots.numel() == 0 and miss.last_node is cache.root
    assert cache.match_prefix([1, 2, 3]).last_node.key == [1, 2, 3]
    assert cache.evictable_size == 3 and cache.total_cached_tokens() == 3
    cache.check_integrity()


def test_insert_returns_already_cached_length() -> None:
    cache, pool = cache_with_pool()
    insert_fresh(cache, pool, [1, 2, 3])
    again = alloc(pool, 4)
    assert cache.insert([1, 2, 3, 4], again) == 3
    pool.free(again[:3])
    assert cache.evictable_size == 4
    assert_idle(cache, pool)


def test_partial_match_splits_node_and_keeps_sizes() -> None:
    cache, pool = cache_with_pool()
    slots = insert_fresh(cache, pool, [1, 2, 3, 4, 5])
    match = cache.match_prefix([1, 2, 3, 9])
    assert torch.equal(match.slots, slots[:3])
    assert match.last_node.key == [1, 2, 3]
    assert [c.key for c in match.last_node.children.values()] == [[4, 5]]
    assert cache.evictable_size == 5 and cache.total_cached_tokens() == 5
    cache.check_integrity()
    assert cache.insert([1, 2, 3, 7, 8], alloc(pool, 5)) == 3
    assert len(match.last_node.children) == 2


def test_split_of_locked_node_keeps_lock_on_both_parts() -> None:
    cache, pool = cache_with_pool()
    insert_fresh(cache, pool, [1, 2, 3, 4, 5])
    leaf = cache.match_prefix([1, 2, 3, 4, 5]).last_node
    cache.inc_lock_ref(leaf)
    upper = cache.match_prefix([1, 2, 7]).last_node
    assert upper.key == [1, 2] and upper.lock_ref == 1 and leaf.key == [3, 4, 5]
    assert cache.protected_size == 5 and cache.evictable_size == 0
    cache.check_integrity()
    cache.dec_lock_ref(leaf)
    assert_idle(cache, pool)


def test_image_pad_values_share_only_the_text_before_the_image() -> None:
    cache, pool = cache_with_pool()
    first = insert_fresh(cache, pool, [1, 2, IMG_A, IMG_A, 5])
    second = alloc(pool, 5)
    assert cache.insert([1, 2, IMG_B, IMG_B, 5], second) == 2
    pool.free(second[:2])
    match = cache.match_prefix([1, 2, IMG_B, IMG_B, 5])
    assert match.slots.tolist() == first[:2].tolist() + second[2:].tolist()
    assert cache.match_prefix([1, 2, IMG_A, IMG_B]).slots.numel() == 3
    assert cache.total_cached_tokens() == 8
    assert_idle(cache, pool)


# ---------------------------------------------------------------------- locks and eviction
def test_lock_moves_sizes_and_protects_the_path() -> None:
    cache, pool = cache_with_pool()
    insert_fresh(cache, pool, [1, 2, 3])
    insert_fresh(cache, pool, [1, 2, 4, 5])
    node = cache.match_prefix([1, 2, 4, 5]).last_node
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert (cache.protected_size, cache.evictable_size) == (4, 1)
    assert cache.evict(100) == 1
    assert cache.match_prefix([1, 2, 4, 5]).slots.numel() == 4
    cache.dec_lock_ref(node)
    assert (cache.protected_size, cache.evictable_size) == (4, 0)
    cache.dec_lock_ref(node)
    assert (cache.protected_size, cache.evictable_size) == (0, 4)
    assert cache.evict(100) == 4
    assert pool.available_size == pool.size
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node)


def test_eviction_is_lru_over_leaves() -> None:
    cache, pool = cache_with_pool()
    insert_fresh(cache, pool, [1, 2, 3])
    insert_fresh(cache, pool, [4, 5, 6])
    insert_fresh(cache, pool, [7, 8])
    cache.match_prefix([1, 2, 3])  # the oldest entry is used again, so [4, 5, 6] is now oldest
    assert cache.evict(1) == 3
    assert cache.match_prefix([4, 5, 6]).slots.numel() == 0
    assert cache.evict(1) == 2
    assert cache.match_prefix([7, 8]).slots.numel() == 0
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 3
    assert_idle(cache, pool)


def test_evicting_leaves_makes_their_parent_evictable() -> None:
    cache, pool = cache_with_pool()
    insert_fresh(cache, pool, [1, 2, 3, 4])
    insert_fresh(cache, pool, [1, 2, 5, 6])
    assert cache.evict(4) == 4
    assert cache.match_prefix([1, 2, 3]).last_node.key == [1, 2]
    assert cache.evictable_size == 2
    assert cache.evict(1) == 2
    assert cache.total_cached_tokens() == 0 and pool.available_size == pool.size
    insert_fresh(cache, pool, [1, 2, 3, 4])
    insert_fresh(cache, pool, [1, 2, 5, 6])
    assert cache.evict(5) == 6, "the parent joins the candidates once its children are gone"
    assert_idle(cache, pool)


def test_locked_leaf_keeps_its_parent() -> None:
    cache, pool = cache_with_pool()
    insert_fresh(cache, pool, [1, 2, 3])
    insert_fresh(cache, pool, [1, 2, 4])
    node = cache.match_prefix([1, 2, 4]).last_node
    cache.inc_lock_ref(node)
    assert cache.evict(10) == 1
    assert cache.total_cached_tokens() == 3
    cache.dec_lock_ref(node)
    assert_idle(cache, pool)


def test_reset_frees_everything_but_refuses_while_locked() -> None:
    cache, pool = cache_with_pool()
    insert_fresh(cache, pool, [1, 2, 3])
    node = cache.match_prefix([1, 2]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert pool.available_size == pool.size and cache.total_cached_tokens() == 0
    assert (cache.evictable_size, cache.protected_size) == (0, 0)
    cache.check_integrity()


# ---------------------------------------------------------------------- request lifecycle
def run_chunks(
    cache: RadixCache, pool: KVPool, tokens: list[int], chunk: int
) -> tuple[torch.Tensor, TreeNode]:
    """Admit a request and prefill it chunk by chunk, as the scheduler does."""
    match = cache.match_prefix(tokens)
    row, node = match.slots.clone(), match.last_node
    cache.inc_lock_ref(node)
    while row.numel() < len(tokens):
        n = min(chunk, len(tokens) - row.numel())
        row = torch.cat((row, alloc(pool, n)))
        row, node = cache.cache_unfinished_req(tokens[: row.numel()], row, node)
        assert cache.protected_size >= row.numel()
    return row, node


def test_chunked_request_leaves_no_lock_and_no_leak() -> None:
    cache, pool = cache_with_pool(32)
    prompt = [5, 6, 7, IMG_A, IMG_A, IMG_A, 8, 9, 10, 11]
    row, node = run_chunks(cache, pool, prompt, chunk=4)
    assert row.numel() == 10 and cache.protected_size == 10
    decoded = alloc(pool, 3)  # three decode steps write KV the tree does not know yet
    tokens = prompt + [20, 21, 22]
    cache.cache_finished_req(tokens, torch.cat((row, decoded)), node)
    assert cache.evictable_size == 13
    assert_idle(cache, pool)
    assert cache.evict(pool.size) == 13 and pool.available_size == pool.size


def test_same_prefix_twice_frees_the_second_copy() -> None:
    cache, pool = cache_with_pool(32)
    prompt = [1, 2, 3, 4, 5, 6]
    rows = {}
    for rid in "ab":  # both admitted before either is cached: neither matches anything
        rows[rid] = (alloc(pool, 6), cache.match_prefix(prompt).last_node)
    cache.cache_finished_req(prompt, *rows["a"])
    assert pool.available_size == 32 - 12 and cache.evictable_size == 6
    b_slots, b_node = rows["b"]
    cache.cache_finished_req(prompt + [7], torch.cat((b_slots, alloc(pool, 1))), b_node)
    assert cache.evictable_size == 7, "b adds only its decoded token"
    assert pool.available_size == 32 - 7, "b's copy of the prompt went back to the pool"
    assert cache.match_prefix(prompt).slots.tolist() == rows["a"][0].tolist()
    assert_idle(cache, pool)


def test_request_admitted_on_a_shorter_prefix_frees_only_its_duplicates() -> None:
    cache, pool = cache_with_pool(32)
    insert_fresh(cache, pool, [1, 2, 3])
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.inc_lock_ref(match.last_node)
    row = torch.cat((match.slots, alloc(pool, 3)))  # c computes 4, 5, 6 itself
    insert_fresh(cache, pool, [1, 2, 3, 4, 5])  # meanwhile someone caches 4, 5
    free_before = pool.available_size
    new_row, node = cache.cache_unfinished_req([1, 2, 3, 4, 5, 6], row, match.last_node)
    assert pool.available_size == free_before + 2, "c's own slots for 4 and 5 are duplicates"
    assert new_row[:5].tolist() == cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist()
    assert new_row[5] == row[5] and cache.protected_size == 6
    cache.cache_finished_req([1, 2, 3, 4, 5, 6], new_row, node)
    assert_idle(cache, pool)


def test_request_that_does_not_start_with_its_prefix_is_refused() -> None:
    cache, pool = cache_with_pool()
    insert_fresh(cache, pool, [1, 2, 3])
    match = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(match.last_node)
    with pytest.raises(ValueError):
        cache.cache_finished_req([1, 2, 3, 4], alloc(pool, 4), match.last_node)
    with pytest.raises(ValueError):
        cache.cache_finished_req([1, 9, 3], match.slots, match.last_node)
    cache.check_integrity()


def test_disable_mode_stores_nothing_and_frees_on_finish() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool, disable=True)
    slots = alloc(pool, 4)
    assert cache.insert([1, 2, 3, 4], slots) == 0
    match = cache.match_prefix([1, 2, 3, 4])
    assert match.slots.numel() == 0 and match.last_node is cache.root
    cache.inc_lock_ref(match.last_node)
    row, node = cache.cache_unfinished_req([1, 2, 3, 4], slots, match.last_node)
    assert row is slots and node is cache.root
    assert pool.available_size == 12, "the request still owns its slots"
    cache.cache_finished_req([1, 2, 3, 4, 5], torch.cat((row, alloc(pool, 1))), node)
    assert pool.available_size == 16
    assert (cache.evictable_size, cache.protected_size, cache.total_cached_tokens()) == (0, 0, 0)
    assert cache.evict(10) == 0
    cache.check_integrity()


def test_other_page_sizes_are_not_supported() -> None:
    with pytest.raises(NotImplementedError):
        RadixCache(make_pool(), page_size=16)


def test_check_integrity_catches_corruption() -> None:
    cache, pool = cache_with_pool()
    insert_fresh(cache, pool, [1, 2, 3])
    insert_fresh(cache, pool, [1, 2, 4])
    cache._evictable += 1
    with pytest.raises(AssertionError, match="evictable"):
        cache.check_integrity()
    cache._evictable -= 1
    leaf = cache.match_prefix([1, 2, 4]).last_node
    leaf.value = cache.match_prefix([1, 2, 3]).last_node.value.clone()
    with pytest.raises(AssertionError, match="twice"):
        cache.check_integrity()
    leaf.value = torch.tensor([60, 61])
    with pytest.raises(AssertionError, match="slots for"):
        cache.check_integrity()
    leaf.value, leaf.lock_ref = torch.tensor([60]), 1
    with pytest.raises(AssertionError, match="parent"):
        cache.check_integrity()


# ---------------------------------------------------------------------- randomized
STEMS = [[1, 2, 3], [1, 2, IMG_A, IMG_A, IMG_A], [1, 2, IMG_B, IMG_B, IMG_B], [4]]


@dataclass
class SimReq:
    tokens: list[int]
    row: torch.Tensor
    node: TreeNode
    tree_len: int  # row[:tree_len] are the tree's slots; the rest belong to the request


class Sim:
    """Drives the cache like a scheduler would and checks the slot accounting after each step."""

    def __init__(self, seed: int, pool_size: int = 48):
        self.rng = random.Random(seed)
        self.pool = make_pool(pool_size)
        self.cache = RadixCache(self.pool)
        self.reqs: list[SimReq] = []
        self.locks: list[TreeNode] = []

    def tokens(self) -> list[int]:
        tail = [self.rng.choice([5, 6, 7, IMG_A]) for _ in range(self.rng.randint(0, 6))]
        return list(self.rng.choice(STEMS)) + tail

    def take(self, n: int) -> torch.Tensor | None:
        short = n - self.pool.available_size
        if short > 0:
            self.cache.evict(short)
        return self.pool.alloc(n)

    def admit(self) -> None:
        tokens = self.tokens()
        match = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(match.last_node)
        n = match.slots.numel()
        self.reqs.append(SimReq(tokens, match.slots.clone(), match.last_node, n))

    def extend(self, cache_it: bool) -> None:
        req = self.rng.choice(self.reqs)
        n = self.rng.randint(1, 4)
        new = self.take(n)
        if new is None:
            return
        req.row = torch.cat((req.row, new))
        while len(req.tokens) < req.row.numel():
            req.tokens.append(self.rng.choice([5, 6, 8]))
        if cache_it:
            key = req.tokens[: req.row.numel()]
            req.row, req.node = self.cache.cache_unfinished_req(key, req.row, req.node)
            req.tree_len = req.row.numel()

    def finish(self) -> None:
        req = self.reqs.pop(self.rng.randrange(len(self.reqs)))
        self.cache.cache_finished_req(req.tokens[: req.row.numel()], req.row, req.node)

    def insert(self) -> None:
        key = self.tokens()
        slots = self.take(len(key))
        if slots is not None:
            self.pool.free(slots[: self.cache.insert(key, slots)])

    def lock(self) -> None:
        node = self.cache.match_prefix(self.tokens()).last_node
        self.cache.inc_lock_ref(node)
        self.locks.append(node)

    def unlock(self) -> None:
        self.cache.dec_lock_ref(self.locks.pop(self.rng.randrange(len(self.locks))))

    def step(self) -> None:
        ops = [self.admit, self.insert, self.lock, lambda: self.cache.evict(self.rng.randint(1, 9)),
               lambda: self.cache.match_prefix(self.tokens())]
        if self.reqs:
            ops += [lambda: self.extend(True), lambda: self.extend(False), self.finish]
        if self.locks:
            ops.append(self.unlock)
        self.rng.choice(ops)()

    def check(self) -> None:
        self.cache.check_integrity()
        owned = [s for r in self.reqs for s in r.row[r.tree_len :].tolist()]
        in_tree = tree_slot_list(self.cache)
        held = self.pool.available_size + self.cache.evictable_size + self.cache.protected_size
        assert held + len(owned) == self.pool.size
        everything = sorted(in_tree + owned + sorted(free_slot_set(self.pool)))
        assert everything == list(range(1, self.pool.size + 1)), "a slot leaked or is doubled"
        for r in self.reqs:
            assert r.row[: r.tree_len].tolist() == path_slots(self.cache, r.node)

    def drain(self) -> None:
        while self.reqs:
            self.finish()
        while self.locks:
            self.unlock()


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_accounting_exact(seed: int) -> None:
    sim = Sim(seed)
    for _ in range(300):
        sim.step()
        sim.check()
    sim.drain()
    sim.check()
    assert_idle(sim.cache, sim.pool)
    sim.cache.evict(sim.pool.size)
    assert sim.pool.available_size == sim.pool.size and sim.cache.total_cached_tokens() == 0


def test_reported_evictions_name_each_evicted_leaf() -> None:
    """With `report_evictions`, each evicted leaf is kept as a PrefixCut (its depth, its first
    token, the digest of its path up to that token) until `take_evicted`; without, nothing."""
    cache, pool = cache_with_pool()
    insert_fresh(cache, pool, [1, 2, 3, 4])
    insert_fresh(cache, pool, [1, 2, 5, 6])
    cache.evict(1)
    assert cache.take_evicted() == []
    cache.report_evictions = True
    insert_fresh(cache, pool, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 3, 4])  # [1, 2, 5, 6] is the oldest leaf now
    assert cache.evict(1) == 2
    assert cache.take_evicted() == [PrefixCut(2, 5, prefix_digest([1, 2, 5]))]
    assert cache.evict(3) == 4, "the leaf, then its parent once a leaf"
    assert cache.take_evicted() == [
        PrefixCut(2, 3, prefix_digest([1, 2, 3])), PrefixCut(0, 1, prefix_digest([1]))
    ]  # fmt: skip
    assert cache.take_evicted() == []
    assert_idle(cache, pool)
