"""Compiling constraints off the caller's thread, under a size and a time limit, cached by text.

`GrammarCompiler.submit(spec)` returns at once with a future (the event loop and the scheduler
loop never compile); `compile(spec)` waits for it up to the time limit. Equal specs share one
compile and one cache entry; the cache keeps the most recently used `cache_size` grammars,
failures included, so a hostile spec sent again is refused without compiling again.
A compile past its deadline is reported at once but keeps its worker until the engine returns;
the engine's own limits (`llguidance_backend.EngineLimits`) bound that work.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from runtime.grammar.base import GrammarBackend, GrammarError, GrammarMatcher, GrammarSpec
from runtime.logging_utils import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class CompileLimits:
    max_spec_bytes: int = 256 * 1024
    timeout_s: float = 10.0
    cache_size: int = 256
    workers: int = 2


class GrammarCompiler:
    """A backend, a small thread pool that compiles, and a bounded LRU cache of results."""

    def __init__(self, backend: GrammarBackend, limits: CompileLimits = CompileLimits()) -> None:
        self.backend = backend
        self.limits = limits
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[object]] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: GrammarSpec) -> Future[object]:
        """The compiled grammar for `spec`, from the cache or a new compile; never blocks."""
        check_size(spec, self.limits.max_spec_bytes)
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self.backend.compile, spec)
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
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_size(spec: GrammarSpec, max_bytes: int) -> None:
    size = len(spec.text.encode("utf-8"))
    if size > max_bytes:
        raise GrammarError(f"{spec.kind} is {size} bytes; the limit is {max_bytes}", spec.param)
