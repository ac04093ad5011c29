"""keep_freed_memory: a process that frees and reallocates large tensor buffers every step stops
faulting their pages in again (glibc's default maps blocks past 32 MiB fresh every time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from runtime.allocator import keep_freed_memory
if {apply}:
    assert keep_freed_memory()
torch.set_num_threads(1)
def step():
    x = torch.ones(12 << 20)  # 48 MB, like a 4-image request's pixels
    return float((x * 2)[-1])
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults))  # a step once the heap has reached its working size
"""


def faults_per_step(apply: bool) -> int:
    code = PROGRAM.format(root=str(ROOT), apply=apply)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_buffers_are_reused_without_page_faults() -> None:
    default, kept = faults_per_step(False), faults_per_step(True)
    pages = 2 * (48 << 20) // 4096  # two 48 MB buffers per step
    assert default > pages // 2  # the default really does fault them in again
    assert kept < pages // 20


FREEZE = """
import gc, sys, time
sys.path.insert(0, {root!r})
from runtime.allocator import freeze_startup_objects
startup = [[i] for i in range(300_000)]  # a server's modules, model and tokenizer stand-in
def full_collection():
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start
before = min(full_collection() for _ in range(3))
frozen = freeze_startup_objects()
after = min(full_collection() for _ in range(3))
cycle = [[]]; cycle[0].append(cycle)  # garbage made after the freeze is still collected
del cycle
collected = gc.collect()
def walk():
    raise AssertionError("the report walked the permanent generation")
gc.get_freeze_count = walk
from runtime.allocator import frozen_startup_objects
print(frozen, before, after, collected, frozen_startup_objects())
"""


def test_frozen_startup_objects_leave_full_collections_short() -> None:
    code = FREEZE.format(root=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    frozen, before, after, collected, reported = out.stdout.split()
    assert int(frozen) >= 300_000
    assert reported == frozen  # reported again without counting (/server_info, /metrics)
    assert float(after) < float(before) / 5  # the walk no longer visits what was frozen
    assert int(collected) >= 2  # the later cycle: the collector still runs
