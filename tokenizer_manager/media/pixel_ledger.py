"""PixelLedger: a request sends an item's pixels to the ranks only when they may need them.

The ranks' encoder caches keep each item's embedding by its hash (scheduler/encoder_cache.py).
Once the front end has sent an item's pixels, a later request with the same item (a resent
conversation) usually finds the embedding there, or does not need it at all (its prefix is in
the radix cache). So the ledger remembers the hashes it has sent (the last `max_keys`), and a
request whose item is among them goes out with the item's key only: its `feature` is None.

The ledger is a hint, not a mirror, and a wrong hint never fails a request: the scheduler checks
a keyed item at admission (every rank must hold it; then it is pinned until read), and when some
rank lacks it (evicted, flushed, never stored) the request waits and rank 0 asks for the pixels
(`PixelsWanted`); the ledger answers with `ItemPixels` from the pixels the request keeps here
until it ends (`hold` ... `release`). Those are the request's own: a shared-memory file (a link
to the processed-item cache's, no copy) or an array. Each answer hands the ranks a new link to
the file, which they remove once read, as any request's pixels (runtime/transport/shm.py).

`bytes_sent` counts the pixel bytes that left for the ranks, in requests and in answers.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from runtime.io_struct import ItemPixels
from runtime.multimodal import MultimodalInputs
from runtime.transport.shm import SharedTensor, link_copy

MAX_KEYS = 1 << 16  # item hashes remembered as sent (least recently used forgotten first)

Pixels = SharedTensor | torch.Tensor | np.ndarray


class PixelLedger:
    """Which items were sent, and the pixels of the items each request sent by key."""

    def __init__(self, enabled: bool, shm_dir: str | None, max_keys: int = MAX_KEYS):
        self.enabled, self.shm_dir, self.max_keys = enabled, shm_dir, max_keys
        self.bytes_sent = 0
        self.items_by_key = 0
        self.items_asked = 0
        self._sent: OrderedDict[int, None] = OrderedDict()
        self._held: dict[str, dict[int, Pixels]] = {}

    def info(self) -> dict[str, int]:
        """For /server_info: bytes sent, items sent by key, items the ranks asked for again,
        and the requests holding pixels here (0 when idle)."""
        return {
            "pixel_bytes_sent": self.bytes_sent,
            "items_sent_by_key": self.items_by_key,
            "items_asked_again": self.items_asked,
            "requests_holding_pixels": len(self._held),
        }

    def hold(self, rid: str, mm: MultimodalInputs | None) -> None:
        """Before `rid` is sent: items already sent lose their pixels (kept here for the
        request); the others are sent, and noted."""
        items = [item for item in (mm.items if mm is not None else []) if item.feature is not None]
        known = {item.hash for item in items if self.enabled and item.hash in self._sent}
        for item in items:  # an image twice in one new request: its pixels go with both
            if item.hash in known:
                self._held.setdefault(rid, {})[item.hash] = item.feature
                item.feature = None
                self._sent.move_to_end(item.hash)
                self.items_by_key += 1
                continue
            self.bytes_sent += int(item.feature.nbytes)
            self._note_sent(item.hash)

    def answer(self, rid: str, hashes: list[int]) -> ItemPixels | None:
        """The pixels the ranks ask for, or None when the request has ended (its abort is on
        its way to the scheduler)."""
        held = self._held.get(rid)
        if held is None:
            return None
        features = {h: self._copy(held[h]) for h in hashes if h in held}
        self.bytes_sent += sum(int(f.nbytes) for f in features.values())
        self.items_asked += len(features)
        return ItemPixels(rid, features)

    def release(self, rid: str) -> None:
        """The request ended: its held pixels go (a file is removed with its last name)."""
        for pixels in self._held.pop(rid, {}).values():
            if isinstance(pixels, SharedTensor):
                pixels.release()

    def forget(self) -> None:
        """The replica's ranks died: nothing is known sent (their encoder caches start empty),
        and every request's held pixels go (those requests have ended with an error)."""
        for rid in list(self._held):
            self.release(rid)
        self._sent.clear()

    def _note_sent(self, key: int) -> None:
        self._sent[key] = None
        self._sent.move_to_end(key)
        if len(self._sent) > self.max_keys:
            self._sent.popitem(last=False)

    def _copy(self, pixels: Pixels) -> Pixels:
        """A name of its own for the ranks to remove, or the array itself (sent out of band)."""
        if not isinstance(pixels, SharedTensor):
            return pixels
        if self.shm_dir is not None:
            try:
                return link_copy(pixels, self.shm_dir)
            except OSError:
                pass  # shared memory full: the bytes go inline
        return SharedTensor(pixels.path, pixels.shape, pixels.dtype, owned=False).load().clone()
