"""Prefill budget rules, retraction and preemption choices, the token budget (pure)."""

from __future__ import annotations

from runtime.token_budget import TokenBudget
from scheduler import schedule_policy as policy
from scheduler.schedule_policy import (
    IN_BATCH_SHARE_TOKENS,
    PrefillAdder,
    batch_sharer,
    decode_reserve,
    may_share,
)


def adder(total: int = 1000, inp: int = 500, chunk: int = 64, reqs: int = 8) -> PrefillAdder:
    return PrefillAdder(rem_total=total, rem_input=inp, chunk_size=chunk, rem_reqs=reqs)


def test_whole_requests_until_input_budget() -> None:
    a = adder(inp=100)
    assert a.add(40, 0, arrival=1) == 40
    assert a.add(40, 0, arrival=2) == 40
    assert a.add(40, 0, arrival=3) is None  # would be cut into a batch whose prompts end
    b = adder(inp=100)
    assert b.add(120, 0) == 64  # alone, a long prompt is cut at the chunk size
    assert b.add(5, 0) is None  # nothing may follow a chunked request


def test_no_request_is_cut_into_a_batch_where_a_prompt_ends() -> None:
    """The rest of a chunked prompt (or a whole short one) ends in this batch: the next long
    prompt starts in the next batch, so the finished one's first token does not wait for its
    first chunk. A whole request still joins."""
    a = adder(inp=500, chunk=64)
    assert a.add(30, 0, arrival=1) == 30  # the end of a chunked prompt
    assert a.add(100, 0, arrival=2) is None  # would be cut
    b = adder(inp=500, chunk=64)
    assert b.add(30, 0, arrival=1) == 30
    assert b.add(20, 0, arrival=2) == 20  # whole: it ends here too
    c = adder(total=40, chunk=64)
    assert c.add(10, 0, arrival=1) == 10
    assert c.add(50, 0, arrival=2) is None  # too little KV for all of it: not cut in here either


def test_a_later_arrival_that_ends_first_never_holds_an_earlier_one_back() -> None:
    """The "lpm" order puts a newer cached prompt ahead of an older long one: the older one is
    still cut into the batch, or a stream of cached short prompts could starve it."""
    a = adder(inp=500, chunk=64)
    assert a.add(20, 0, arrival=9) == 20
    assert a.add(100, 0, arrival=3) == 64


def test_long_prompt_is_chunked_at_chunk_size() -> None:
    a = adder(chunk=64)
    assert a.add(150, 10) == 64
    assert a.chunked


def test_reserve_for_decode_counts_against_total() -> None:
    a = adder(total=49)
    assert a.add(30, 40) == 29  # 30 + reserve 20 does not fit: a chunk that leaves the reserve
    b = adder(total=60)
    assert b.add(30, 40) == 30  # 30 + reserve 20 fits
    assert b.rem_total == 60 - 30 - decode_reserve(40)


def test_chunk_when_kv_is_short() -> None:
    a = adder(total=20)
    assert a.add(50, 8) == 16  # room = total - reserve(8)=4
    assert a.chunked


def test_request_slots_limit() -> None:
    a = adder(reqs=1)
    assert a.add(5, 0) == 5
    assert a.add(5, 0) is None


def test_no_room_at_all() -> None:
    assert adder(total=0).add(10, 0) is None
    assert adder(inp=0).add(10, 0) is None


def test_reserve_is_clipped() -> None:
    assert decode_reserve(10**6) == decode_reserve(512)


def held(*token_lists: list[int]) -> list[tuple[list[int], int]]:
    return [(tokens, len(tokens)) for tokens in token_lists]


def test_batch_sharer_finds_a_request_that_computes_the_same_start() -> None:
    key = list(range(100, 140)) + [7, 8]
    other = list(range(100, 140)) + [9]
    assert batch_sharer(key, 0, held([1, 2, 3], other)) == 1
    assert batch_sharer(key, 8, held(other)) == 0  # what comes after the cached tokens


def test_batch_sharer_needs_the_whole_window_and_the_cached_head() -> None:
    key = list(range(100, 140))
    short = [(key, IN_BATCH_SHARE_TOKENS - 1)]  # holds too few of them after this step
    assert batch_sharer(key, 0, short) is None
    assert batch_sharer(key, 10, held(key)) is None  # fewer than the window left to compute
    differs = [0, *key[1:]]  # the same window after a different head
    assert batch_sharer(key, 1, held(differs)) is None
    assert batch_sharer(key, 0, []) is None


def test_may_share_is_false_only_where_no_sharer_can_exist() -> None:
    """The cheap check before the tree match: False exactly when no batch member holds the
    key's first window, so batch_sharer finds nobody at any cached length."""
    key = list(range(100, 150))
    batches = [held(key), held([0, *key[1:]]), [(key, IN_BATCH_SHARE_TOKENS - 1)], held([1, 2])]
    for computed in batches:
        if not may_share(key, computed):
            assert all(batch_sharer(key, c, computed) is None for c in range(len(key)))
    assert may_share(key, held(key)) and not may_share(key, held([0, *key[1:]]))
    assert not may_share(key[: IN_BATCH_SHARE_TOKENS - 1], held(key))


CAP, WAITED, H = policy.MAX_RETRACTIONS, policy.PREEMPT_AFTER_STEPS, policy.Holder


def test_decode_retracts_the_largest_holder_not_the_newest() -> None:
    holders = [H(900, 1, 0), H(30, 5, 0), H(900, 3, 0), H(10, 9, 0)]
    assert policy.retraction_victim(holders) == 2  # the most KV; of two, the newer arrival
    assert policy.retraction_victim([]) is None


def test_a_request_retracted_often_enough_goes_only_when_nothing_else_can() -> None:
    tired = H(900, 1, CAP)
    assert policy.retraction_victim([tired, H(20, 2, 0)]) == 1
    assert policy.retraction_victim([tired, H(20, 2, CAP)]) == 0  # decode never stalls


def test_admission_takes_kv_only_after_waiting_and_only_from_a_bigger_holder() -> None:
    victim = policy.admission_victim
    holders = [H(400, 1, 0), H(900, 2, 0), H(60, 3, 0)]
    assert victim(28, WAITED - 1, holders) is None  # not yet
    assert victim(28, WAITED, holders) == 1  # the largest
    assert victim(450, WAITED, holders) == 1  # 900 >= 2 x 450
    assert victim(460, WAITED, holders) is None  # nobody holds twice its size
    tired = [H(900, 2, CAP), H(400, 1, 0)]
    assert victim(28, WAITED, tired) == 1
    assert victim(28, WAITED, tired[:1]) is None


def test_a_retracted_request_reserves_and_needs_all_its_remaining_output() -> None:
    assert decode_reserve(3000, retracted=True) == 3000
    assert decode_reserve(3000) == decode_reserve(512)
    a = adder(total=300, chunk=64)
    assert a.add(50, 260, retracted=True) is None  # 50 + 260 > 300: not even a chunk
    assert a.rem_total == 300
    assert a.add(50, 250, retracted=True) == 50
    assert a.rem_total == 0


def test_an_open_adder_fails_only_for_kv() -> None:
    a = adder(total=10, reqs=2)
    assert a.add(30, 100) is None and a.open  # KV is what it lacks
    a.grant(100, slots=0)
    assert a.add(30, 100) == 30
    b = adder(reqs=1)
    assert b.add(5, 0) == 5 and not b.open  # no slot left: nothing else can join


def test_choices_must_fit_the_kv_pool_together() -> None:
    """The n choices share the prompt's KV with the radix cache on (prompt + n x max_tokens),
    each holds its own without it (n x (prompt + max_tokens))."""
    shared, own = TokenBudget(4096, 1000), TokenBudget(4096, 1000, shared_prompt=False)
    assert shared.choices_problem(100, 100, 9) == ""  # 100 + 900
    assert "n=10" in shared.choices_problem(100, 100, 10)  # 100 + 1000
    assert own.choices_problem(100, 100, 5) == ""  # 5 x 200
    assert own.choices_problem(100, 100, 6) != ""
    assert shared.choices_problem(0, 8000, 64) != ""  # refused before the prompt is known
    assert shared.choices_problem(100, 950, 1) == ""  # one choice: `problem`'s rule
    assert shared.room(100, 9) == 100 and own.room(100, 5) == 100
    assert shared.room(100) == 900 == shared.room(100, 1)


def item_chunk(items: list[tuple[int, int]], kv_len: int):  # noqa: ANN201
    """`Req.item_safe_chunk` of a request at `kv_len` whose media runs are `items`."""
    from types import SimpleNamespace

    from scheduler.req import Req

    mm = SimpleNamespace(items=[SimpleNamespace(offsets=[span]) for span in items])
    req = SimpleNamespace(kv_len=kv_len, mm=mm)
    return lambda n: Req.item_safe_chunk(req, n)  # type: ignore[arg-type]


def test_a_chunk_never_ends_inside_a_bidirectional_item() -> None:
    """A chunk end inside an item moves down to the item's start when the item starts in the
    chunk, else on to its end (the item began before: its start cached, or at kv_len); ends
    outside items stay."""
    cut = item_chunk([(10, 26), (30, 46)], kv_len=0)
    assert [cut(n) for n in (5, 10, 11, 25, 26, 29, 31, 46)] == [5, 10, 10, 10, 26, 29, 30, 46]
    at_item = item_chunk([(10, 26)], kv_len=10)
    assert at_item(4) == 16  # the item starts the chunk: all of it
    inside = item_chunk([(10, 26)], kv_len=18)  # a prefix match ended inside the item
    assert inside(3) == 8


def test_the_adder_applies_the_item_rule_to_a_chunk() -> None:
    """Rounded down, a chunk takes less; moved on past the chunk size, it takes the whole item
    if the KV has room, else the request waits; an item running to the prompt's end makes it
    whole."""
    assert adder(chunk=64).add(200, 0, cut=item_chunk([(50, 70)], 0)) == 50
    assert adder(chunk=64).add(200, 0, cut=item_chunk([(0, 80)], 0)) == 80
    assert adder(total=70, chunk=64).add(200, 0, cut=item_chunk([(0, 80)], 0)) is None
    assert adder(chunk=64).add(100, 0, cut=item_chunk([(0, 100)], 0)) == 100
