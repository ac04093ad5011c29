"""Tensor-parallel process groups and the collectives tessera uses.

Every layer receives a `TPGroup` explicitly; nothing here is a module global. The device group
carries tensors (NCCL when every rank has a GPU, Gloo on CPU); the CPU group is always Gloo and
carries pickled Python objects from the entry rank to the others.
"""

from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group in place and return it."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate equally shaped tensors from every rank along `dim`."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        out = torch.empty(
            (self.size * tensor.shape[0], *tensor.shape[1:]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        _all_gather_single(out, tensor, group=self.device_group)
        if dim in (0, -tensor.dim()):
            return out
        parts = out.chunk(self.size, dim=0)
        return torch.cat(parts, dim=dim)

    def all_reduce_cpu(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce a small CPU tensor over the Gloo group (flags, counts)."""
        if self.size > 1:
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            reduce_op = ops[op]
            dist.all_reduce(tensor, op=reduce_op, group=self.cpu_group)
        return tensor

    def broadcast_pyobj(self, data: object, src: int = 0) -> object:
        return broadcast_pyobj(data, self.rank, self.cpu_group, src=src, world_size=self.size)


def _all_gather_single(out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=group)


def broadcast_pyobj(
    data: object,
    rank: int,
    group: dist.ProcessGroup | None,
    src: int = 0,
    world_size: int | None = None,
) -> object:
    """Send a picklable object from `src` to every rank of `group`; every rank must call this.

    The size goes first, then the pickled bytes, so ranks that receive need no prior knowledge of
    the payload. With a one-rank group (or no group) the object is returned unchanged.
    """
    if world_size is None:
        world_size = 1 if group is None else dist.get_world_size(group)
    if world_size == 1:
        return data
    global_src = dist.get_global_rank(group, src) if group is not None else src
    if rank == src:
        payload = pickle.dumps(data)
        size = torch.tensor([len(payload)], dtype=torch.long)
        dist.broadcast(size, src=global_src, group=group)
        if len(payload):
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(buf, src=global_src, group=group)
        return data
    size = torch.tensor([0], dtype=torch.long)
    dist.broadcast(size, src=global_src, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=global_src, group=group)
    return pickle.loads(buf.numpy().tobytes())


def init_tp_group(
    rank: int,
    world_size: int,
    init_method: str,
    use_cuda: bool,
    timeout_s: float = 300.0,
) -> TPGroup:
    """Create the default process group and the two TP groups (one node, all ranks in one group).

    `init_method` is e.g. "tcp://127.0.0.1:29500". With `use_cuda` the device group is NCCL and
    rank r uses cuda:r; the CPU group is always Gloo.
    """
    if world_size == 1:
        return TPGroup()
    backend = "nccl" if use_cuda else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        store=rendezvous_store(init_method, rank, world_size, timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    ranks = list(range(world_size))
    device_group = dist.new_group(ranks, backend=backend)
    cpu_group = dist.new_group(ranks, backend="gloo") if use_cuda else device_group
    return TPGroup(rank=rank, size=world_size, device_group=device_group, cpu_group=cpu_group)


def rendezvous_store(
    init_method: str, rank: int, world_size: int, timeout: timedelta
) -> dist.TCPStore:
    """The c10d store for "tcp://host:port". Rank 0 serves it on a socket bound to `host` only
    (by itself TCPStore listens on every interface); the store carries pickles, so it must not
    be reachable from any network but the one the ranks share."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    host, port = url.hostname, url.port
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family)
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach())


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
