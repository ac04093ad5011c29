"""Run a function on N ranks of a Gloo group in spawned processes, and always clean up."""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple, queue: Any) -> None:
    from runtime.distributed import destroy_tp_group, init_tp_group

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        tp = init_tp_group(rank, world_size, f"tcp://127.0.0.1:{port}", use_cuda=False)
        queue.put((rank, "ok", pickle.dumps(fn(tp, *args))))  # plain bytes: no fd sharing
        destroy_tp_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        queue.put((rank, "error", traceback.format_exc()))


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """fn(tp_group, *args) on every rank; returns the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(queue, procs, world_size, timeout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def _collect(queue: Any, procs: list, world_size: int, timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    while len(results) < world_size:
        rank, status, value = queue.get(timeout=timeout)
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        results[rank] = pickle.loads(value)
    return [results[r] for r in range(world_size)]
