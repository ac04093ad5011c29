"""The radix prefix cache: a tree of token runs whose KV slots can be shared between requests.

Every root-to-node path spells a token sequence (a radix key). Each node holds one edge: a run
of token ids (`key`) and the KV slot indices that hold those tokens (`value`, int64 on CPU).
Token ids include image pad_values (>= MM_PAD_SHIFT_VALUE); to the tree they are plain ints, so
two prompts share KV only up to the first token (or image) where they differ.

Ownership of KV slots (the rule that keeps the pool exact):

* A slot stored in the tree is owned by the tree. The tree frees it (through `kv_pool.free`)
  only when the node holding it is evicted or the tree is reset.
* A slot a request allocated and that is not (yet) in the tree is owned by the request.
* `insert(key, slots)` stores only the part of `key` that was not in the tree yet and takes
  ownership of exactly those slots. It returns the length `n` of the part already present; the
  slots passed for `key[:n]` stay with the caller, who must free them unless they are the very
  slots the tree already holds.
* A request holds a lock on the node that ends its cached prefix (`last_node`). While the lock
  is held that path cannot be evicted, and the request's row starts with the tree's own slots
  for that path. `cache_unfinished_req` / `cache_finished_req` insert the request's tokens,
  free the request's duplicates of what the tree already had, and move or drop that lock, so
  that afterwards the request owns no slot at all.

Evictions may be reported (`report_evictions`, rank 0 of a replica the front end routes to by
prefix): each evicted leaf is kept as a `PrefixCut` (its depth, first token and the digest of
its path up to that token) until `take_evicted`.

Accounting: every slot of the pool is free, owned by a request, evictable (in the tree on an
unlocked node) or protected (in the tree on a locked node). When the server is idle,
`kv_pool.available_size + evictable_size == kv_pool.size`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from runtime.io_struct import PrefixCut, prefix_digest


class SlotFreer(Protocol):
    """What the cache needs from the KV pool: a way to give slots back."""

    def free(self, slots: torch.Tensor) -> None: ...


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def _as_slots(slots: torch.Tensor) -> torch.Tensor:
    return slots.detach().to(device="cpu", dtype=torch.int64).reshape(-1)


def _shared_len(edge: list[int], key: list[int], start: int) -> int:
    """How many leading tokens of `edge` equal `key[start:]`."""
    n = min(len(edge), len(key) - start)
    for i in range(n):
        if edge[i] != key[start + i]:
            return i
    return n


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree: `key` tokens whose KV lives in `value` slots."""

    key: list[int] = field(default_factory=list)
    value: torch.Tensor = field(default_factory=_empty_slots, repr=False)
    parent: TreeNode | None = field(default=None, repr=False)
    children: dict[int, TreeNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access: int = 0
    node_id: int = 0

    @property
    def size(self) -> int:
        return len(self.key)

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class MatchResult:
    """The tree's slots for the longest cached prefix, and the node that ends it."""

    slots: torch.Tensor
    last_node: TreeNode


class RadixCache:
    """A prefix tree over token ids mapping to KV slots, with LRU eviction and path locks."""

    def __init__(self, kv_pool: SlotFreer, page_size: int = 1, disable: bool = False):
        if page_size != 1:
            raise NotImplementedError("the radix cache supports page_size=1 only")
        self.kv_pool = kv_pool
        self.page_size = page_size
        self.disable = disable
        self._clock = 0
        self._next_id = 0
        self.report_evictions = False  # keep each evicted leaf as a PrefixCut
        self._evicted: list[PrefixCut] = []
        self._init_root()

    def _init_root(self) -> None:
        self.root = self._new_node([], _empty_slots(), None)
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ sizes
    @property
    def evictable_size(self) -> int:
        """Tokens in the tree on nodes no request has locked."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens in the tree on nodes some request has locked."""
        return self._protected

    def total_cached_tokens(self) -> int:
        return sum(node.size for node in self._nodes())

    # ------------------------------------------------------------------ matching and inserting
    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest cached prefix of `key`. Splits an edge so `last_node` ends exactly there.

        Marks the matched path as just used (for LRU). The returned slots stay owned by the tree;
        lock `last_node` before relying on them across an eviction.
        """
        if self.disable:
            return MatchResult(_empty_slots(), self.root)
        node, _ = self._walk(key)
        return MatchResult(self._path_slots(node), node)

    def insert(self, key: list[int], slots: torch.Tensor) -> int:
        """Store `key` -> `slots`; return how many leading tokens of `key` were already cached.

        The tree takes ownership of `slots[returned:]` only. The slots given for
        `key[:returned]` are not taken: the caller must free them, unless they are the very
        slots the tree already holds. Disabled: stores nothing and returns 0 (caller frees all).
        """
        if self.disable:
            return 0
        prefix_len, _ = self._insert(key, _as_slots(slots))
        return prefix_len

    def _insert(self, key: list[int], slots: torch.Tensor) -> tuple[int, TreeNode]:
        if len(key) != slots.numel():
            raise ValueError(f"key has {len(key)} tokens but {slots.numel()} slots were given")
        node, matched = self._walk(key)
        if matched < len(key):
            node = self._add_leaf(node, key[matched:], slots[matched:])
        return matched, node

    def _walk(self, key: list[int]) -> tuple[TreeNode, int]:
        """Follow `key` down the tree, splitting the last edge if the key leaves it midway."""
        tick = self._tick()
        node, pos = self.root, 0
        node.last_access = tick
        while pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            shared = _shared_len(child.key, key, pos)
            if shared < child.size:
                child = self._split(child, shared)
            child.last_access = tick
            node, pos = child, pos + shared
        return node, pos

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node`'s edge after `at` tokens; return the new upper part.

        The original object keeps the lower part, so a request that holds it as `last_node`
        still ends at the same depth. The upper part inherits the lock count (every lock that
        passes through the lower part passes through it too), so sizes do not move.
        """
        parent = node.parent
        assert parent is not None, "the root is never split"
        upper = self._new_node(node.key[:at], node.value[:at], parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.key, node.value = node.key[at:], node.value[at:]
        parent.children[upper.key[0]] = upper
        upper.children[node.key[0]] = node
        node.parent = upper
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], slots: torch.Tensor) -> TreeNode:
        leaf = self._new_node(list(key), slots.clone(), parent)
        leaf.last_access = parent.last_access
        parent.children[key[0]] = leaf
        self._evictable += leaf.size
        return leaf

    def _new_node(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        self._next_id += 1
        return TreeNode(key=key, value=value, parent=parent, node_id=self._next_id)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock every node from `node` up to the root against eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= node.size
                self._protected += node.size
            node.lock_ref += 1
            node = self._parent(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`; nodes whose count reaches 0 become evictable."""
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"unlocking node {node.node_id}, which is not locked")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= node.size
                self._evictable += node.size
            node = self._parent(node)

    @staticmethod
    def _parent(node: TreeNode) -> TreeNode:
        if node.parent is None:
            raise ValueError(f"node {node.node_id} is not in the tree (evicted or reset)")
        return node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until `num_tokens` are freed or none is left.

        A parent whose last child goes becomes a leaf and joins the candidates. Returns the
        number of slots given back to the KV pool (may exceed `num_tokens` by part of a leaf).
        """
        heap = [self._heap_entry(n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            parent = self._parent(node)
            freed += self._remove_leaf(node)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, self._heap_entry(parent))
        return freed

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and node.is_leaf and node.lock_ref == 0

    @staticmethod
    def _heap_entry(node: TreeNode) -> tuple[int, int, TreeNode]:
        return node.last_access, node.node_id, node

    def _remove_leaf(self, node: TreeNode) -> int:
        if self.report_evictions:
            self._evicted.append(self._cut_at(node))
        self._free(node.value)
        del self._parent(node).children[node.key[0]]
        node.parent = None
        self._evictable -= node.size
        return node.size

    def _free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.kv_pool.free(slots)

    def _cut_at(self, leaf: TreeNode) -> PrefixCut:
        path = self._path_key(self._parent(leaf))
        path.append(leaf.key[0])
        return PrefixCut(len(path) - 1, leaf.key[0], prefix_digest(path))

    def take_evicted(self) -> list[PrefixCut]:
        """The leaves evicted since the last call, in order (empty unless reported)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def reset(self) -> None:
        """Free every cached slot and start empty. Refused while any request holds a lock."""
        if self._protected or any(n.lock_ref for n in self._nodes()):
            raise RuntimeError("radix cache reset while nodes are locked by requests")
        for node in self._nodes():
            self._free(node.value)
        self._init_root()

    # ------------------------------------------------------------------ request lifecycle
    def cache_finished_req(
        self, key: list[int], slots: torch.Tensor, old_last_node: TreeNode
    ) -> None:
        """A request is done (finished, aborted or retracted): hand all its KV over.

        `key` is the request's tokens that have KV and `slots` its row of slots for them; the
        first `depth(old_last_node)` of those must be the tree's own slots (as
        `match_prefix` / `cache_unfinished_req` gave them). The tree takes the new tail, the
        request's duplicates of what the tree already had are freed, and the lock on
        `old_last_node` is dropped. Afterwards the request owns no slot.
        Disabled: the tree holds nothing, so every slot of the request is freed.
        """
        if self.disable:
            self._free(_as_slots(slots))
            return
        self._cache(key, _as_slots(slots), old_last_node)
        self.dec_lock_ref(old_last_node)

    def release_failed_req(self, slots: torch.Tensor, old_last_node: TreeNode) -> None:
        """A request failed: free the slots it owns (those past its locked cached prefix)
        without caching them, since their KV may be wrong, and drop its lock."""
        slots = _as_slots(slots)
        if self.disable:
            self._free(slots)
            return
        self._free(slots[self._path_slots(old_last_node).numel() :])
        self.dec_lock_ref(old_last_node)

    def cache_unfinished_req(
        self, key: list[int], slots: torch.Tensor, old_last_node: TreeNode
    ) -> tuple[torch.Tensor, TreeNode]:
        """A request goes on (e.g. after a prefill chunk): put its computed tokens in the tree.

        Same hand-over as `cache_finished_req`, but the lock moves from `old_last_node` to the
        node that ends `key`, and the tree's slots for the whole of `key` are returned: the
        caller writes them into the request's row, replacing the duplicates just freed. The
        request then owns no slot until it allocates more.
        Disabled: nothing is stored; returns `(slots, old_last_node)` and the request keeps
        owning all its slots.
        """
        if self.disable:
            return slots, old_last_node
        tree_slots, node = self._cache(key, _as_slots(slots), old_last_node)
        self.inc_lock_ref(node)
        self.dec_lock_ref(old_last_node)
        return tree_slots, node

    def _cache(
        self, key: list[int], slots: torch.Tensor, old_last_node: TreeNode
    ) -> tuple[torch.Tensor, TreeNode]:
        """Insert a request's tokens and free its duplicates; return the tree's slots and node."""
        held = self._check_request_prefix(key, slots, old_last_node)
        prefix_len, node = self._insert(key, slots)
        tree_slots = self._path_slots(node)
        dup = slots[held:prefix_len]
        self._free(dup[dup != tree_slots[held:prefix_len]])
        return tree_slots, node

    def _check_request_prefix(
        self, key: list[int], slots: torch.Tensor, old_last_node: TreeNode
    ) -> int:
        """Check the request starts with its locked path (keys and slots); return its depth."""
        held = self._path_slots(old_last_node)
        n = held.numel()
        if list(key[:n]) != self._path_key(old_last_node) or not torch.equal(slots[:n], held):
            raise ValueError("request tokens/slots do not start with its locked cached prefix")
        return n

    # ------------------------------------------------------------------ paths and walks
    def _path_nodes(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from the root's child down to `node`."""
        path = []
        while node is not self.root:
            path.append(node)
            node = self._parent(node)
        return path[::-1]

    def _path_slots(self, node: TreeNode) -> torch.Tensor:
        values = [n.value for n in self._path_nodes(node)]
        return torch.cat(values) if values else _empty_slots()

    def _path_key(self, node: TreeNode) -> list[int]:
        key: list[int] = []
        for n in self._path_nodes(node):
            key.extend(n.key)
        return key

    def _nodes(self) -> list[TreeNode]:
        """Every node except the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------------ checks and debugging
    def check_integrity(self) -> None:
        """Raise AssertionError when the tree breaks one of its invariants."""
        nodes = self._nodes()
        for node in [self.root, *nodes]:
            self._check_node(node)
        evictable = sum(n.size for n in nodes if n.lock_ref == 0)
        protected = sum(n.size for n in nodes if n.lock_ref > 0)
        assert evictable == self._evictable, f"evictable {self._evictable} != walk {evictable}"
        assert protected == self._protected, f"protected {self._protected} != walk {protected}"
        self._check_unique_slots(nodes)

    def _check_node(self, node: TreeNode) -> None:
        nid = node.node_id
        assert node.value.numel() == node.size, (
            f"node {nid} has {node.value.numel()} slots for {node.size} tokens"
        )
        assert node.lock_ref >= 0, f"node {nid} has lock_ref {node.lock_ref}"
        for token, child in node.children.items():
            self._check_edge(node, token, child)

    def _check_edge(self, parent: TreeNode, token: int, child: TreeNode) -> None:
        cid = child.node_id
        assert child.parent is parent, f"node {cid} does not point back to its parent"
        assert child.size > 0, f"node {cid} has an empty edge"
        assert child.key[0] == token, f"node {cid} starts with {child.key[0]}, stored under {token}"
        if parent is not self.root:
            assert parent.lock_ref >= child.lock_ref, (
                f"node {cid} lock_ref {child.lock_ref} > its parent's {parent.lock_ref}"
            )

    @staticmethod
    def _check_unique_slots(nodes: list[TreeNode]) -> None:
        if not nodes:
            return
        slots = torch.cat([n.value for n in nodes])
        assert slots.unique().numel() == slots.numel(), "a KV slot appears twice in the tree"
