"""The dispatcher: which data-parallel replica takes a request (--dp, --dp-policy).

The policies are pure functions of what the front end knows about each replica:

- `round_robin`: the next replica that serves, in turn.
- `shortest_queue`: the replica with the fewest tokens in flight (the prompts and outputs so far
  of its requests that have not ended: waiting and running alike).
- `cache_aware` (the default): the replica whose cache holds the longest prefix of the request,
  counted in token ids with the image pad values in them (invariant 21: the same image matches,
  another image never does), so a resent conversation goes back to the replica that holds its
  KV and its images' embeddings. Unless the loads are out of balance (the most loaded replica
  more than `abs_tokens` above the least and more than `rel` times it): then the least loaded.
  A prefix that covers no more than `cache_threshold` of the prompt counts as none: then the
  least loaded, ties to the smallest tree (the most room), then the lowest index.

What a replica caches is approximated by a `PrefixTree` per replica, fed with what was routed
there (the prompt when it is sent, prompt and output when it ends: a finished request's tokens
stay in the replica's radix cache). The replica's entry rank reports each leaf its radix cache
evicts (a `PrefixCut`: depth, first token, digest of the path, riding on its step's outputs to
the detokenizer and on here), and `Dispatcher.evicted` cuts that branch from the replica's
tree, so the tree does not claim a prefix the replica dropped to make room for running
requests. Each tree is also bounded by the replica's KV pool in tokens (its least recently used
branches go first); a flush or a replica's death clears it (`Dispatcher.lost`: it then takes
nothing until its restart is ready, and its requests in flight no longer count). What the tree
still gets wrong (a report in flight, a request sent just before its prefix was evicted) costs
a request sent where its prefix no longer is (it is computed again), never a wrong answer.

A request may name its replica (`data_parallel_rank`) or a session (the `X-Session-Id` header or
the `user` field): a session keeps to the replica its first request went to while that serves.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.io_struct import PrefixCut, prefix_digest

POLICIES = ("cache_aware", "round_robin", "shortest_queue")
MAX_SESSIONS = 1 << 16  # sessions remembered (least recently used forgotten first)
EVICT_TO = 0.9  # a tree over its bound forgets down to this share of it (fewer scans)


@dataclass(frozen=True)
class Balance:
    """cache_aware's thresholds (the load in tokens in flight)."""

    cache_threshold: float = 0.3  # a match must cover more than this share of the prompt
    abs_tokens: int = 4096  # out of balance: max - min load above this ...
    rel: float = 1.5  # ... and max above rel x min


@dataclass(frozen=True)
class Route:
    """What a request says about where it runs: a replica by index, or a session to keep to."""

    rank: int | None = None
    session: str | None = None


# ----------------------------------------------------------------------------- policies


def serving(up: Sequence[bool]) -> list[int]:
    """The indices of the replicas that serve; an error when none does."""
    ups = [i for i, ok in enumerate(up) if ok]
    if not ups:
        raise LookupError("no replica is serving")
    return ups


def round_robin(turn: int, up: Sequence[bool]) -> int:
    """The first serving replica at or after `turn` (mod the count)."""
    serving(up)
    n = len(up)
    return next(i % n for i in range(turn, turn + n) if up[i % n])


def shortest_queue(loads: Sequence[int], up: Sequence[bool]) -> int:
    """The serving replica with the least load, ties to the lowest index."""
    return min(serving(up), key=lambda i: (loads[i], i))


def out_of_balance(loads: Sequence[int], up: Sequence[bool], balance: Balance) -> bool:
    ups = [loads[i] for i in serving(up)]
    low, high = min(ups), max(ups)
    return high - low > balance.abs_tokens and high > low * balance.rel


def cache_aware(
    matched: Sequence[int],
    loads: Sequence[int],
    sizes: Sequence[int],
    up: Sequence[bool],
    prompt_len: int,
    balance: Balance,
) -> int:
    """The replica for a prompt of `prompt_len` tokens of which replica i holds `matched[i]`
    (its tree holds `sizes[i]` tokens, its requests `loads[i]` tokens in flight)."""
    if out_of_balance(loads, up, balance):
        return shortest_queue(loads, up)
    ups = serving(up)
    best = max(ups, key=lambda i: (matched[i], -loads[i], -i))
    if matched[best] > 0 and matched[best] > balance.cache_threshold * prompt_len:
        return best
    return min(ups, key=lambda i: (loads[i], sizes[i], i))


# ----------------------------------------------------------------------------- prefix tree


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix, by slice comparisons (a bisection: C speed on
    long prompts, never a Python loop over every token)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


@dataclass(eq=False)
class _Node:
    key: list[int] = field(default_factory=list)  # the edge's token ids from the parent
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)  # by first token id
    used: int = 0  # when last inserted through (the tree's clock)


class PrefixTree:
    """Token-id prefixes, radix-compressed, at most `max_tokens` of them: an insert past the
    bound forgets least recently used leaves until the tree holds EVICT_TO of it."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.root = _Node()
        self.tokens = 0
        self._clock = itertools.count(1)

    def match(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` the tree holds."""
        node, done = self.root, 0
        while done < len(ids):
            child = node.children.get(ids[done])
            if child is None:
                return done
            same = common_prefix(child.key, ids[done : done + len(child.key)])
            done += same
            if same < len(child.key):
                return done
            node = child
        return done

    def insert(self, ids: Sequence[int]) -> None:
        """Add `ids` (every node on its path becomes the most recently used), then keep the
        bound."""
        now, node, done = next(self._clock), self.root, 0
        while done < len(ids):
            child = node.children.get(ids[done])
            if child is None:
                self._add_leaf(node, list(ids[done:]), now)
                break
            same = common_prefix(child.key, ids[done : done + len(child.key)])
            if same < len(child.key):
                child = self._split(child, same)
            child.used = now
            node, done = child, done + same
        if self.tokens > self.max_tokens:
            self.evict(int(self.max_tokens * EVICT_TO))

    def evict(self, keep: int) -> None:
        """Forget least recently used leaves until at most `keep` tokens remain."""
        heap = [(n.used, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.tokens > keep and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.tokens -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.used, id(parent), parent))

    def cut(self, cut: PrefixCut) -> int:
        """Forget whatever extends the prefix `cut` names (found by its depth, first token and
        digest); returns the tokens forgotten (0 when the tree does not hold it)."""
        depth = cut.depth
        todo = [(child, 0) for child in self.root.children.values()]
        while todo:
            node, start = todo.pop()
            end = start + len(node.key)
            if end <= depth:
                todo += [(child, end) for child in node.children.values()]
            elif node.key[depth - start] == cut.token:
                if prefix_digest(self._path(node)[: depth + 1]) == cut.digest:
                    return self._drop(node, depth - start)
        return 0

    def clear(self) -> None:
        self.root, self.tokens = _Node(), 0

    def _path(self, node: _Node) -> list[int]:
        """The token ids from the root to the end of `node`'s edge."""
        keys, path = [], []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        for key in reversed(keys):
            path.extend(key)
        return path

    def _drop(self, node: _Node, at: int) -> int:
        """Remove `node`'s edge from its `at`-th token on, and everything below it."""
        if at:
            self._split(node, at)  # `node` keeps the lower part
        del node.parent.children[node.key[0]]
        gone, todo = 0, [node]
        while todo:
            below = todo.pop()
            gone += len(below.key)
            todo += below.children.values()
        self.tokens -= gone
        return gone

    def _add_leaf(self, parent: _Node, key: list[int], now: int) -> None:
        parent.children[key[0]] = _Node(key, parent, used=now)
        self.tokens += len(key)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` tokens; the new upper node is returned."""
        upper = _Node(child.key[:at], child.parent, used=child.used)
        child.parent.children[upper.key[0]] = upper
        child.key, child.parent = child.key[at:], upper
        upper.children[child.key[0]] = child
        return upper

    def _leaves(self) -> list[_Node]:
        leaves, todo = [], [self.root]
        while todo:
            node = todo.pop()
            todo += node.children.values()
            if not node.children and node is not self.root:
                leaves.append(node)
        return leaves


# ----------------------------------------------------------------------------- dispatcher


@dataclass
class ReplicaView:
    """What the front end knows of one replica."""

    tree: PrefixTree
    up: bool = True
    load: int = 0  # tokens in flight: prompts and outputs so far of its requests
    routed: int = 0  # requests sent to it
    in_flight: int = 0


class Dispatcher:
    """Chooses each request's replica by `policy` and keeps every replica's view up to date
    (the TokenizerManager tells it what it sent, what came back and what ended)."""

    def __init__(
        self, size: int, policy: str, tree_tokens: int, balance: Balance | None = None
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--dp-policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy, self.balance = policy, balance or Balance()
        self.replicas = [ReplicaView(PrefixTree(tree_tokens)) for _ in range(size)]
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self._turn = itertools.count()

    @property
    def size(self) -> int:
        return len(self.replicas)

    @property
    def tracks_prefixes(self) -> bool:
        """Whether the replicas' prefix trees are kept: only where they decide something (the
        cache-aware policy over two replicas or more), so one replica pays nothing per request."""
        return self.policy == "cache_aware" and self.size > 1

    def choose(self, ids: Sequence[int], route: Route = Route()) -> int:
        """The replica for a prompt of token ids `ids` (pad values in): the one the request
        names, its session's, else the policy's. LookupError when none serves."""
        if route.rank is not None:
            if not self.replicas[route.rank].up:
                raise LookupError(f"replica {route.rank} is not serving")
            return route.rank
        kept = self.sessions.get(route.session) if route.session is not None else None
        replica = kept if kept is not None and self.replicas[kept].up else self._policy(ids)
        if route.session is not None:
            self.sessions[route.session] = replica
            self.sessions.move_to_end(route.session)
            if len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        return replica

    def _policy(self, ids: Sequence[int]) -> int:
        up = [r.up for r in self.replicas]
        if self.size == 1 or self.policy == "round_robin":
            return round_robin(next(self._turn), up)
        loads = [r.load for r in self.replicas]
        if self.policy == "shortest_queue":
            return shortest_queue(loads, up)
        matched = [r.tree.match(ids) if r.up else 0 for r in self.replicas]
        sizes = [r.tree.tokens for r in self.replicas]
        return cache_aware(matched, loads, sizes, up, len(ids), self.balance)

    def sent(self, replica: int, ids: Sequence[int]) -> None:
        """A request of `ids` went to `replica`."""
        view = self.replicas[replica]
        view.routed += 1
        view.in_flight += 1
        view.load += len(ids)
        if self.tracks_prefixes:
            view.tree.insert(ids)

    def progressed(self, replica: int, tokens: int) -> None:
        """`tokens` more output tokens came back from `replica`."""
        self.replicas[replica].load += tokens

    def ended(self, replica: int, ids: Sequence[int], load: int) -> None:
        """A request ended: its `load` tokens leave the replica's; `ids` (prompt and output)
        are what the replica now caches of it."""
        view = self.replicas[replica]
        view.in_flight -= 1
        view.load -= load
        if self.tracks_prefixes and view.up:
            view.tree.insert(ids)

    def set_up(self, replica: int, up: bool) -> None:
        """A replica stopped (or started again) serving: its tree starts empty either way."""
        self.replicas[replica].up = up
        self.replicas[replica].tree.clear()

    def lost(self, replica: int) -> None:
        """A replica died: nothing goes to it until `set_up(replica, True)`, and what was in
        flight there no longer counts (those requests ended with it)."""
        self.set_up(replica, False)
        self.replicas[replica].load = 0
        self.replicas[replica].in_flight = 0

    def evicted(self, replica: int, cuts: Sequence[PrefixCut]) -> None:
        """`replica`'s radix cache evicted these prefixes: its tree forgets them too."""
        view = self.replicas[replica]
        if self.tracks_prefixes and view.up:
            for cut in cuts:
                view.tree.cut(cut)

    def flushed(self, replica: int) -> None:
        self.replicas[replica].tree.clear()

    def info(self, replica: int) -> dict[str, object]:
        view = self.replicas[replica]
        return {
            "up": view.up,
            "routed": view.routed,
            "in_flight": view.in_flight,
            "load_tokens": view.load,
            "tree_tokens": view.tree.tokens,
        }
