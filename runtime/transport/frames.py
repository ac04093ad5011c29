"""Messages as frames: a pickle of the message plus its tensors' bytes as separate buffers.

`to_frames` pickles with protocol 5 and hands every CPU tensor's memory out of band (as a numpy
buffer), so a request's pixels are neither copied into the pickle nor pushed through torch's
storage pickling; ZMQ sends the frames without copying them (`send_multipart(copy=False)`).
Every receiver rebuilds the message with `from_frames`, whose tensors are views of the received
buffers. So a request's features are pickled once, in the TokenizerManager. A `SharedTensor`
travels by name (a reference that only `from_frames` resolves): the receiver maps or reads its
file.

Received tensors share the receive buffer: they are inputs, read and never written in place.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from runtime.transport.shm import SharedTensor, remove_file

Frame = bytes | memoryview


class _Pickler(pickle.Pickler):
    """Protocol 5 with CPU tensors reduced to numpy arrays (whose bytes go out of band) and
    shared tensors pickled by name (collected in `shared`).

    Everything is done in `reducer_override`, which pickle skips for ints, strings, lists and
    the other plain types: a `persistent_id` would be called for every object, each id of a
    prompt included (0.3 ms of Python calls for a 650-token request)."""

    def __init__(self, file: io.BytesIO, buffers: list, shared: list[SharedTensor]):
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self.shared = shared

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, torch.Tensor) and _numpy_ready(obj):
            return _tensor_from_numpy, (obj.detach().contiguous().numpy(),)
        if type(obj) is SharedTensor:
            self.shared.append(obj)
            return _shared_tensor, (obj.path, obj.shape, obj.dtype)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    """Reads every shared tensor it meets and notes the file in `loaded`."""

    def __init__(self, file: io.BytesIO, buffers: Sequence[Frame], loaded: list[str]):
        super().__init__(file, buffers=buffers)
        self.loaded = loaded

    def find_class(self, module: str, name: str) -> object:
        if module == __name__ and name == _shared_tensor.__name__:
            return self.load_shared  # the shared tensor's reference, read by this receiver
        return super().find_class(module, name)

    def load_shared(self, path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = SharedTensor(path, shape, dtype, owned=False).load()
        self.loaded.append(path)
        return tensor


def _shared_tensor(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Where a pickle names a shared tensor; only `_Unpickler` (which reads it) may load it."""
    raise pickle.UnpicklingError(f"the shared tensor {path} is read by from_frames only")


def _numpy_ready(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and t.dtype != torch.bfloat16


def _tensor_from_numpy(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only receive buffer: see module doc
        return torch.from_numpy(array)


def to_frames(obj: object, shared: list[SharedTensor] | None = None) -> list[Frame]:
    """[pickle, buffer, buffer, ...]; the buffers are views of the tensors' memory. Shared
    tensors go by name: they are appended to `shared`, for the sender to hand off once sent.
    Never torch's storage pickling (invariant 13)."""
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
