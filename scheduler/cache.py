"""The scheduler's cache bookkeeping, in one owner: the request and KV pools, the radix prefix
cache and the encoder cache. The scheduler asks it to lock a request's cached prefix, to put a
request's KV in the tree (a chunk, a prompt to share, a finish), to release what a request holds
and to evict; it never touches the pools or the trees itself.

Every rank's manager takes the same decisions in the same order (the scheduler is identical on
every rank), so the KV slots, tree nodes and encoder pins agree across ranks (invariant 11: a
failed request frees the same things on every rank). No request leaves a slot, a lock or a pin
behind (invariant 10, checked by `check_idle`).
"""

from __future__ import annotations

import torch

from runtime.distributed import TPGroup
from runtime.io_struct import EncoderCacheStats, RadixStats
from scheduler.encoder_cache import EncoderCache, agree_on_misses
from scheduler.model_runner import ModelRunner
from scheduler.radix_cache import RadixCache
from scheduler.req import Req


class CacheManager:
    """Lock, allocate, insert, release and evict for one rank's scheduler."""

    def __init__(self, runner: ModelRunner, radix: RadixCache, encoder_cache: EncoderCache):
        self.runner, self.radix, self.encoder_cache = runner, radix, encoder_cache
        self.kv_pool, self.req_pool = runner.kv_pool, runner.req_pool

    # ------------------------------------------------------------------ sizes
    @property
    def kv_total(self) -> int:
        return self.kv_pool.size

    def kv_usage(self) -> dict[str, int]:
        """The KV and request-slot counts `/server_info` reports (`ServerInfo`'s fields)."""
        return {
            "kv_total": self.kv_pool.size,
            "kv_free": self.kv_pool.available_size,
            "kv_evictable": self.radix.evictable_size,
            "kv_protected": self.radix.protected_size,
            "req_slots_used": self.req_pool.size - self.req_pool.available_size,
        }

    def free_or_evictable(self) -> int:
        """KV slots a step can use: free now, or held only by the tree's unlocked leaves."""
        return self.kv_pool.available_size + self.radix.evictable_size

    def cached_prefix_len(self, req: Req) -> int:
        """Tokens of the request's prompt the tree already holds (for the lpm policy)."""
        return int(self.radix.match_prefix(req.prefix_key()).slots.numel())

    def ensure_free(self, n: int) -> None:
        """Evict from the tree until `n` KV slots are free (the caller checked that free plus
        evictable covers them)."""
        short = n - self.kv_pool.available_size
        if short > 0:
            self.radix.evict(short)

    # ------------------------------------------------------------------ a request's life
    def lock(self, req: Req) -> int | None:
        """Give the request a request slot and its cached prefix, locked in the tree; returns
        how many KV slots the lock took from the evictable ones, None when no request slot is
        free (nothing is held then)."""
        if self.req_pool.available_size == 0:
            return None
        evictable = self.radix.evictable_size
        self.runner.admit(req)
        match = self.radix.match_prefix(req.prefix_key())
        self.req_pool.write(req.req_pool_index, 0, match.slots)
        req.kv_len = int(match.slots.numel())
        req.last_node = match.last_node
        self.radix.inc_lock_ref(req.last_node)
        if req.retractions == 0:
            req.cached_tokens = req.kv_len
        return evictable - self.radix.evictable_size

    def unlock(self, req: Req) -> None:
        """Undo `lock` (and `hold_keyed_items`) for a request that did not fit the batch."""
        self.set_encoder_pins(req, frozenset())
        self.radix.dec_lock_ref(req.last_node)
        req.last_node = None
        self.req_pool.free(req.req_pool_index)
        req.req_pool_index, req.kv_len = -1, 0

    def insert_computed(self, req: Req) -> None:
        """Put the request's computed tokens in the tree and keep running it (a chunk cut by
        chunked prefill, or a prompt its forks will match); its slots now read the tree's."""
        key = req.token_ids[: req.kv_len]
        new_slots, req.last_node = self.radix.cache_unfinished_req(
            key, self.req_slots(req), req.last_node
        )
        self.req_pool.write(req.req_pool_index, 0, new_slots)

    def release(self, req: Req) -> None:
        """A request that finished or is retracted: its KV goes to the tree (which frees the
        duplicates), its request slot and encoder pins back."""
        self.set_encoder_pins(req, frozenset())
        if req.req_pool_index < 0:
            return
        key = req.token_ids[: req.kv_len]
        self.radix.cache_finished_req(key, self.req_slots(req), req.last_node)
        self._free_slot(req)

    def release_failed(self, req: Req) -> None:
        """A request that failed: everything it holds is freed, its KV is not cached (its
        tokens may be what failed)."""
        self.set_encoder_pins(req, frozenset())
        if req.req_pool_index < 0:
            return
        self.radix.release_failed_req(self.req_slots(req), req.last_node)
        self._free_slot(req)

    def _free_slot(self, req: Req) -> None:
        self.req_pool.free(req.req_pool_index)
        req.req_pool_index, req.kv_len, req.last_node = -1, 0, None

    def req_slots(self, req: Req) -> torch.Tensor:
        return self.req_pool.req_to_token[req.req_pool_index, : req.kv_len].clone().cpu()

    # ------------------------------------------------------------------ encoder pins
    def hold_keyed_items(self, req: Req, tp: TPGroup) -> list[int]:
        """After `lock`: pin the encoder-cache entries of the items the request sent by key
        and has still to read, when every rank holds them (one all-reduce, joined by every
        rank: they admit alike); else pin nothing and return the hashes some rank lacks, whose
        pixels the request must get from the front end before it can run."""
        keyed = req.keyed_items(req.kv_len)
        if not keyed:
            return []
        missing = agree_on_misses(sorted(keyed), self.encoder_cache, tp)
        if not missing:
            self.set_encoder_pins(req, req.encoder_pins | keyed)
        return missing

    def pin_items_in_progress(self, req: Req, chunk_end: int) -> None:
        """Before a chunk runs: pin the encoder-cache entries of items that this chunk enters
        but does not finish (the pin holds from the moment the embedding is stored), so the next
        chunk reads the embedding instead of encoding the item again, and of keyed items still
        to be read (they have no pixels to encode again); unpin the rest."""
        pins = set(req.keyed_items(req.kv_len))
        for item in req.mm.items if req.mm is not None else []:
            start, end = item.span
            if start < chunk_end < end:
                pins.add(item.hash)
        self.set_encoder_pins(req, frozenset(pins))

    def set_encoder_pins(self, req: Req, pins: frozenset[int]) -> None:
        for key in pins - req.encoder_pins:
            self.encoder_cache.acquire(key)
        for key in req.encoder_pins - pins:
            self.encoder_cache.release(key)
        req.encoder_pins = pins

    # ------------------------------------------------------------------ the whole cache
    def check_idle(self) -> None:
        """With no request in the scheduler, every KV slot is free or evictable, nothing is
        locked and no encoder entry is pinned (invariant 10); raises AssertionError otherwise."""
        self.radix.check_integrity()
        kv = self.kv_pool
        held = kv.available_size + self.radix.evictable_size
        if held != kv.size or self.radix.protected_size != 0:
            raise AssertionError(
                f"KV leak while idle: free {kv.available_size} + evictable "
                f"{self.radix.evictable_size} != total {kv.size} "
                f"(protected {self.radix.protected_size})"
            )
        pins = self.encoder_cache.stats().pins
        if pins:
            raise AssertionError(f"encoder-cache pin leak while idle: {pins} pins held")

    def flush(self) -> None:
        """Drop every cached prefix and encoder output (only while idle)."""
        self.radix.reset()
        self.encoder_cache.clear()

    def radix_stats(self) -> RadixStats:
        return RadixStats(self.radix.total_cached_tokens())

    def encoder_stats(self) -> EncoderCacheStats:
        return self.encoder_cache.stats()
