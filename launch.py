"""Start a tessera server: parse the flags, spawn the scheduler ranks and the detokenizer, wait
for each to report ready, serve HTTP in this process, and supervise the children.

    python launch.py --tp 4 --mm-enable-dp-encoder
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.allocator import freeze_startup_objects, keep_freed_memory
from runtime.logging_utils import configure_logging, get_logger
from runtime.replica_health import ReplicaHealth, RestartPolicy
from runtime.server_args import ServerArgs

if TYPE_CHECKING:
    from runtime.io_struct import ReadyReport  # unpickled from the children's pipes
    from scheduler.input_checks import FaultsFactory
    from tokenizer_manager.tokenizer_manager import TokenizerManager

logger = get_logger("tessera.launch")


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The HTTP server's socket, bound first thing and listening only once the server is ready
    (until then a client is refused, not left waiting): a busy port fails the launch at once,
    not after the model has loaded, and no port a child opens while it starts (Gloo listens on
    ephemeral ports) can take the one asked for."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot serve HTTP on {host}:{port}: {exc.strerror}") from None
    return sock


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_checkpoint_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "tessera" / "tiny-qwen2_vl-seed0"


def ensure_tiny_checkpoint() -> str:
    """Generate the built-in tiny random Qwen2-VL checkpoint once; reuse it afterwards."""
    folder = tiny_checkpoint_dir()
    if not (folder / "model.safetensors").is_file():
        from runtime.tiny_checkpoint import make_checkpoint  # torch and tokenizers: only here

        make_checkpoint("qwen2_vl", folder)
        logger.info("generated the built-in tiny random Qwen2-VL checkpoint in %s", folder)
    logger.info(
        "no --model-path given: serving the built-in tiny random Qwen2-VL checkpoint "
        "from %s (random weights: the text is meaningless)",
        folder,
    )
    return str(folder)


Child = tuple[str, mp.Process, Connection]  # a child process: its name, itself, its ready pipe


class Supervisor:
    """Owns the child processes: start, wait for ready acks, watch, and tear down. `faults`:
    testing only, handed to every scheduler rank (scheduler/input_checks.py).

    With --dp > 1 a replica may die alone (invariant 20): when any of its ranks exits, the
    others are ended (their collectives are broken), the front end fails the requests it held
    (`on_replica` hooks), and it is started again as `runtime.replica_health` rules (bounded
    tries, with backoff), by a long-lived thread of its own (one per replica, so replicas that
    die together restart side by side, and one that is slow to start delays no other): a
    child's kernel death signal follows the thread that started it, so no child is started
    from a thread that ends. The death of the
    detokenizer, of any rank with --dp 1, or of the last replica with its restarts spent stops
    the server."""

    def __init__(self, args: ServerArgs, faults: FaultsFactory | None = None):
        self.args, self.faults = args, faults
        self.ctx = mp.get_context("spawn")
        self.children: list[Child] = []  # the children watched (not a replica being restarted)
        self.ready_info: dict[str, ReadyReport] = {}
        self._fatal_hooks: list[Callable[[str], None]] = []
        self._replica_hooks: list[ReplicaHooks] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # children, _starting and health: the watch, the
        # replicas' restarts and the front end's questions run in threads of their own
        policy = RestartPolicy(args.replica_max_restarts, args.replica_restart_window)
        self.health = [ReplicaHealth(policy) for _ in range(args.dp_size)]
        self._replica_of: dict[str, int] = {}  # a scheduler rank's name -> its replica
        self._starting: dict[int, list[Child]] = {}  # restarted replicas' ranks, until ready
        self._killed: dict[int, str] = {}  # why a replica was killed (`kill`)
        # each replica's deaths (its dead ranks, the delay before its restart), for its thread
        self._restarts: list[queue.Queue[tuple[list[Child], float | None]]] = [
            queue.Queue() for _ in range(args.dp_size)
        ]

    def spawn(self, name: str, target, *args: object, **kwargs: object) -> Child:
        reader, writer = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(
            target=target, args=(*args, writer), kwargs=kwargs, name=name, daemon=True
        )
        proc.start()
        writer.close()  # the child's end: its death then reads as EOF on `reader`
        logger.info("started %s (pid %d)", name, proc.pid)
        return name, proc, reader

    def start(self) -> None:
        from runtime.detokenizer import run_detokenizer_process

        if self.args.encoder_only:
            return self.start_encoder()
        for replica in range(self.args.dp_size):
            self.children += self.spawn_replica(replica)
        if self.args.node_rank == 0:
            # one detokenizer for every replica: its state is per request (ids are unique
            # across replicas) and its work per token, so replicas share it as they share the
            # TokenizerManager; one process fewer per replica on the CPU the ranks need
            self.children.append(self.spawn("detokenizer", run_detokenizer_process, self.args))
        self.wait_ready(self.children)
        logger.info("all %d child processes are ready", len(self.children))

    def start_encoder(self) -> None:
        """An encoder server's ranks (--encoder-only): the vision tower, no HTTP, no decoder;
        any rank's death stops it (an LLM server then sends its jobs elsewhere)."""
        from scheduler.encoder_server import run_encoder_process

        init = f"tcp://{self.args.dist_init_addr or f'127.0.0.1:{free_port()}'}"
        for rank in range(self.args.tp_size):
            name = f"encoder-TP{rank}"
            self.children.append(self.spawn(name, run_encoder_process, self.args, rank, init))
        self.wait_ready(self.children)
        logger.info("encoder server ready: jobs on %s", self.args.encoder_bind_url)

    def spawn_replica(self, replica: int) -> list[Child]:
        """Start this node's ranks of `replica`: a TP group of its own, its own c10d store."""
        from scheduler.process import run_scheduler_process

        args = self.args
        per_node = args.tp_size // args.nnodes
        init = f"tcp://{args.dist_init_addr or f'127.0.0.1:{free_port()}'}"
        kwargs = {"faults": self.faults, "replica": replica}
        ranks = []
        for rank in range(args.node_rank * per_node, (args.node_rank + 1) * per_node):
            name = rank_name(args, replica, rank)
            self._replica_of[name] = replica
            ranks.append(self.spawn(name, run_scheduler_process, args, rank, init, **kwargs))
        return ranks

    def status(self) -> dict[int, dict[str, object]]:
        """Each replica's state, restarts and rank processes (for /server_info)."""
        with self._lock:
            children = list(self.children)
            health = [h.info() for h in self.health]
        out: dict[int, dict[str, object]] = {}
        for replica, info in enumerate(health):
            pids = [p.pid for name, p, _ in children if self._replica_of.get(name) == replica]
            out[replica] = info | {"pids": pids}
        return out

    def kill(self, replica: int, reason: str) -> None:
        """End `replica`'s ranks now (the front end saw it stall); the watch then handles it as
        a replica that died, naming `reason`."""
        with self._lock:
            ranks = [c for c in self.children if self._replica_of.get(c[0]) == replica]
            self._killed[replica] = reason
        for _, proc, _ in ranks:
            if proc.is_alive():
                proc.kill()

    def kv_total(self) -> int | None:
        """The smallest replica's KV pool: what one request may hold wherever it runs."""
        names = [rank_name(self.args, r, 0) for r in range(self.args.dp_size)]
        sizes = [self.ready_info[n].kv_total for n in names if n in self.ready_info]
        return min((s for s in sizes if s is not None), default=None)

    def wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.args.ready_timeout
        for name, proc, reader in children:
            while not reader.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(f"{name} exited with code {proc.exitcode} while starting")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not report ready in {self.args.ready_timeout}s")
            try:
                report: ReadyReport = reader.recv()
            except EOFError:
                raise RuntimeError(f"{name} exited while starting") from None
            if not report.ready:
                raise RuntimeError(f"{name} failed to start:\n{report.error}")
            self.ready_info[name] = report

    def watch(self) -> None:
        """In a thread: if a child dies, say which and why; a replica that may die alone is
        restarted (`replica_died`), any other death stops everything and exits non-zero.
        Wakes on the first death (the children's sentinels), not on a poll: a rank whose peer
        was killed fails its next collective and exits within milliseconds, and a poll that saw
        both dead named the wrong one."""
        for replica in range(self.args.dp_size):
            loop = threading.Thread(target=self._restart_loop, args=(replica,), daemon=True)
            loop.name = f"replica-{replica}-restarts"
            loop.start()
        while not self._stopping.is_set():
            with self._lock:
                children = list(self.children)
            wait_for_any([proc.sentinel for _, proc, _ in children], timeout=1.0)
            dead = [c for c in children if not c[1].is_alive()]
            if not dead or self._stopping.is_set():
                continue
            replicas = self.replicas_of(dead)
            if replicas is None:
                self.die(death_reason(children))
            for replica in replicas:
                ranks = [c for c in children if self._replica_of.get(c[0]) == replica]
                self.replica_died(replica, death_reason(ranks) or "a rank exited")

    def replicas_of(self, dead: list[Child]) -> list[int] | None:
        """The replicas the dead children belong to, or None when one of them may not die
        alone (one replica only, or a child that is no scheduler rank: the detokenizer)."""
        if self.args.dp_size == 1 or any(c[0] not in self._replica_of for c in dead):
            return None
        return sorted({self._replica_of[c[0]] for c in dead})

    def replica_died(self, replica: int, reason: str) -> None:
        """Take `replica`'s ranks off the watch, tell the front end (its requests fail), and
        hand the replica to the restart thread."""
        with self._lock:
            ranks = [c for c in self.children if self._replica_of.get(c[0]) == replica]
            self.children = [c for c in self.children if self._replica_of.get(c[0]) != replica]
            reason = self._killed.pop(replica, reason)
            delay = self.health[replica].died(time.monotonic())
        logger.error("replica %d failed: %s", replica, reason)
        for hooks in self._replica_hooks:
            guarded(hooks.lost, replica, reason)
        self._restarts[replica].put((ranks, delay))

    def _restart_loop(self, replica: int) -> None:
        """`replica`'s restart thread: end its other ranks once it died, then start it again."""
        while not self._stopping.is_set():
            ranks, delay = self._restarts[replica].get()
            end_children(ranks)
            self.recover(replica, delay)

    def recover(self, replica: int, delay: float | None) -> None:
        """Start `replica` again after `delay` seconds, as often as its policy allows; when it
        stays down and no replica serves or restarts, stop the server."""
        health = self.health[replica]
        while delay is not None:
            logger.warning("replica %d: restart %d in %.1fs", replica, health.restarts + 1, delay)
            if self._stopping.wait(delay):
                return
            with self._lock:
                health.restarting()
            try:
                ranks = self.start_replica(replica)
            except (RuntimeError, TimeoutError) as exc:
                logger.error("replica %d failed to restart: %s", replica, exc)
                with self._lock:
                    delay = health.died(time.monotonic())
                continue
            with self._lock:
                self.children += ranks
                health.restarted()
            logger.info("replica %d restarted (restart %d)", replica, health.restarts)
            for hooks in self._replica_hooks:
                guarded(hooks.ready, replica)
            return
        policy = health.policy
        logger.error(
            "replica %d stays down: %d restarts within %gs are spent",
            replica,
            policy.max_restarts,
            policy.window_s,
        )
        if not any(h.alive for h in self.health):
            self.die("every replica is down, with its restarts spent")

    def start_replica(self, replica: int) -> list[Child]:
        """Spawn `replica`'s ranks and wait until they are ready (ended again if they fail)."""
        with self._lock:
            ranks = self._starting[replica] = self.spawn_replica(replica)
        try:
            self.wait_ready(ranks)
        except BaseException:
            end_children(ranks)
            raise
        finally:
            with self._lock:
                self._starting.pop(replica, None)
        return ranks

    def die(self, reason: str) -> None:
        """A death the server cannot survive: fail every client, stop everything, exit 1."""
        logger.error("%s; shutting down", reason)
        self.run_fatal_hooks(reason)
        self.stop()
        os._exit(1)

    def on_fatal(self, hook: Callable[[str], None]) -> None:
        """Run `hook(reason)` (in the watch thread) before the children are stopped."""
        self._fatal_hooks.append(hook)

    def on_replica(self, hooks: ReplicaHooks) -> None:
        """Call `hooks.lost(replica, reason)` when a replica dies, `hooks.ready(replica)` when
        its restart is ready (from the supervisor's threads)."""
        self._replica_hooks.append(hooks)

    def run_fatal_hooks(self, reason: str) -> None:
        for hook in self._fatal_hooks:
            guarded(hook, reason)

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            children = [*self.children, *(c for r in self._starting.values() for c in r)]
        end_children(children)


@dataclass(frozen=True)
class ReplicaHooks:
    lost: Callable[[int, str], None]
    ready: Callable[[int], None]


def guarded(hook: Callable[..., None], *args: object) -> None:
    """Run a supervisor hook; whatever it raises is logged, and what the supervisor was doing
    (a shutdown, a restart) goes on."""
    try:
        hook(*args)
    except Exception:  # noqa: BLE001 - see the docstring
        logger.exception("supervisor hook failed")


def end_children(children: list[Child]) -> None:
    """SIGTERM each child still alive, SIGKILL those left after 5 s, and reap them all."""
    for _, proc, _ in children:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5
    for _, proc, reader in children:
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
        reader.close()


def rank_name(args: ServerArgs, replica: int, rank: int) -> str:
    """A scheduler rank's process name, as the log and the supervisor say it."""
    if args.dp_size == 1:
        return f"scheduler-TP{rank}"
    return f"scheduler-DP{replica}-TP{rank}"


def replica_hooks(loop: asyncio.AbstractEventLoop, tm: TokenizerManager) -> ReplicaHooks:
    """A replica's death and its restart, told to the TokenizerManager on its event loop (in
    order: a death is handled before the restart that follows it)."""
    return ReplicaHooks(
        lost=lambda replica, reason: loop.call_soon_threadsafe(tm.replica_lost, replica, reason),
        ready=lambda replica: loop.call_soon_threadsafe(tm.replica_ready, replica),
    )


def fail_everything(loop: asyncio.AbstractEventLoop, tm: object, mm: object, reason: str) -> None:
    """A child died: every client in flight gets a 503 error, then the media workers stop."""
    done = threading.Event()

    def fail() -> None:
        tm.fail_all(f"the server is shutting down: {reason}")
        done.set()

    loop.call_soon_threadsafe(fail)
    if done.wait(2):
        time.sleep(0.5)  # let the responses reach the clients
    mm.shutdown()


async def serve_http(args: ServerArgs, supervisor: Supervisor, sock: socket.socket) -> None:
    import uvicorn

    from tokenizer_manager.front_end import build_front_end

    front = build_front_end(args, kv_total=supervisor.kv_total(), replicas=supervisor)
    loop = asyncio.get_running_loop()
    try:
        await front.start()
        supervisor.on_fatal(lambda reason: fail_everything(loop, front.tm, front.mm, reason))
        supervisor.on_replica(replica_hooks(loop, front.tm))
        frozen = freeze_startup_objects()  # a full collection held the loop 146 ms before
        logger.debug("froze %d startup objects", frozen)
        config = front.uvicorn_config(timeout_graceful_shutdown=2)
        logger.info("serving on http://%s:%d", args.host, args.port)
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        # the children stop while the media workers do: a stop never waits for both in turn
        await asyncio.gather(front.close(), asyncio.to_thread(supervisor.stop))


def death_reason(children: list[tuple[str, mp.Process, Connection]]) -> str | None:
    """Which child died and how (None while all live). Where several are dead, one killed by a
    signal is named first: the others most likely exited because it did (a collective with it
    broke); they are listed after it."""
    dead = [(name, proc.exitcode) for name, proc, _ in children if not proc.is_alive()]
    if not dead:
        return None
    dead.sort(key=lambda d: not (d[1] is not None and d[1] < 0))  # stable: start order otherwise
    (name, code), *others = dead
    reason = f"{name} exited unexpectedly with code {code}"
    if others:
        reason += " (also exited: " + ", ".join(f"{n} with code {c}" for n, c in others) + ")"
    return reason


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None, faults: FaultsFactory | None = None) -> int:
    """Serve with the flags in `argv`. `faults`: testing only, a picklable factory of each
    scheduler rank's injected faults (tests/fault_server.py passes one; the command line never
    does)."""
    args = ServerArgs.from_cli(argv)
    configure_logging(args.log_level, "main")
    keep_freed_memory()  # the children call it too, first thing
    if args.model_path is None:
        args = dataclasses.replace(args, model_path=ensure_tiny_checkpoint())
    if args.tp_size % args.nnodes:
        raise SystemExit("--tp must be divisible by --nnodes")
    if not args.use_cuda:
        # Idle OpenMP threads sleep instead of spinning, so the ranks, the media workers and
        # the HTTP server share the cores without burning them (same request rate, 7 to 20%
        # less CPU on the 2-core machine). The children read it when torch starts; a value the
        # user set is kept.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # before the first child starts: a child started by exec (every one here) then has
    # SIGTERM's default action, whatever this process inherited (e.g. SIGTERM ignored)
    signal.signal(signal.SIGTERM, _interrupt)
    serves_http = args.node_rank == 0 and not args.encoder_only
    if serves_http:
        from tokenizer_manager.cpu_pool import start_fork_server

        http_socket = bind_http_socket(args.host, args.port)
        # the media workers' imports run now, beside the children's start-up, not after it
        start_fork_server()
    supervisor = Supervisor(args, faults)
    try:
        supervisor.start()
        threading.Thread(target=supervisor.watch, daemon=True).start()
        if serves_http:
            import uvloop  # here, not at the top: the spawned children import this module

            # uvloop's event loop, as uvicorn picks when it runs its own: 6% less main-process
            # CPU per 4-image request than asyncio's (docs/benchmarks.md)
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(serve_http(args, supervisor, http_socket))
        else:
            while True:
                time.sleep(1)
    except KeyboardInterrupt:
        logger.info("interrupted; stopping")
    finally:
        supervisor.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
