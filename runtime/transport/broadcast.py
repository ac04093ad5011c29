"""Rank 0's messages on every scheduler rank: the frames it received, forwarded unchanged.

`broadcast_frames` sends one layout vector and one byte tensor over the process group; on one
node the large frames go to the other ranks through a shared-memory segment file instead of the
group (only the layout, the segment's token and the pickles are broadcast), once per request,
never per step. `release_loaded` removes the media files every rank has read.
"""

from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from runtime.logging_utils import get_logger
from runtime.transport.frames import Frame
from runtime.transport.shm import remove_file

logger = get_logger(__name__)


def release_loaded(paths: list[str], rank: int, group: dist.ProcessGroup | None, size: int) -> None:
    """Every rank read the same shared files (they unpickled the same messages); once all
    have, rank 0 removes them. Every rank calls it with the same list."""
    if not paths:
        return
    if size > 1:
        _all_mapped(group)
    if rank == 0:
        for path in paths:
            remove_file(path)


SHARED_MIN_BYTES = 1 << 16  # frames from this size up go through shared memory, when enabled
SEGMENT_PREFIX = "tessera-frames-"


@dataclass(frozen=True)
class FrameLayout:
    """What rank 0 broadcasts first: frames per message, each frame's size, which frames sit in
    the step's shared-memory segment (the others follow in one byte tensor over the group), and
    the segment's token (0: no segment)."""

    per_message: list[int]
    sizes: list[int]
    shared: list[bool]
    token: int = 0

    @classmethod
    def plan(cls, messages: list[list[Frame]], shm_dir: str | None) -> FrameLayout:
        sizes = [memoryview(f).nbytes for m in messages for f in m]
        shared = [shm_dir is not None and n >= SHARED_MIN_BYTES for n in sizes]
        token = secrets.randbits(62) + 1 if any(shared) else 0
        return cls([len(m) for m in messages], sizes, shared, token)

    def encode(self) -> list[int]:
        flags = [int(s) for s in self.shared]
        return [len(self.per_message), *self.per_message, *self.sizes, *flags, self.token]

    @classmethod
    def decode(cls, values: list[int]) -> FrameLayout:
        n = values[0]
        frames = sum(values[1 : 1 + n])
        sizes = values[1 + n : 1 + n + frames]
        shared = [bool(x) for x in values[1 + n + frames : 1 + n + 2 * frames]]
        return cls(values[1 : 1 + n], sizes, shared, values[-1])

    def nbytes(self, shared: bool) -> int:
        return sum(n for n, s in zip(self.sizes, self.shared) if s == shared)

    def pick(self, frames: list[Frame], shared: bool) -> list[Frame]:
        return [f for f, s in zip(frames, self.shared) if s == shared]

    def split(self, inline: memoryview, segment: memoryview | None) -> list[list[Frame]]:
        """The frames, each a view of the inline bytes or of the segment, grouped by message."""
        starts, frames = {False: 0, True: 0}, []
        for n, s in zip(self.sizes, self.shared):
            frames.append((segment if s else inline)[starts[s] : starts[s] + n])
            starts[s] += n
        return _group(frames, self.per_message)


def broadcast_frames(
    messages: list[list[Frame]] | None,
    rank: int,
    group: dist.ProcessGroup | None,
    size: int,
    shm_dir: str | None = None,
) -> list[list[Frame]]:
    """Rank 0's messages (each a list of frames) on every rank of `group`; every rank calls it.

    The layout goes first (one long tensor). With `shm_dir` (ranks on one node), every large
    frame (the pixels) is written once into a shared-memory file there, which the other ranks
    map (privately: their writes stay their own); only the layout and the small frames (the
    pickles) cross the group, in one byte tensor that receivers slice without copying. Rank 0
    unlinks the file once every rank has mapped it (one tiny all-reduce), so it lives exactly as
    long as the tensors that view it."""
    if size == 1:
        return messages or []
    layout = _first_rank_layout(messages, shm_dir) if rank == 0 else None
    layout = _broadcast_layout(layout, rank, group)
    path = _segment_path(shm_dir, layout.token)
    if rank == 0:
        _send_inline([f for m in messages for f in m], layout, path, group)
        return messages
    inline = _broadcast_inline(None, layout.nbytes(False), group)
    segment = _map_segment(path, layout.nbytes(True)) if path else None
    if path:
        _all_mapped(group)
    return layout.split(inline, segment)


def _first_rank_layout(messages: list[list[Frame]], shm_dir: str | None) -> FrameLayout:
    """The layout, its large frames already written to the segment file; when the file cannot
    be written (shared memory full), a layout without a segment: the group carries it all."""
    layout = FrameLayout.plan(messages, shm_dir)
    path = _segment_path(shm_dir, layout.token)
    if path is None:
        return layout
    try:
        _write_segment(path, layout.pick([f for m in messages for f in m], True))
    except OSError as exc:
        logger.warning("shared-memory frames failed (%r); broadcasting them instead", exc)
        remove_file(path)
        return FrameLayout.plan(messages, None)
    return layout


def _send_inline(
    frames: list[Frame], layout: FrameLayout, path: str | None, group: dist.ProcessGroup | None
) -> None:
    """Rank 0: the small frames to every rank; then, if there is a segment, wait until every
    rank has mapped it and unlink it (also when a collective failed)."""
    try:
        _broadcast_inline(layout.pick(frames, False), layout.nbytes(False), group)
        if path:
            _all_mapped(group)
    finally:
        if path:
            remove_file(path)


def _segment_path(shm_dir: str | None, token: int) -> str | None:
    if not token:
        return None
    if shm_dir is None:
        raise RuntimeError("rank 0 sent frames through shared memory; this rank has no shm_dir")
    return os.path.join(shm_dir, f"{SEGMENT_PREFIX}{token:016x}")


def _write_segment(path: str, frames: list[Frame]) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with open(fd, "wb") as out:
        for frame in frames:
            out.write(frame)


def _map_segment(path: str, nbytes: int) -> memoryview:
    """A private (copy-on-write) mapping: a stray in-place write stays on this rank and never
    faults, as with a received byte tensor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return memoryview(mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY))
    finally:
        os.close(fd)


def _all_mapped(group: dist.ProcessGroup | None) -> None:
    """Every rank has mapped the segment, or read the files (a barrier that rank 0 can only
    pass after them)."""
    dist.all_reduce(torch.zeros(1, dtype=torch.int32), group=group)


def _broadcast_layout(
    layout: FrameLayout | None, rank: int, group: dist.ProcessGroup | None
) -> FrameLayout:
    if rank == 0:
        values = layout.encode()
        header = torch.tensor([len(values), *values], dtype=torch.long)
    else:
        header = torch.zeros(1, dtype=torch.long)
    return FrameLayout.decode(_broadcast_header(header, rank, group)[1:].tolist())


def _broadcast_inline(
    frames: list[Frame] | None, nbytes: int, group: dist.ProcessGroup | None
) -> memoryview:
    """The small frames, concatenated into one byte tensor (rank 0 passes them, others None)."""
    payload = torch.empty(nbytes, dtype=torch.uint8)
    if frames is not None:
        _concatenate(frames, payload.numpy())
    if nbytes:
        dist.broadcast(payload, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return memoryview(payload.numpy())


def _broadcast_header(
    header: torch.Tensor, rank: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    src = dist.get_global_rank(group, 0) if group else 0
    length = header[:1].clone()
    dist.broadcast(length, src=src, group=group)
    if rank != 0:
        header = torch.zeros(int(length) + 1, dtype=torch.long)
    dist.broadcast(header, src=src, group=group)
    return header


def _concatenate(frames: list[Frame], out: np.ndarray) -> None:
    start = 0
    for frame in frames:
        data = np.frombuffer(frame, dtype=np.uint8)
        out[start : start + data.size] = data
        start += data.size


def _group(frames: list[Frame], per_message: list[int]) -> list[list[Frame]]:
    out, i = [], 0
    for n in per_message:
        out.append(frames[i : i + n])
        i += n
    return out
