"""WorkerPool: a job that overruns or crashes costs only that job; the pool keeps its size."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from waits import process_dead, wait_until

from tokenizer_manager.cpu_pool import (
    JOB_ATTEMPTS,
    CpuTimeExceeded,
    JobTimeout,
    WorkerDied,
    WorkerPool,
)

KILL_ROUNDS = 8  # each round races a SIGKILL against the next job


@pytest.fixture()
def pool() -> Iterator[WorkerPool]:
    # a job timeout a loaded machine cannot hit with the quick jobs below, far below the stuck one
    workers = WorkerPool(2, job_timeout=5.0)
    assert workers.wait_ready(60)
    yield workers
    workers.shutdown()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_overrunning_job_is_killed_and_replaced(pool: WorkerPool) -> None:
    before = set(pool.pids())
    stuck = pool.submit(time.sleep, 600)
    assert wait_until(stuck.running)  # the stuck job holds one worker; the other stays free
    quick = pool.submit(divmod, 7, 2)
    assert quick.result(60) == (3, 1)
    # cut at the job timeout, long before the job's own 600 s
    with pytest.raises(JobTimeout):
        stuck.result(120)
    assert pool.wait_ready(60)
    after = set(pool.pids())
    assert len(after) == 2 and len(before & after) == 1
    assert all(gone(pid) for pid in before - after)
    assert pool.submit(divmod, 9, 4).result(30) == (2, 1)


def spin(cpu_seconds: float | None = None) -> float:
    """Burn CPU time in this process (forever with None); returns what it used."""
    start = time.process_time()
    while cpu_seconds is None or time.process_time() - start < cpu_seconds:
        pass
    return time.process_time() - start


def test_a_job_past_its_cpu_time_fails_and_its_worker_is_replaced() -> None:
    """The CPU-time deadline holds per job (three jobs of 0.6 s each pass a 1 s limit), and a
    job that spins past it dies: only that job fails, the pool keeps serving."""
    pool = WorkerPool(1, job_timeout=120.0, cpu_seconds=1.0)
    try:
        assert pool.wait_ready(60)
        assert all(pool.submit(spin, 0.6).result(60) >= 0.6 for _ in range(3))
        (before,) = pool.pids()
        with pytest.raises(CpuTimeExceeded, match="CPU time"):
            pool.submit(spin).result(120)
        assert gone(before)
        assert pool.submit(divmod, 7, 2).result(60) == (3, 1)
        assert pool.pids() != [before]
    finally:
        pool.shutdown()


def test_a_worker_that_dies_fails_only_its_job(pool: WorkerPool) -> None:
    with pytest.raises(WorkerDied):
        pool.submit(os._exit, 3).result(30)
    assert pool.submit(divmod, 5, 5).result(30) == (1, 0)
    assert pool.wait_ready(60) and len(pool.pids()) == 2


def test_a_dead_idle_worker_is_replaced_before_use(pool: WorkerPool) -> None:
    pids = pool.pids()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: all(process_dead(pid) for pid in pids))
    assert [pool.submit(divmod, 4, 2).result(30) for _ in range(3)] == [(2, 0)] * 3
    assert not set(pool.pids()) & set(pids)


def test_errors_come_back_and_shutdown_ends_busy_workers() -> None:
    pool = WorkerPool(1, job_timeout=60.0)
    with pytest.raises(ZeroDivisionError):
        pool.submit(divmod, 1, 0).result(60)
    busy = pool.submit(time.sleep, 600)
    assert wait_until(busy.running)
    pids = pool.pids()
    closing = threading.Thread(target=pool.shutdown)
    closing.start()
    # shutdown ends the busy worker: it returns long before the job's own 600 s
    closing.join(120)
    assert not closing.is_alive()
    assert busy.done() and all(gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(divmod, 1, 1)


def test_a_worker_killed_while_idle_costs_no_job() -> None:
    """SIGKILL returns before the worker is gone: a job submitted right after finds it still
    looking alive. The job never started there, so it runs on a fresh worker instead."""
    pool = WorkerPool(1, job_timeout=60.0)
    try:
        assert pool.wait_ready(60)
        for _ in range(KILL_ROUNDS):
            (pid,) = pool.pids()
            os.kill(pid, signal.SIGKILL)
            assert pool.submit(divmod, 7, 2).result(120) == (3, 1)
            assert pool.pids() != [pid]
    finally:
        pool.shutdown()


def mark_and_exit(path: str) -> None:
    """Note one call in the file at `path`, then end this process at once."""
    with open(path, "a") as f:
        f.write("x")
    os._exit(3)


def mark_and_spin(path: str) -> None:
    """Note one call in the file at `path`, then spin until the CPU deadline ends the process."""
    with open(path, "a") as f:
        f.write("x")
    spin()


class KillsOnLoad:
    """An argument whose unpickling ends the process: its job can never start on any worker."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return mark_and_exit, (self.path,)


def calls(path: Path) -> int:
    return len(path.read_text()) if path.exists() else 0


def test_a_job_that_kills_its_worker_while_running_fails_once(
    pool: WorkerPool, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    with pytest.raises(WorkerDied, match="died during a job"):
        pool.submit(mark_and_exit, str(marks)).result(60)
    assert calls(marks) == 1  # its own error, not retried
    assert pool.submit(divmod, 5, 5).result(60) == (1, 0)


def test_a_job_past_its_cpu_time_is_not_retried(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    pool = WorkerPool(1, job_timeout=120.0, cpu_seconds=0.3)
    try:
        with pytest.raises(CpuTimeExceeded):
            pool.submit(mark_and_spin, str(marks)).result(120)
        assert calls(marks) == 1
    finally:
        pool.shutdown()


def test_workers_dying_before_a_job_starts_are_retried_a_bounded_number_of_times(
    pool: WorkerPool, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    with pytest.raises(WorkerDied, match="before taking"):
        pool.submit(len, KillsOnLoad(str(marks))).result(120)
    assert calls(marks) == JOB_ATTEMPTS
    assert pool.submit(divmod, 9, 4).result(60) == (2, 1)
    assert pool.wait_ready(60) and len(pool.pids()) == 2


class FailsOnLoad:
    """An argument whose unpickling raises: the worker reads the job but cannot run it."""

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return int, ("not a number",)


def test_a_job_that_cannot_be_read_fails_with_its_own_error(pool: WorkerPool) -> None:
    before = pool.pids()
    with pytest.raises(ValueError, match="not a number"):
        pool.submit(len, FailsOnLoad()).result(60)
    assert pool.submit(divmod, 9, 4).result(60) == (2, 1)
    assert pool.pids() == before  # no worker died for it


def loaded_modules(names: tuple[str, ...]) -> dict[str, bool]:
    import gc
    import sys

    # the fork server froze what it imported: the worker inherits a permanent generation
    return {name: name in sys.modules for name in names} | {"frozen": gc.get_freeze_count() > 0}


def test_workers_are_forked_with_the_media_code_already_imported(pool: WorkerPool) -> None:
    """A worker (and the replacement of a killed one) is forked from a fork server that has
    imported the media code once, so it does not import it again for seconds (a spawned worker
    starts with nothing imported), and that froze those objects for the collector."""
    from tokenizer_manager.cpu_pool import MEDIA_WORKER_PRELOAD

    want = dict.fromkeys([*MEDIA_WORKER_PRELOAD, "frozen"], True)
    assert pool.submit(loaded_modules, MEDIA_WORKER_PRELOAD).result(30) == want
    first = pool.pids()
    for pid in first:
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: all(gone(pid) for pid in first))
    replies = [pool.submit(loaded_modules, MEDIA_WORKER_PRELOAD) for _ in range(4)]
    assert all(r.result(30) == want for r in replies)
    assert not set(pool.pids()) & set(first)
    # every worker's parent is the one fork server, not this process
    parents = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
               for pid in pool.pids()}
    assert len(parents) == 1 and os.getpid() not in parents


def allocate(size: int) -> int:
    return len(bytearray(size))


def test_memory_bytes_caps_what_a_job_may_allocate() -> None:
    """With `memory_bytes`, a job that allocates past the cap fails with MemoryError (the
    address-space limit holds it) and the worker lives on to serve the next job."""
    pool = WorkerPool(1, job_timeout=60.0, memory_bytes=64 << 20, name="capped")
    try:
        assert pool.submit(allocate, 16 << 20).result(60) == 16 << 20
        before = pool.pids()
        with pytest.raises(MemoryError):
            pool.submit(allocate, 512 << 20).result(60)
        assert pool.submit(allocate, 16 << 20).result(60) == 16 << 20
        assert pool.pids() == before
    finally:
        pool.shutdown()
