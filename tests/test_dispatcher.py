"""tokenizer_manager/dispatcher.py: the routing policies (pure), the per-replica prefix tree and
the dispatcher that keeps each replica's view."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.io_struct import PrefixCut, prefix_digest
from runtime.memory_pool import KVPool
from scheduler.radix_cache import RadixCache
from tokenizer_manager.dispatcher import (
    Balance,
    Dispatcher,
    PrefixTree,
    Route,
    cache_aware,
    common_prefix,
    round_robin,
    shortest_queue,
)

PAD = 1_000_000 + 12345  # an image pad value (MM_PAD_SHIFT_VALUE + digest bits)
OTHER_PAD = 1_000_000 + 67890  # another image's


def test_common_prefix_agrees_with_a_plain_scan() -> None:
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(9))]
        plain = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == plain


def test_the_tree_matches_the_longest_prefix_it_was_given() -> None:
    tree = PrefixTree(max_tokens=1000)
    tree.insert([1, 2, 3, 4, 5])
    tree.insert([1, 2, 9])
    assert tree.tokens == 6  # 1 2 | 3 4 5 | 9
    assert tree.match([1, 2, 3, 4, 5, 6]) == 5
    assert tree.match([1, 2, 3, 7]) == 3
    assert tree.match([1, 2, 9, 9]) == 3
    assert tree.match([2, 1]) == 0
    assert tree.match([1]) == 1


def test_image_pad_values_are_part_of_the_key() -> None:
    """The same text around another image shares only the text before the image."""
    tree = PrefixTree(max_tokens=1000)
    prompt = [7, 8, *[PAD] * 16, 9, 10]
    tree.insert(prompt)
    assert tree.match(prompt) == len(prompt)
    assert tree.match([7, 8, *[OTHER_PAD] * 16, 9, 10]) == 2


def test_the_tree_forgets_least_recently_used_branches_past_its_bound() -> None:
    tree = PrefixTree(max_tokens=30)
    old, warm, new = [1] + [10] * 10, [2] + [20] * 10, [3] + [30] * 10
    tree.insert(old)
    tree.insert(warm)
    tree.insert(old)  # old is used again: warm is now the least recently used
    tree.insert(new)  # 33 tokens > 30: forget down to 27
    assert tree.tokens <= 27
    assert tree.match(warm) == 0
    assert tree.match(old) == len(old) and tree.match(new) == len(new)


def test_a_shared_prefix_outlives_its_branches() -> None:
    tree = PrefixTree(max_tokens=20)
    system = list(range(8))
    tree.insert([*system, 100, 101])
    tree.insert([*system, 200, 201])
    tree.insert([*system, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310])
    assert tree.tokens <= 18
    assert tree.match([*system, 999]) == len(system)  # the prefix everyone shares stays
    tree.clear()
    assert tree.tokens == 0 and tree.match(system) == 0


def test_round_robin_skips_replicas_that_are_down() -> None:
    up = [True, False, True]
    assert [round_robin(t, up) for t in range(4)] == [0, 2, 2, 0]
    with pytest.raises(LookupError):
        round_robin(0, [False, False])


def test_shortest_queue_takes_the_least_loaded_serving_replica() -> None:
    assert shortest_queue([50, 10, 10], [True, True, True]) == 1  # ties: the lowest index
    assert shortest_queue([50, 10, 5], [True, True, False]) == 1


def test_cache_aware_follows_the_longest_match_while_loads_are_balanced() -> None:
    b = Balance(cache_threshold=0.3, abs_tokens=100, rel=1.5)
    up = [True, True]
    assert cache_aware([0, 80], [90, 0], [0, 500], up, 100, b) == 1
    assert cache_aware([80, 0], [90, 0], [500, 0], up, 100, b) == 0  # 90 apart: balanced
    # out of balance (abs and rel both past): the least loaded, whatever it caches
    assert cache_aware([80, 0], [400, 0], [500, 0], up, 100, b) == 1
    assert cache_aware([80, 0], [400, 299], [500, 0], up, 100, b) == 0  # 400 < 1.5 x 299
    # a match of no more than 30% of the prompt counts as none: least loaded, then most room
    assert cache_aware([30, 0], [10, 10], [500, 100], up, 100, b) == 1
    assert cache_aware([0, 0], [0, 0], [0, 0], up, 100, b) == 0
    assert cache_aware([90, 0], [0, 0], [100, 0], [False, True], 100, b) == 1


def test_a_resent_conversation_stays_where_its_prefix_is() -> None:
    """cache_aware: each turn (the previous turns, their answers, a new question, the image
    resent) goes to the replica the first went to, and another image's conversation to the
    idle replica; round_robin does not keep them."""
    for policy, kept in (("cache_aware", True), ("round_robin", False)):
        d = Dispatcher(2, policy, tree_tokens=10_000)
        ids, where = [1, 2, *[PAD] * 20, 3], []
        for turn in range(3):
            where.append(d.choose(ids))
            d.sent(where[-1], ids)
            d.progressed(where[-1], 2)
            ids = [*ids, 40 + turn, 41]
            d.ended(where[-1], ids, len(ids))
            ids = [*ids, 5, 6]
        assert (where == [where[0]] * 3) is kept, policy
    d = Dispatcher(2, "cache_aware", tree_tokens=10_000)
    first = [1, 2, *[PAD] * 20, 3]
    d.sent(d.choose(first), first)
    d.ended(0, first, len(first))  # both idle now
    assert d.choose([*first, 4]) == 0
    assert d.choose([1, 2, *[OTHER_PAD] * 20, 3, 4]) == 1  # its image is cached nowhere


def test_a_request_may_name_its_replica_or_keep_to_its_session() -> None:
    d = Dispatcher(3, "round_robin", tree_tokens=100)
    assert d.choose([1], Route(rank=2)) == 2
    first = d.choose([1], Route(session="s"))
    assert [d.choose([1], Route(session="s")) for _ in range(3)] == [first] * 3
    d.set_up(first, False)
    moved = d.choose([1], Route(session="s"))
    assert moved != first and d.choose([1], Route(session="s")) == moved
    with pytest.raises(LookupError):
        d.choose([1], Route(rank=first))


def test_the_dispatcher_counts_load_and_routed_requests() -> None:
    d = Dispatcher(2, "shortest_queue", tree_tokens=100)
    r = d.choose([1, 2, 3])
    d.sent(r, [1, 2, 3])
    d.progressed(r, 2)
    assert d.info(r) == {
        "up": True, "routed": 1, "in_flight": 1, "load_tokens": 5, "tree_tokens": 0
    }  # fmt: skip
    assert d.choose([4]) != r  # the other one is idle
    d.ended(r, [1, 2, 3, 7, 8], 5)
    assert d.info(r)["load_tokens"] == 0 and d.info(r)["in_flight"] == 0
    with pytest.raises(ValueError, match="dp-policy"):
        Dispatcher(2, "random", tree_tokens=100)


def test_a_lost_replica_takes_nothing_and_starts_empty_when_back() -> None:
    """`lost`: the replica is skipped, its load and in-flight count and its tree are reset (its
    requests ended with it); `set_up(True)` takes it back."""
    d = Dispatcher(2, "cache_aware", tree_tokens=100)
    d.sent(1, [5, 6, 7])
    d.progressed(1, 4)
    d.lost(1)
    assert d.info(1) == {
        "up": False, "routed": 1, "in_flight": 0, "load_tokens": 0, "tree_tokens": 0
    }  # fmt: skip
    assert {d.choose([5, 6, 7]) for _ in range(3)} == {0}
    with pytest.raises(LookupError):
        d.choose([5], Route(rank=1))
    d.set_up(1, True)
    assert d.choose([9], Route(rank=1)) == 1 and d.replicas[1].tree.match([5, 6, 7]) == 0


def test_one_replica_or_another_policy_keeps_no_prefix_tree() -> None:
    """The trees decide only for cache_aware over two replicas or more: with one replica (the
    default server) or another policy, no request pays for inserting its tokens."""
    for size, policy in ((1, "cache_aware"), (2, "round_robin"), (2, "shortest_queue")):
        dispatcher = Dispatcher(size, policy, tree_tokens=1000)
        assert not dispatcher.tracks_prefixes
        dispatcher.sent(0, [1, 2, 3])
        dispatcher.ended(0, [1, 2, 3, 4], load=4)
        assert dispatcher.replicas[0].tree.tokens == 0
    two = Dispatcher(2, "cache_aware", tree_tokens=1000)
    two.sent(0, [1, 2, 3])
    assert two.tracks_prefixes and two.replicas[0].tree.tokens == 3


def cut_of(ids: list[int], depth: int) -> PrefixCut:
    return PrefixCut(depth, ids[depth], prefix_digest(ids[: depth + 1]))


def test_a_reported_eviction_cuts_that_branch_only() -> None:
    """A cut removes whatever extends the prefix it names, at an edge's start or inside one;
    the other branches and the shared part stay; a prefix the tree lacks changes nothing."""
    tree = PrefixTree(max_tokens=1000)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 7, 8]
    tree.insert(a)
    tree.insert(b)
    assert tree.cut(cut_of([1, 2, 3, 4, 9], 4)) == 0  # not held: [1 2 3 4] then 9
    assert tree.cut(cut_of([5, 2, 7], 2)) == 0  # the token 7 at depth 2, but another path
    assert tree.cut(cut_of(a, 4)) == 2  # inside the edge 3 4 5 6
    assert tree.match(a) == 4 and tree.match(b) == 4 and tree.tokens == 6
    assert tree.cut(cut_of(b, 2)) == 2  # at the edge 7 8's start
    assert tree.match(b) == 2 and tree.match(a) == 4 and tree.tokens == 4
    assert tree.cut(cut_of(a, 0)) == 4 and tree.tokens == 0 and tree.match(a) == 0


def test_the_tree_follows_a_radix_cache_that_evicts() -> None:
    """Random prompts go into a replica's radix cache and into the dispatcher's tree (bound far
    above the pool); the radix cache evicts under pressure and reports its cuts: after each, the
    tree matches every prompt exactly as far as the radix cache does (without the cuts it would
    claim the evicted prefixes)."""
    rng = random.Random(7)
    pool = KVPool(200, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    radix, tree = RadixCache(pool), PrefixTree(max_tokens=10**6)
    radix.report_evictions = True
    prompts: list[list[int]] = []
    for _ in range(120):
        base = rng.choice(prompts) if prompts and rng.random() < 0.6 else []
        ids = base[: rng.randrange(len(base) + 1)] + [rng.randrange(4) for _ in range(12)]
        if pool.available_size < len(ids):
            radix.evict(len(ids) - pool.available_size)
            for cut in radix.take_evicted():
                tree.cut(cut)
        slots = pool.alloc(len(ids))
        pool.free(slots[: radix.insert(ids, slots)])
        tree.insert(ids)
        prompts.append(ids)
        for p in prompts:
            assert tree.match(p) == radix.match_prefix(p).slots.numel()
    assert tree.tokens == radix.total_cached_tokens() < 200


def test_the_dispatcher_applies_cuts_where_it_keeps_trees() -> None:
    """`evicted`: the replica's tree forgets the prefix, so a resent prompt is no longer sent
    after a ghost (the replicas then balance); a replica that is down, or a dispatcher that
    keeps no trees, ignores the report."""
    d = Dispatcher(2, "cache_aware", tree_tokens=1000)
    prompt = list(range(40))
    d.sent(0, prompt)
    d.ended(0, prompt, load=len(prompt))
    d.sent(1, [99])
    d.ended(1, [99], load=1)
    assert d.choose(prompt) == 0
    d.evicted(0, [cut_of(prompt, 0)])
    assert d.replicas[0].tree.tokens == 0 and d.choose(prompt) == 0  # ties: the smaller tree
    d.sent(0, prompt)
    d.evicted(1, [cut_of([99], 0)])
    assert d.replicas[1].tree.tokens == 0 and d.choose(prompt) == 0
    d.lost(0)
    d.evicted(0, [cut_of(prompt, 0)])  # nothing to cut in an empty tree: no error
    rr = Dispatcher(2, "round_robin", tree_tokens=1000)
    rr.evicted(0, [cut_of(prompt, 0)])
    assert rr.replicas[0].tree.tokens == 0
