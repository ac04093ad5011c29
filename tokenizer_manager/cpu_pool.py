"""A pool of CPU worker processes where one stuck or crashed job costs only that job.

The standard library's ProcessPoolExecutor cannot stop a job that runs too long (cancelling the
future leaves the process busy), and one dead worker breaks the whole pool and every job in it.
Here each worker process has its own pipe and its own feeder thread in the parent:

- the feeder takes the next job, sends it, and waits at most `job_timeout` seconds for the result;
- a job that overruns gets its process killed and a fresh one started in its place (the pool keeps
  its size), and only that job fails, with `JobTimeout`;
- with `cpu_seconds`, a job also has a CPU-time deadline, which the kernel holds: the worker arms
  a CPU-time interval timer (ITIMER_PROF, counting every thread of the process) before each job
  and disarms it after, so a job spinning in native code (a decoder on a hostile image) gets
  SIGPROF, whose default action ends the process; only that job fails, with `CpuTimeExceeded`,
  and the worker is replaced;
- a worker that dies during a job fails only that job (`WorkerDied`) and is replaced;
- a worker that was dead before it took a job is the pool's problem, not the job's: the job runs
  on a fresh worker instead. A worker says `STARTED` as soon as it has read a job, so the parent
  knows which side of that line a death fell on. (No check before sending can be enough: SIGKILL
  is delivered asynchronously, and a killed process keeps its pipe open and cannot be reaped
  until its last thread has exited.) After `JOB_ATTEMPTS` workers in a row die before taking the
  same job, it fails with `WorkerDied`.

Jobs are plain module-level functions over picklable arguments, as with ProcessPoolExecutor.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import queue
import resource
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from runtime.logging_utils import get_logger
from runtime.parent_watch import exit_with_parent

logger = get_logger(__name__)

START_TIMEOUT = 120.0  # seconds a fresh worker may take to import and run its initializer
STOP_TIMEOUT = 5.0  # seconds a worker gets to exit before it is killed
JOB_ATTEMPTS = 3  # workers a job may find dead before it fails
STARTED = "started"  # a worker's word that it has read a job and runs it now
FORK_SERVER_ENV = "TESSERA_MEDIA_FORK_SERVER"  # set in the fork server's environment only
# what a media worker imports before its first job (transformers' image processing is most of
# a worker's start-up), and a grammar worker's engine: the fork server's preload, frozen for the
# collector once imported
MEDIA_WORKER_PRELOAD = (
    "tokenizer_manager.media.worker",
    "transformers.image_processing_utils",
    "tokenizer_manager.grammar_worker",
    "runtime.grammar.llguidance_backend",
    "tokenizer_manager.media_fork_server",
)


class JobTimeout(Exception):
    """A job ran past the pool's job timeout; its worker was killed and replaced."""


class CpuTimeExceeded(JobTimeout):
    """A job used more CPU time than the pool allows; its worker died of SIGPROF and was
    replaced."""


class WorkerDied(Exception):
    """The worker process running a job died (a crash in native code, a kill)."""


def _worker_main(
    conn: Connection,
    initializer: Callable[..., Any] | None,
    args: tuple,
    cpu_seconds: float | None = None,
    memory_bytes: int | None = None,
) -> None:
    exit_with_parent()
    if initializer is not None:
        initializer(*args)
    if memory_bytes is not None:
        limit_address_space(memory_bytes)
    signal.signal(signal.SIGPROF, signal.SIG_DFL)  # the CPU deadline ends the process
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        except Exception as exc:  # noqa: BLE001 - a job that cannot be read is that job's error
            conn.send(STARTED)
            _send_reply(conn, (False, exc))
            continue
        if job is None:
            return
        conn.send(STARTED)
        fn, fn_args = job
        cpu_deadline(cpu_seconds)
        try:
            reply = (True, fn(*fn_args))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            reply = (False, exc)
        cpu_deadline(None)
        _send_reply(conn, reply)


def cpu_deadline(seconds: float | None) -> None:
    """SIGPROF (which ends the process) once it has used `seconds` more CPU time; None
    disarms."""
    signal.setitimer(signal.ITIMER_PROF, seconds or 0.0)


def limit_address_space(headroom: int) -> None:
    """Cap this process's address space at its size now plus `headroom` bytes (RLIMIT_AS): a
    job that allocates past it gets MemoryError, or dies of the allocator's abort in native
    code, and only that job fails."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = size + headroom
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard < 0 else min(soft, hard), hard))


def _send_reply(conn: Connection, reply: tuple[bool, Any]) -> None:
    try:
        conn.send(reply)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result or error
        conn.send((False, RuntimeError(f"a worker result could not be sent back: {exc!r}")))


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple
    future: Future = field(default_factory=Future)


class _Worker:
    """One worker process and its end of the pipe; restarted in place."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self.process: multiprocessing.Process | None = None
        self.conn: Connection | None = None
        self.ready = threading.Event()

    def start(self) -> None:
        parent, child = self.pool.ctx.Pipe()
        self.process = self.pool.ctx.Process(
            target=_worker_main,
            args=(
                child,
                self.pool.initializer,
                self.pool.initargs,
                self.pool.cpu_seconds,
                self.pool.memory_bytes,
            ),
            daemon=True,
            name=f"tessera-{self.pool.name}-cpu",
        )
        self.process.start()
        child.close()
        self.conn = parent
        if not parent.poll(START_TIMEOUT):
            self.kill()
            raise RuntimeError(f"a {self.pool.name} worker process did not start")
        parent.recv()
        self.ready.set()

    def alive(self) -> bool:
        """Not reaped (waitpid) and its sentinel not yet closed by its exit."""
        process = self.process
        return process is not None and process.is_alive() and not wait([process.sentinel], 0)

    def kill(self) -> None:
        self.ready.clear()
        if self.process is not None:
            self.process.kill()
            self.process.join(STOP_TIMEOUT)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None

    def pids_text(self) -> str:
        return str(self.process.pid) if self.process is not None else "-"

    def terminate(self) -> None:
        """Kill the process only; the feeder sees the pipe close and settles the job."""
        process = self.process
        if process is not None:
            process.kill()

    def stop(self) -> None:
        if self.process is None:
            return
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(STOP_TIMEOUT)
        self.kill()

    def run(self, job: _Job) -> None:
        """Run one job here and settle its future; replace the process when it overran or died,
        and retry on a fresh one when it was dead before it took the job."""
        tries = 0
        while tries < JOB_ATTEMPTS and not (tries and self.pool.closed):
            tries += 1
            if self._try(job):
                return
        self._give_up(job, tries)

    def _try(self, job: _Job) -> bool:
        """Hand the job to a live worker; False when the worker died before taking it."""
        if not self.alive():
            self.kill()
            self.start()
        deadline = time.monotonic() + self.pool.job_timeout
        taken = self._hand_over(job, deadline)
        if taken is False:
            name = self.pool.name
            logger.warning("%s worker %s died before taking a job", name, self.pids_text())
            self.kill()
            return False
        self._settle(job, deadline if taken else None)
        return True

    def _give_up(self, job: _Job, attempts: int) -> None:
        """Fail a job that no worker lived to take; the pool keeps its size."""
        job.future.set_exception(
            WorkerDied(
                f"{self.pool.name} worker processes died before taking the job "
                f"({attempts} tried)"
            )
        )
        if not self.pool.closed:
            self.start()

    def _hand_over(self, job: _Job, deadline: float) -> bool | None:
        """Send the job: True once the worker has taken it, False when the worker was (or went)
        dead before it did, None when it said nothing by the deadline."""
        try:
            self.conn.send((job.fn, job.args))
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                return None
            return self.conn.recv() == STARTED
        except (EOFError, OSError):
            return False

    def _settle(self, job: _Job, deadline: float | None) -> None:
        """Wait for the result of a job the worker has taken (None: it overran already)."""
        ok, value = None, None
        try:
            if deadline is not None and self.conn.poll(max(0.0, deadline - time.monotonic())):
                ok, value = self.conn.recv()
        except (EOFError, OSError):
            value = self._death()
        if ok is None:
            self._replace(job, value)
        elif ok:
            job.future.set_result(value)
        else:
            job.future.set_exception(value)

    def _death(self) -> Exception:
        """Why the worker's pipe closed during a job: its CPU-time limit, or a crash."""
        self.process.join(STOP_TIMEOUT)
        if self.process.exitcode == -signal.SIGPROF:
            return CpuTimeExceeded(f"took more than {self.pool.cpu_seconds:g} s of CPU time")
        return WorkerDied(f"a {self.pool.name} worker process died during a job")

    def _replace(self, job: _Job, died: Exception | None) -> None:
        if died is None:
            logger.warning(
                "a %s job ran past %g s; killing its worker", self.pool.name, self.pool.job_timeout
            )
            error: Exception = JobTimeout(f"took longer than {self.pool.job_timeout:g} s")
        elif isinstance(died, CpuTimeExceeded):
            logger.warning("a %s job %s; replacing its worker", self.pool.name, died)
            error = died
        else:
            logger.error(
                "%s worker %s died during a job; replacing it", self.pool.name, self.process.pid
            )
            error = died
        self.kill()
        job.future.set_exception(error)
        if not self.pool.closed:
            self.start()


def start_fork_server() -> multiprocessing.context.BaseContext:
    """The context that forks worker processes from this process's fork server, started now if
    it is not running: MEDIA_WORKER_PRELOAD is imported once there, before the first fork, so
    a worker (and the replacement of a killed one) starts in well under a second where a
    spawned one imported everything again for seconds. Returns at once: the server imports
    while the caller goes on."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(MEDIA_WORKER_PRELOAD))
    os.environ[FORK_SERVER_ENV] = "1"  # the server starts with this process's environment
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        del os.environ[FORK_SERVER_ENV]
    return ctx


class WorkerPool:
    """`size` worker processes (forked from the fork server), fed from one queue; see the module
    docstring. `name` (media, grammar) names the processes and the log lines; `memory_bytes`
    caps each worker's address space that far above its size after the initializer."""

    def __init__(
        self,
        size: int,
        *,
        job_timeout: float,
        cpu_seconds: float | None = None,
        initializer: Callable[..., Any] | None = None,
        initargs: tuple = (),
        name: str = "media",
        memory_bytes: int | None = None,
    ):
        self.ctx = start_fork_server()
        self.name, self.memory_bytes = name, memory_bytes
        self.job_timeout = job_timeout
        self.cpu_seconds = cpu_seconds
        self.initializer, self.initargs = initializer, initargs
        self.closed = False
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._workers = [_Worker(self) for _ in range(size)]
        self._feeders = [
            threading.Thread(
                target=self._feed, args=(w,), daemon=True, name=f"tessera-{name}-feed"
            )
            for w in self._workers
        ]
        for feeder in self._feeders:
            feeder.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self.closed:
            raise RuntimeError(f"the {self.name} worker pool is closed")
        job = _Job(fn, args)
        self._jobs.put(job)
        return job.future

    def wait_ready(self, timeout: float = START_TIMEOUT) -> bool:
        """Block until every worker is up (False after `timeout`); replacements count too."""
        return all(w.ready.wait(timeout) for w in self._workers)

    def pids(self) -> list[int]:
        processes = [w.process for w in self._workers if w.process is not None]
        return [p.pid for p in processes if p.pid is not None]

    def _feed(self, worker: _Worker) -> None:
        try:
            worker.start()
        except Exception:  # noqa: BLE001 - retried on the first job
            if not self.closed:
                logger.exception("a %s worker failed to start", self.name)
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                worker.run(job)
            except Exception as exc:  # noqa: BLE001 - a failed restart fails this job only
                if not job.future.done():
                    job.future.set_exception(exc)
        worker.stop()

    def shutdown(self) -> None:
        """Stop taking jobs, fail the queued ones, let running ones end (or be killed), join."""
        self.closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.future.cancel()
        for _ in self._feeders:
            self._jobs.put(None)
        for feeder in self._feeders:
            feeder.join(STOP_TIMEOUT)
        for worker, feeder in zip(self._workers, self._feeders):
            if feeder.is_alive():  # still in a job: end it now
                logger.warning("terminating busy %s worker %s", self.name, worker.pids_text())
                worker.terminate()
            feeder.join(STOP_TIMEOUT)
