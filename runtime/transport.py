"""Messages as frames: a pickle of the message plus its tensors' bytes as separate buffers.

`to_frames` pickles with protocol 5 and hands every CPU tensor's memory out of band (as a numpy
buffer), so a request's pixels are neither copied into the pickle nor pushed through torch's
storage pickling; ZMQ sends the frames without copying them (`send_multipart(copy=False)`). The
scheduler's entry rank forwards the frames it received to the other ranks unchanged
(`broadcast_frames`: one size vector and one byte tensor), and every rank rebuilds the message
with `from_frames`, whose tensors are views of the received buffers. So a request's features
cross each process boundary once and are pickled once, in the TokenizerManager. On one node the
large frames go to the other ranks through a shared-memory file instead of the group (only the
layout, the segment's token and the pickles are broadcast), once per request, never per step.

Media pixels skip even that copy on one node: the media worker that made them writes them into
a shared-memory file (`SharedTensor`), and only its name travels, in the pickle (a persistent
reference). Whoever unpickles it maps the file, or reads it past its mapping budget
(`MapBudget`). The file is owned by exactly one place at a time, and removed when its owner lets
go: the TokenizerManager until the request is sent (dropped unsent: removed), then the scheduler
ranks, where rank 0 removes it once every rank has mapped or read it (`release_loaded`). A
server that stops sweeps what a killed process left behind.

Received tensors share the receive buffer: they are inputs, read and never written in place.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import mmap
import os
import pickle
import re
import secrets
import threading
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from runtime.logging_utils import get_logger

logger = get_logger(__name__)

Frame = bytes | memoryview


SHM_DIR = "/dev/shm"
MEDIA_PREFIX = "tessera-media-"
_MEDIA_NAME = re.compile(re.escape(MEDIA_PREFIX) + r"(\d+)-[0-9a-f]+$")


def local_shm_dir(nnodes: int) -> str | None:
    """Shared memory that every process of this server can map: /dev/shm when all of them run
    on this node, else None (everything then crosses as bytes)."""
    return SHM_DIR if nnodes == 1 and os.path.isdir(SHM_DIR) else None


class SharedTensor:
    """A tensor's bytes in a file in shared memory, passed between processes by name.

    The producer (a media worker) writes the file at a path its caller chose and returns an
    unowned handle; the handle it pickles back arrives owned: the receiving process removes the
    file when the handle is dropped, unless it `hand_off()`s the file to the next owner."""

    __slots__ = ("path", "shape", "dtype", "_owner", "__weakref__")

    def __init__(self, path: str, shape: tuple[int, ...], dtype: str, owned: bool = True):
        self.path, self.shape, self.dtype = path, tuple(int(n) for n in shape), dtype
        self._owner = weakref.finalize(self, remove_file, path) if owned else None

    def __reduce__(self) -> tuple:
        return SharedTensor, (self.path, self.shape, self.dtype)

    def __repr__(self) -> str:
        return f"SharedTensor({self.path!r}, {self.shape}, {self.dtype})"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def owned(self) -> bool:
        return self._owner is not None and self._owner.alive

    def hand_off(self) -> None:
        """The file now belongs to whoever received this handle: dropping it removes nothing."""
        if self._owner is not None:
            self._owner.detach()

    def release(self) -> None:
        """Remove the file now (if this handle owns it)."""
        if self._owner is not None:
            self._owner()

    @classmethod
    def write(cls, array: np.ndarray, path: str) -> SharedTensor:
        """Write `array` into a new file at `path`; an unowned handle to it. The space is
        reserved first, so a full shared memory is an OSError here (nothing is left behind),
        never a fault in a process that maps the file later."""
        data = np.ascontiguousarray(array)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            if data.nbytes:
                os.posix_fallocate(fd, 0, data.nbytes)
            with open(fd, "wb", closefd=False) as out:
                out.write(memoryview(data.reshape(-1).view(np.uint8)))
        except BaseException:
            remove_file(path)
            raise
        finally:
            os.close(fd)
        return cls(path, data.shape, data.dtype.name, owned=False)

    def load(self) -> torch.Tensor:
        """The tensor: the file mapped while this process's mappings stay within its budget
        (`MAPPED`), else read into this process's memory in one call."""
        if self.nbytes and MAPPED.take(self.path, self.nbytes):
            try:
                return self._map()
            except BaseException:
                MAPPED.give(self.nbytes)
                raise
        return self._read()

    def _map(self) -> torch.Tensor:
        """A shared mapping, its pages mapped up front (no fault when it is read): no copy, 0.27
        against 1.2 ms for a 4.8 MB image. Shared, not copy-on-write like a frame segment
        (`_map_segment`): a private mapping populated up front copies every page. So the pages
        are the other ranks' too; inputs are never written in place. They stay until the
        tensor is dropped, even after the file is removed."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < self.nbytes:  # a shorter file would fault when read
                raise OSError(f"{self.path}: shorter than {self.nbytes} bytes")
            buffer = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        finally:
            os.close(fd)
        tensor = torch.frombuffer(buffer, dtype=getattr(torch, self.dtype)).view(self.shape)
        weakref.finalize(buffer, MAPPED.give, self.nbytes)  # last: nothing after it can raise
        return tensor

    def _read(self) -> torch.Tensor:
        tensor = torch.empty(self.shape, dtype=getattr(torch, self.dtype))
        if self.nbytes:
            with open(self.path, "rb", buffering=0) as f:
                got = f.readinto(memoryview(tensor.view(torch.uint8).numpy()))
            if got != self.nbytes:
                raise OSError(f"{self.path}: {got} of {self.nbytes} bytes")
        return tensor


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class MapBudget:
    """Bytes of shared files this process holds mapped, at most a `1 / share` of the shared
    memory they live in. A mapping keeps its file's pages for the tensor's life (a request's),
    where a read frees them at once: past the budget files are read, so a small /dev/shm (a
    container's 64 MB default) never fills up with mapped inputs and refuses new media."""

    def __init__(self, share: int = 4):
        self.share = share
        self.mapped = 0
        self._limit: int | None = None
        self._lock = threading.Lock()

    def take(self, path: str, nbytes: int) -> bool:
        with self._lock:
            if self._limit is None:
                try:
                    fs = os.statvfs(os.path.dirname(path))
                    self._limit = fs.f_blocks * fs.f_frsize // self.share
                except OSError:
                    self._limit = 0
            if self.mapped + nbytes > self._limit:
                return False
            self.mapped += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.mapped -= nbytes


MAPPED = MapBudget()


_NAME_COUNTER = itertools.count()
_NAME_TOKEN = secrets.token_hex(4)  # a process of the same pid, later, never reuses a name


def new_media_path(shm_dir: str) -> str:
    """A fresh name for one media file; the creating process's pid is in it."""
    name = f"{MEDIA_PREFIX}{os.getpid()}-{_NAME_TOKEN}{next(_NAME_COUNTER):08x}"
    return os.path.join(shm_dir, name)


def sweep_media_files(shm_dir: str | None, owner_pid: int | None = None) -> int:
    """Remove media files named by `owner_pid`, or by any process that is gone (None): what a
    killed process left behind. Returns how many were removed."""
    if shm_dir is None or not os.path.isdir(shm_dir):
        return 0
    removed = 0
    for name in os.listdir(shm_dir):
        match = _MEDIA_NAME.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == owner_pid or (owner_pid is None and not _alive(pid)):
            remove_file(os.path.join(shm_dir, name))
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Pickler(pickle.Pickler):
    """Protocol 5 with CPU tensors reduced to numpy arrays (whose bytes go out of band) and
    shared tensors pickled by name (collected in `shared`)."""

    def __init__(self, file: io.BytesIO, buffers: list, shared: list[SharedTensor]):
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self.shared = shared

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, torch.Tensor) and _numpy_ready(obj):
            return _tensor_from_numpy, (obj.detach().contiguous().numpy(),)
        return NotImplemented

    def persistent_id(self, obj: object) -> object:
        if type(obj) is SharedTensor:
            self.shared.append(obj)
            return (obj.path, obj.shape, obj.dtype)
        return None


class _Unpickler(pickle.Unpickler):
    """Reads every shared tensor it meets and notes the file in `loaded`."""

    def __init__(self, file: io.BytesIO, buffers: Sequence[Frame], loaded: list[str]):
        super().__init__(file, buffers=buffers)
        self.loaded = loaded

    def persistent_load(self, pid: object) -> torch.Tensor:
        path, shape, dtype = pid
        tensor = SharedTensor(path, shape, dtype, owned=False).load()
        self.loaded.append(path)
        return tensor


def _numpy_ready(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and t.dtype != torch.bfloat16


def _tensor_from_numpy(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only receive buffer: see module doc
        return torch.from_numpy(array)


def to_frames(obj: object, shared: list[SharedTensor] | None = None) -> list[Frame]:
    """[pickle, buffer, buffer, ...]; the buffers are views of the tensors' memory. Shared
    tensors go by name: they are appended to `shared`, for the sender to hand off once sent."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, buffers, [] if shared is None else shared).dump(obj)
    return [out.getbuffer(), *(b.raw() for b in buffers)]


def from_frames(frames: Sequence[Frame], loaded: list[str] | None = None) -> object:
    """The message. Its shared tensors are read; their files are noted in `loaded` for
    `release_loaded`, or, without a list (a lone receiver), removed at once."""
    names: list[str] = [] if loaded is None else loaded
    obj = _Unpickler(io.BytesIO(frames[0]), frames[1:], names).load()
    if loaded is None:
        for path in names:
            remove_file(path)
    return obj


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


def remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.unlink(path)


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
