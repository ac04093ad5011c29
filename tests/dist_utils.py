"""Run a function on N ranks of a Gloo group in spawned processes, and always clean up."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    from runtime.distributed import destroy_tp_group, init_tp_group

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        tp = init_tp_group(rank, world_size, f"tcp://127.0.0.1:{port}", use_cuda=False)
        try:
            results.put((rank, "ok", pickle.dumps(fn(tp, *args))))  # bytes: no tensor fd sharing
        finally:
            destroy_tp_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """fn(tp_group, *args) on every rank; returns the per-rank results in rank order.

    Raises on the first rank error, on a rank that dies without reporting, and at the deadline;
    every child is joined, then terminated or killed if it lingers.
    """
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(results, procs, time.monotonic() + timeout)
    finally:
        _reap(procs)


def _collect(results: Any, procs: list, deadline: float) -> list[Any]:
    got: dict[int, Any] = {}
    while len(got) < len(procs):
        try:
            rank, status, value = results.get(timeout=0.5)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got]
            if dead:
                raise RuntimeError(f"ranks {dead} died without reporting") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(got))
                raise TimeoutError(f"ranks {missing} did not report in time") from None
            continue
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        got[rank] = pickle.loads(value)
    return [got[r] for r in range(len(procs))]


def _reap(procs: list) -> None:
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
