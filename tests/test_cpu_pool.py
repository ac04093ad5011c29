"""WorkerPool: a job that overruns or crashes costs only that job; the pool keeps its size."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from waits import process_dead, wait_until

from tokenizer_manager.cpu_pool import CpuTimeExceeded, JobTimeout, WorkerDied, WorkerPool


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
