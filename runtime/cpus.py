"""The CPUs this process may run on, and how tensor-parallel ranks share them.

`os.cpu_count()` counts the machine's CPUs; a container's cpuset, `taskset` or a batch system
can leave a process far fewer. Every thread count in tessera comes from the affinity mask, so a
server started with `taskset -c 0,1` runs two threads, not one per CPU of the machine.
"""

from __future__ import annotations

import os


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, in ascending order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        return list(range(os.cpu_count() or 1))


def threads_per_rank(world_size: int, cpus: list[int] | None = None) -> int:
    """Intra-op threads for one of `world_size` ranks that share `cpus` (default: ours)."""
    count = len(usable_cpus() if cpus is None else cpus)
    return max(1, count // world_size)


def rank_cpus(rank: int, world_size: int, cpus: list[int] | None = None) -> list[int] | None:
    """Rank `rank`'s own contiguous share of `cpus`, or None when there are fewer CPUs than
    ranks (then pinning would put two ranks on one CPU while another idles)."""
    cpus = usable_cpus() if cpus is None else cpus
    share = len(cpus) // world_size
    if share == 0:
        return None
    return cpus[rank * share : (rank + 1) * share]


MAX_AUTO_MEDIA_WORKERS = 16  # each worker is a process with its own image processor
CPU_MEDIA_WORKERS = 4  # a CPU server's workers share the ranks' cores


def auto_media_workers(cpus: int, node_ranks: int, use_cuda: bool) -> int:
    """Media worker processes for --media-workers auto. On CUDA: the `cpus` this node's
    `node_ranks` TP ranks leave (a CUDA rank keeps one CPU busy driving its GPU, the front end's
    event loop one more), at least 1, at most MAX_AUTO_MEDIA_WORKERS. On CPU the ranks' threads
    take every CPU (`threads_per_rank`) and a burst of media is short next to a prefill, so the
    workers share them: up to CPU_MEDIA_WORKERS."""
    if not use_cuda:
        return max(1, min(CPU_MEDIA_WORKERS, cpus))
    return max(1, min(MAX_AUTO_MEDIA_WORKERS, cpus - node_ranks - 1))
