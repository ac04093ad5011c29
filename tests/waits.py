"""Waiting in tests on a condition, never on a fixed sleep: poll until it holds, with a deadline
generous enough for a heavily loaded 2-core machine."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

DEADLINE_S = 60.0


def wait_until(condition: Callable[[], bool], timeout: float = DEADLINE_S) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def wait_until_async(condition: Callable[[], bool], timeout: float = DEADLINE_S) -> bool:
    """`wait_until` inside an event loop: the loop keeps running while it polls."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def process_dead(pid: int) -> bool:
    """The process has exited entirely: gone, or a zombie its parent has not reaped yet, with
    every thread gone too. (A killed multi-threaded process shows its main thread as a zombie
    while its other threads still exit; until the last one has, its pipes stay open and its
    parent cannot reap it.)"""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    return all(_task_state(pid, task) in ("Z", "X", None) for task in tasks)


def _task_state(pid: int, task: str) -> str | None:
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
