"""Keep freed host memory in the process instead of handing it back to the OS.

By default glibc serves large blocks (tensor buffers of a few MB) with mmap and returns them with
munmap on free, so the next step's buffers are faulted in and zeroed page by page again: on a
scheduler serving 4-image requests that was about 32k minor faults per request. Each tessera
process calls `keep_freed_memory()` first thing; the settings only change where freed memory goes,
never what a program computes. A no-op where the C library is not glibc.

The same goes for Python's own objects: `freeze_startup_objects()`, called once a process is ready,
takes everything alive then (modules, the model, the tokenizer: some 260k objects in the main
process) out of the cyclic collector's sight, so a full collection walks only what serving made
since. Unfrozen, each full collection held the main process's event loop for about 146 ms.
`frozen_startup_objects()` reports that count again without `gc.get_freeze_count()`, which walks
the whole permanent generation (3 ms for 260k objects; a rank's /metrics answer did it on every
scrape, between two decode steps).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

from runtime.logging_utils import get_logger

logger = get_logger(__name__)

_frozen = 0  # what this process's freeze_startup_objects() froze

# mallopt parameter numbers from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

# No block is served by mmap: every size, also past glibc's 32 MiB mmap threshold cap, comes from
# the heap and returns to it (a block larger than a thread's heap falls back to the main arena).
MMAP_MAX = 0
TRIM_THRESHOLD = 1 << 30  # give the heap's top back only past 1 GiB free
TOP_PAD = 64 << 20  # grow the heap in 64 MiB steps


def keep_freed_memory() -> bool:
    """Apply the settings above to this process; True when the C library took all of them."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    settings = (
        (M_MMAP_MAX, MMAP_MAX),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD),
    )
    ok = all(mallopt(param, value) == 1 for param, value in settings)
    if not ok:
        logger.warning("the C library refused some allocator settings; freed memory may churn")
    return ok


def freeze_startup_objects() -> int:
    """Collect once, then freeze every object alive now into the collector's permanent
    generation (never walked, never collected); returns how many are frozen. Objects freed by
    reference counting are still freed: only cyclic garbage among them would stay."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()
    return _frozen


def frozen_startup_objects() -> int:
    """How many objects `freeze_startup_objects()` froze in this process (0 before it ran)."""
    return _frozen
