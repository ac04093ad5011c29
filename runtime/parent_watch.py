"""Every child process ends with the process that started it, however that one ends (a crash,
SIGKILL, a clean exit): invariant 11's "every child with it" without the parent's help.

`exit_with_parent()` is the first call of every child entry function (the scheduler ranks, the
detokenizer, the media workers). It

- restores SIGTERM's default action: a process forked without exec keeps a signal its parent
  ignored (the media fork server and its workers ignored SIGTERM whenever the server was
  launched with SIGTERM ignored), so a child would otherwise outlive a plain `kill`;
- asks the kernel (Linux `prctl(PR_SET_PDEATHSIG)`) for SIGKILL when the parent goes: it acts
  even while this process is stuck in native code. The kernel ties it to the parent thread that
  forked the child; tessera forks from threads that live as long as their process (the main
  thread: Supervisor.start, the fork server; the supervisor's replica-restart thread);
- starts a watch thread on multiprocessing's parent sentinel (a pipe whose other end only the
  parent holds: readable the moment it exits) that also polls `os.getppid()`, and ends the
  process with `os._exit` when either says the parent is gone: the portable half, and the one
  that holds for a forked worker whose parent is the fork server (the sentinel follows the
  process that asked for the worker, the main process).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.connection import wait

from runtime.logging_utils import get_logger

logger = get_logger(__name__)

POLL_S = 0.5  # the watch's getppid() check; the sentinel wakes it at once
PR_SET_PDEATHSIG = 1
EXIT_CODE = 70  # os._exit status of a child whose parent died


def exit_with_parent() -> bool:
    """Make this process end when its multiprocessing parent does (see the module docstring).
    Returns False, doing nothing, in a process multiprocessing did not start (an entry
    function called in-process by a test)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False
    ppid = os.getppid()
    kill_on_parent_death()
    if not parent.is_alive():  # gone before the kernel's signal was asked for
        os._exit(EXIT_CODE)
    watch = threading.Thread(
        target=_watch, args=(parent.sentinel, ppid), name="parent-watch", daemon=True
    )
    watch.start()
    return True


def kill_on_parent_death() -> bool:
    """SIGKILL from the kernel when the thread that forked this process exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(sentinel: int, ppid: int) -> None:
    while not wait([sentinel], timeout=POLL_S) and os.getppid() == ppid:
        pass
    logger.error("the parent process (pid %d) is gone: pid %d exits", ppid, os.getpid())
    os._exit(EXIT_CODE)
