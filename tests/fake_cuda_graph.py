"""A CPU stand-in for CUDA graph capture and replay, to test what a captured forward replays.

`FakeGraph` records every op dispatched while it captures (the ops run once, as a capture's
result is there after it). `replay()` runs the recorded ops again, in order, on the very tensors
they read, and writes each op's results into the tensors it returned at capture. Like a CUDA
graph, a replay sees new values only through tensors the recorded ops read or wrote, and runs
no Python: a value computed before the capture began (outside the graph) is read as it was
then, and nothing the code decides on the host is decided again. Reading a device value on the
host while capturing raises, as CUDA does.

`install(monkeypatch)` puts the fake in place of the few torch.cuda names a capture uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense, aten.equal}


class CaptureReadsHost(RuntimeError):
    """The captured code read a device value on the host."""


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[tuple[Any, tuple, dict, Any]]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in HOST_READS:
            raise CaptureReadsHost(f"{func} reads a device value on the host during capture")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class FakeGraph:
    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.replays = 0

    def pool(self) -> object:
        return self

    def replay(self) -> None:
        with torch.inference_mode():
            for func, args, kwargs, out in self.ops:
                new = func(*args, **kwargs)
                for old_t, new_t in zip(tree_leaves(out), tree_leaves(new)):
                    if isinstance(old_t, torch.Tensor) and not _same_storage(old_t, new_t):
                        old_t.copy_(new_t)  # a view's values are already those of its base
        self.replays += 1


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass


@contextlib.contextmanager
def _capture(graph: FakeGraph, pool: object | None = None) -> Iterator[None]:
    with _Recorder(graph.ops):
        yield


def install(monkeypatch: pytest.MonkeyPatch) -> list[FakeGraph]:
    """Fake CUDA graphs for this test; returns the list every new graph is added to."""
    graphs: list[FakeGraph] = []

    def new_graph() -> FakeGraph:
        graphs.append(FakeGraph())
        return graphs[-1]

    monkeypatch.setattr(torch.cuda, "CUDAGraph", new_graph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return graphs
