"""Messages as frames: a pickle of the message plus its tensors' bytes as separate buffers.

`to_frames` pickles with protocol 5 and hands every CPU tensor's memory out of band (as a numpy
buffer), so a request's pixels are neither copied into the pickle nor pushed through torch's
storage pickling; ZMQ sends the frames without copying them (`send_multipart(copy=False)`). The
scheduler's entry rank forwards the frames it received to the other ranks unchanged
(`broadcast_frames`: one size vector and one byte tensor), and every rank rebuilds the message
with `from_frames`, whose tensors are views of the received buffers. So a request's features
cross each process boundary once and are pickled once, in the TokenizerManager.

Received tensors share the receive buffer: they are inputs, read and never written in place.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

Frame = bytes | memoryview


class _Pickler(pickle.Pickler):
    """Protocol 5 with CPU tensors reduced to numpy arrays (whose bytes go out of band)."""

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, torch.Tensor) and _numpy_ready(obj):
            return _tensor_from_numpy, (obj.detach().contiguous().numpy(),)
        return NotImplemented


def _numpy_ready(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and t.dtype != torch.bfloat16


def _tensor_from_numpy(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only receive buffer: see module doc
        return torch.from_numpy(array)


def to_frames(obj: object) -> list[Frame]:
    """[pickle, buffer, buffer, ...]; the buffers are views of the tensors' memory."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    return [out.getbuffer(), *(b.raw() for b in buffers)]


def from_frames(frames: Sequence[Frame]) -> object:
    return pickle.loads(frames[0], buffers=frames[1:])


def broadcast_frames(
    messages: list[list[Frame]] | None, rank: int, group: dist.ProcessGroup | None, size: int
) -> list[list[Frame]]:
    """Rank 0's messages (each a list of frames) on every rank of `group`; every rank calls it.

    One long tensor of [message count, frames per message..., frame sizes...] goes first, then all
    frames concatenated into one byte tensor; receivers slice it without copying."""
    if size == 1:
        return messages or []
    if rank == 0:
        layout = [len(messages)] + [len(m) for m in messages]
        layout += [memoryview(f).nbytes for m in messages for f in m]
        header = torch.tensor([len(layout), *layout], dtype=torch.long)
    else:
        header = torch.zeros(1, dtype=torch.long)
    count = _broadcast_header(header, rank, group)
    n_messages = int(count[1])
    per_message = count[2 : 2 + n_messages].tolist()
    sizes = count[2 + n_messages :].tolist()
    payload = torch.empty(sum(sizes), dtype=torch.uint8)
    if rank == 0:
        _concatenate([f for m in messages for f in m], payload.numpy())
    if payload.numel():
        dist.broadcast(payload, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    if rank == 0:
        return messages
    return _split(memoryview(payload.numpy()), per_message, sizes)


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


def _split(buffer: memoryview, per_message: list[int], sizes: list[int]) -> list[list[Frame]]:
    frames, start = [], 0
    for size in sizes:
        frames.append(buffer[start : start + size])
        start += size
    out, i = [], 0
    for n in per_message:
        out.append(frames[i : i + n])
        i += n
    return out
