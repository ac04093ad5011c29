"""A per-item cache of vision embeddings, one per scheduler rank.

Keys are item hashes (computed once in the TokenizerManager, so equal on every rank); a value is
the item's whole embedding, all of its rows, on the model's device. Entries are evicted least
recently used first when the cache would exceed `capacity_bytes`; capacity 0 stores nothing but
runs the same code. An entry larger than the capacity is not stored.

A request whose chunked prefill has encoded an item but not yet consumed all of its rows pins
the item (`acquire`) until its chunk moves past it (`release`); pinned entries are never evicted.
A pin may be taken before the item is cached: the entry is pinned from the moment it is stored.

Ranks agree on hits and misses
------------------------------
Each rank keeps its own cache, and nothing guarantees that two ranks hold the same entries at
the same time (a flush on one side of a request, a rank that rebuilt its cache, an entry that
fitted on one rank only). The vision encoder, however, is collective: in TP mode every layer
all-reduces, in DP mode the outputs are all-gathered. If rank 0 hit and rank 1 missed, rank 1
would wait in the encoder forever. So `encode_with_cache`, called on every rank with the same
item list, all-reduces one miss flag per item with MAX: an item that any rank lacks is encoded
on every rank, and when no rank misses, no rank calls the encoder.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Container

import torch

from runtime.distributed import TPGroup
from runtime.io_struct import EncoderCacheCounters, EncoderCacheStats
from runtime.multimodal import ItemEncoder, MultimodalDataItem


class EncoderCache:
    """LRU of item embeddings bounded in bytes, with pins for requests still reading an item;
    per item, not per request (invariant 4)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"encoder cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self.counters = EncoderCacheCounters()
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._pins: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    # ------------------------------------------------------------------ entries
    def get(self, key: int) -> torch.Tensor | None:
        """The cached embedding (now the most recently used), or None."""
        emb = self._entries.get(key)
        if emb is not None:
            self._entries.move_to_end(key)
        return emb

    def put(self, key: int, emb: torch.Tensor) -> bool:
        """Store (or replace) an entry, evicting unpinned ones as needed; False if not stored."""
        self._discard(key)
        size = _nbytes(emb)
        if self.capacity_bytes == 0 or not self._make_room(size):
            self.counters.not_stored += 1
            return False
        self._entries[key] = _owned(emb)
        self.bytes += size
        return True

    def clear(self) -> None:
        """Drop every entry that no request has pinned (counters are kept)."""
        for key in [k for k in self._entries if k not in self._pins]:
            self._discard(key)

    def _discard(self, key: int) -> None:
        emb = self._entries.pop(key, None)
        if emb is not None:
            self.bytes -= _nbytes(emb)

    def _make_room(self, size: int) -> bool:
        if size > self.capacity_bytes - self.pinned_bytes:
            return False
        while self.bytes + size > self.capacity_bytes:
            self._evict_oldest_unpinned()
        return True

    def _evict_oldest_unpinned(self) -> None:
        key = next(k for k in self._entries if k not in self._pins)
        self._discard(key)
        self.counters.evictions += 1

    # ------------------------------------------------------------------ pins
    def acquire(self, key: int) -> None:
        """Pin an item (cached now or later) until a matching `release`."""
        self._pins[key] = self._pins.get(key, 0) + 1

    def release(self, key: int) -> None:
        count = self._pins.get(key, 0)
        if count == 0:
            raise ValueError(f"encoder cache: release of item {key} that is not pinned")
        if count == 1:
            del self._pins[key]
        else:
            self._pins[key] = count - 1

    @property
    def pinned_bytes(self) -> int:
        return sum(_nbytes(self._entries[k]) for k in self._pins if k in self._entries)

    def stats(self) -> EncoderCacheStats:
        """Counters and sizes for /server_info; `pins` must be 0 when the server is idle."""
        return EncoderCacheStats(
            **vars(self.counters),
            capacity_bytes=self.capacity_bytes,
            bytes=self.bytes,
            entries=len(self._entries),
            pins=sum(self._pins.values()),
            pinned_bytes=self.pinned_bytes,
        )

    # ------------------------------------------------------------------ encoding
    def encode_with_cache(
        self, items: list[MultimodalDataItem], encode_fn: ItemEncoder, tp: TPGroup
    ) -> dict[int, torch.Tensor]:
        """Embeddings for every item, encoding only the misses all ranks agreed on.

        Every rank of `tp` must call this with the same items in the same order. `encode_fn` is
        called once with the deduplicated misses, or not at all (then on no rank).
        """
        unique = {item.hash: item for item in items}
        if not unique:
            return {}
        local = {h: emb for h in unique if (emb := self.get(h)) is not None}
        missing = agree_on_misses(list(unique), local, tp)
        self._count_lookups(local, missing)
        fresh = self._encode([unique[h] for h in missing], encode_fn) if missing else {}
        return {h: fresh[h] if h in fresh else local[h] for h in unique}

    def wrap(self, encode_fn: ItemEncoder, tp: TPGroup) -> ItemEncoder:
        """`encode_fn` with this cache in front; same signature, so the model can swap it in."""

        def encode(items: list[MultimodalDataItem]) -> dict[int, torch.Tensor]:
            return self.encode_with_cache(items, encode_fn, tp)

        return encode

    def _count_lookups(self, local: Collection[int], missing: Collection[int]) -> None:
        peer = sum(h in local for h in missing)
        self.counters.misses += len(missing)
        self.counters.peer_misses += peer
        self.counters.hits += len(local) - peer

    def _encode(
        self, items: list[MultimodalDataItem], encode_fn: ItemEncoder
    ) -> dict[int, torch.Tensor]:
        start = time.perf_counter()
        out = encode_fn(items)
        self.counters.encode_seconds += time.perf_counter() - start
        self.counters.encode_calls += 1
        self.counters.items_encoded += len(items)
        for item in items:
            if item.hash not in out:
                raise KeyError(f"the vision encoder returned no embedding for item {item.hash}")
            self.put(item.hash, out[item.hash])
        return out


def agree_on_misses(hashes: list[int], local: Container[int], tp: TPGroup) -> list[int]:
    """The hashes that at least one rank lacks (one MAX all-reduce of 0/1 flags over `tp`);
    every rank joins it, also with no item (invariant 2)."""
    flags = torch.tensor([int(h not in local) for h in hashes], dtype=torch.int32)
    if tp.size > 1:
        tp.all_reduce_cpu(flags, op="max")
    return [h for h, missed in zip(hashes, flags.tolist()) if missed]


def _nbytes(emb: torch.Tensor) -> int:
    return emb.numel() * emb.element_size()


def _owned(emb: torch.Tensor) -> torch.Tensor:
    """A compact copy when `emb` views a larger buffer (one item of a batch's output), so the
    cache keeps alive, and counts, only this item's bytes."""
    emb = emb.detach()
    if emb.untyped_storage().nbytes() > _nbytes(emb):
        return emb.clone()
    return emb
