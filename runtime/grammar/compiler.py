"""Compiling constraints off the caller's thread, under size, shape and time limits, cached by text.

`GrammarCompiler.submit(spec)` returns at once with a future (the event loop and the scheduler
loop never compile); `compile(spec)` waits for it up to the time limit. Equal specs share one
compile and one cache entry; the cache keeps the most recently used `cache_size` grammars,
failures included, so a hostile spec sent again is refused without compiling again.
A spec past the size or shape limits (`limits.StructureLimits`) is refused before any compile.
Compiles run on the compiler's own threads, each with `stack_bytes` of stack: an engine that
recurses deeply needs the room, and the front end's compile workers try every untried spec
first on a quarter of it (`tokenizer_manager/grammar_worker.py`), so what reaches a scheduler
has compiled with far less stack than it finds there. A compile past its deadline is reported
at once but keeps its thread until the engine returns; the engine's own limits
(`llguidance_backend.EngineLimits`) bound that work.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from runtime.grammar.base import GrammarBackend, GrammarError, GrammarMatcher, GrammarSpec
from runtime.grammar.limits import StructureLimits, check_structure
from runtime.logging_utils import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class CompileLimits:
    max_spec_bytes: int = 256 * 1024
    timeout_s: float = 10.0
    cache_size: int = 256
    workers: int = 2
    stack_bytes: int = 64 << 20  # each compile thread's stack (virtual: touched only as used)
    structure: StructureLimits = field(default_factory=StructureLimits)


class GrammarCompiler:
    """A backend, a few compile threads, and a bounded LRU cache of results."""

    def __init__(self, backend: GrammarBackend, limits: CompileLimits = CompileLimits()) -> None:
        self.backend = backend
        self.limits = limits
        self._threads = CompileThreads(limits.workers, limits.stack_bytes)
        self._cache: OrderedDict[tuple[str, str], Future[object]] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: GrammarSpec) -> Future[object]:
        """The compiled grammar for `spec`, from the cache or a new compile; never blocks."""
        check_limits(spec, self.limits)
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._threads.submit(self.backend.compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self.limits.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: GrammarSpec) -> object:
        """Wait for `spec`'s compiled grammar; GrammarError if it is invalid or too slow."""
        future = self.submit(spec)
        try:
            return future.result(timeout=self.limits.timeout_s)
        except FutureTimeout:
            logger.warning("grammar %s did not compile in %.1f s", spec.kind, self.limits.timeout_s)
            raise GrammarError(
                f"{spec.kind} did not compile within {self.limits.timeout_s:g} s", spec.param
            ) from None
        except GrammarError as exc:
            raise GrammarError(str(exc), spec.param) from None

    def new_matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        return self.backend.new_matcher(self.compile(spec))

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        self._threads.close()


class CompileThreads:
    """`count` daemon threads with `stack_bytes` of stack each, running submitted calls in
    order (a thread pool whose threads' stack size is chosen, not inherited)."""

    def __init__(self, count: int, stack_bytes: int) -> None:
        self._calls: queue.SimpleQueue[tuple[Future, Callable, GrammarSpec] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._run, daemon=True, name=f"grammar-{i}")
            for i in range(count)
        ]
        self._closed = False
        previous = threading.stack_size(stack_bytes)  # read when a thread starts
        try:
            for thread in self._threads:
                thread.start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn: Callable[[GrammarSpec], object], spec: GrammarSpec) -> Future[object]:
        future: Future[object] = Future()
        self._calls.put((future, fn, spec))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, spec = call
            if self._closed:
                future.cancel()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(spec))
            except BaseException as exc:  # noqa: BLE001 - the caller gets every failure
                future.set_exception(exc)

    def close(self) -> None:
        """What has not started is cancelled; each thread ends after its current compile."""
        self._closed = True
        for _ in self._threads:
            self._calls.put(None)


def check_limits(spec: GrammarSpec, limits: CompileLimits) -> None:
    """The checks every compile passes first: the spec's size, then its shape."""
    check_size(spec, limits.max_spec_bytes)
    check_structure(spec, limits.structure)


def check_size(spec: GrammarSpec, max_bytes: int) -> None:
    size = len(spec.text.encode("utf-8"))
    if size > max_bytes:
        raise GrammarError(f"{spec.kind} is {size} bytes; the limit is {max_bytes}", spec.param)
