"""ProcessedCache: preprocessed media items by identity, so a resent image skips its worker.

Client media ids: a content part may name its item with a `uuid`; the id (within the caller's
scope) is remembered for the first item sent with it, and later requests that give the id are
served that item without their bytes being read, even when they send other bytes with it (the id
is the client's promise that the item is the same). Ids of other scopes never match: the scope
is a digest of the API key the caller presented (`http.server.media_scope`), "" without keys.

Clients resend a conversation's images every turn. The item's identity is its digest
(`worker.media_digest`: the encoded bytes plus every processor setting that shapes the
pixels), computed on the event loop at memory speed; a hit skips decode, resize and
normalisation and hands the request a copy of the cached pixels.

Where the pixels live: with shared memory, a cached item is a shared-memory file that the cache
owns (named like every media file of this process, so a sweep at shutdown or by the next server
removes it). A request never gets the cache's own name, because the ranks remove the files they
receive (runtime/transport.py): a miss links the worker's file under a name of the cache's, a hit
links the cache's file under a new name the request owns. Links copy nothing (pixels are inputs,
never written in place: invariant of transport.py), and the pages go when the last name does;
where linking fails the bytes are copied. Without shared memory the cache holds the numpy arrays
themselves (read-only inputs, shared with the requests).

The size counts every cached pixel byte (files or arrays), at most `max_bytes` and, with shared
memory, at most a quarter of it, so the cache never starves requests of shared memory; the least
recently used items go first and their files are removed at once.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from runtime.logging_utils import get_logger
from runtime.transport.shm import SharedTensor, link_copy
from tokenizer_manager.media.types import ProcessedMedia

logger = get_logger(__name__)

SHM_SHARE = 4  # the cache takes at most 1/SHM_SHARE of the shared memory it lives in
MAX_IDS = 1 << 16  # client media ids remembered (least recently used forgotten first)

MediaId = tuple[str, str, str]  # (scope, modality, the client's uuid)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


def cache_words(cache: ProcessedCache | None) -> str:
    """The cache as the start-up log names it (an empty cache is a cache: `len` is 0)."""
    if cache is None:
        return "no processed-item cache"
    return f"processed-item cache of {cache.max_bytes >> 20} MiB"


class ProcessedCache:
    """An LRU of `ProcessedMedia` by digest, bounded in bytes (see the module docstring)."""

    def __init__(self, max_bytes: int, shm_dir: str | None):
        self.shm_dir = shm_dir
        self.max_bytes = min(max_bytes, _shm_bytes(shm_dir) // SHM_SHARE) if shm_dir else max_bytes
        self.nbytes = 0
        self.stats = CacheStats()
        self._items: OrderedDict[int, ProcessedMedia] = OrderedDict()
        self._ids: OrderedDict[MediaId, int] = OrderedDict()  # client ids -> digests

    def __len__(self) -> int:
        return len(self._items)

    def info(self) -> dict[str, int]:
        """Items, bytes, the bound and the counters (for /server_info)."""
        sizes = {"items": len(self), "bytes": self.nbytes, "max_bytes": self.max_bytes}
        return sizes | dataclasses.asdict(self.stats)

    def get(self, digest: int) -> ProcessedMedia | None:
        """A copy of the cached item that the caller owns, or None (a miss)."""
        item = self._items.get(digest)
        if item is None:
            self.stats.misses += 1
            return None
        try:
            pixels = self._copy(item.pixel_values)
        except OSError as exc:  # shared memory full: the worker will make it again
            logger.warning("processed-media cache: a hit could not be copied (%r)", exc)
            self.stats.misses += 1
            return None
        self._items.move_to_end(digest)
        self.stats.hits += 1
        return _with_pixels(item, pixels)

    def put(self, item: ProcessedMedia) -> None:
        """Keep a copy of a worker's result (the caller keeps `item`), evicting the least
        recently used items to stay within `max_bytes`; an item larger than that is skipped."""
        size = _nbytes(item.pixel_values)
        if item.digest is None or item.digest in self._items or size > self.max_bytes:
            return
        while self.nbytes + size > self.max_bytes:
            self._evict()
        try:
            pixels = self._copy(item.pixel_values)
        except OSError as exc:
            logger.warning("processed-media cache: an item could not be kept (%r)", exc)
            return
        self._items[item.digest] = _with_pixels(item, pixels)
        self.nbytes += size

    def remember(self, media_id: MediaId, digest: int) -> None:
        """Name an item by the client's id; the first item given an id keeps it."""
        if media_id not in self._ids:
            self._ids[media_id] = digest
            if len(self._ids) > MAX_IDS:
                self._ids.popitem(last=False)

    def get_by_id(self, media_id: MediaId) -> ProcessedMedia | None:
        """A copy of the item first named `media_id`, or None when the id is unknown or its item
        was evicted (the id is then forgotten)."""
        digest = self._ids.get(media_id)
        if digest is None:
            return None
        item = self.get(digest)
        if item is None:
            del self._ids[media_id]
            return None
        self._ids.move_to_end(media_id)
        return item

    def clear(self) -> None:
        """Drop every item and remove its file."""
        while self._items:
            self._evict()

    def _evict(self) -> None:
        _, item = self._items.popitem(last=False)
        self.nbytes -= _nbytes(item.pixel_values)
        self.stats.evictions += 1
        if isinstance(item.pixel_values, SharedTensor):
            item.pixel_values.release()

    def _copy(self, pixels: np.ndarray | SharedTensor) -> np.ndarray | SharedTensor:
        """Arrays are shared as they are (read-only inputs); a file is copied to a new one."""
        if isinstance(pixels, np.ndarray):
            return pixels
        return self._copy_file(pixels)

    def _copy_file(self, source: SharedTensor) -> SharedTensor:
        if self.shm_dir is None:
            raise OSError("a shared pixel file without a shared-memory folder")
        return link_copy(source, self.shm_dir)


def _with_pixels(item: ProcessedMedia, pixels: np.ndarray | SharedTensor) -> ProcessedMedia:
    return ProcessedMedia(
        item.modality, pixels, item.grid_thw, item.second_per_grid_t, item.digest, item.frame_times
    )


def _nbytes(pixels: np.ndarray | SharedTensor) -> int:
    return int(pixels.nbytes)


def _shm_bytes(shm_dir: str) -> int:
    try:
        fs = os.statvfs(shm_dir)
    except OSError:
        return 0
    return fs.f_blocks * fs.f_frsize
