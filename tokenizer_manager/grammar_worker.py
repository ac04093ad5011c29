"""The grammar compile workers' side: try a constraint where a crash costs only this process.

These are `cpu_pool.WorkerPool` jobs (forked from the fork server, under a CPU-time and an
address-space limit). A worker compiles with the same `GrammarCompiler` code the scheduler's
entry rank runs, on a thread with a quarter of the scheduler's stack: a spec the engine would
recurse through past its stack crashes here first (the front end then refuses it), and what
compiles here has room to spare on the scheduler's threads.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal

from runtime.allocator import keep_freed_memory
from runtime.grammar import CheckpointGrammar, CompileLimits, GrammarCompiler, GrammarSpec

WORKER_NICENESS = 10  # added to the worker's nice value: the ranks and the front end come first


def worker_limits(limits: CompileLimits) -> CompileLimits:
    """A worker's limits for a scheduler compiling under `limits`: the same size and shape
    bounds, one compile at a time with a quarter of the stack, nothing kept (the front end caches
    verdicts), and no deadline of its own (the pool's deadlines end the whole process)."""
    return dataclasses.replace(
        limits, timeout_s=86400.0, workers=1, cache_size=0, stack_bytes=limits.stack_bytes // 4
    )


@functools.cache
def worker_compiler(source: CheckpointGrammar, limits: CompileLimits) -> GrammarCompiler:
    """This worker's compiler for `source`, built once (it indexes the tokenizer)."""
    return GrammarCompiler(source.backend(), worker_limits(limits))


def init_grammar_worker(source: CheckpointGrammar, limits: CompileLimits) -> None:
    """Pool initializer: leave Ctrl-C to the parent, yield the CPU to the processes that serve
    (a compile of seconds waits for a core rather than slowing every rank's step), and build
    the compiler up front."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(WORKER_NICENESS)
    keep_freed_memory()
    worker_compiler(source, limits)


def check_compiles(
    spec: GrammarSpec, source: CheckpointGrammar, limits: CompileLimits
) -> str | None:
    """Returns when `spec` compiles, with the engine's prepared form of it (None when it needs
    none: `GrammarBackend.prepare`); raises GrammarError when the engine refuses it (a crash or
    a runaway compile ends the process instead, which the pool reports)."""
    compiler = worker_compiler(source, limits)
    prepared = compiler.backend.prepare(spec)
    compiler.compile(prepared)
    return prepared.prepared
