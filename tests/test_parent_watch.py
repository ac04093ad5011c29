"""No orphaned children (issue 57c): every child ends on its own when its parent dies, and a
child ends on SIGTERM whatever its parent ignored. Unit tests on a spawned middle process and
its child, then a real tp-2 server whose main process is SIGKILLed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from stress import LaunchedServer
from test_server import group_pids
from waits import process_dead, wait_until

from runtime import parent_watch
from runtime.tiny_checkpoint import make_checkpoint


def _child(report: Connection, kernel_signal: bool) -> None:
    if not kernel_signal:  # only the watch thread then
        parent_watch.kill_on_parent_death = lambda: False
    report.send((os.getpid(), parent_watch.exit_with_parent()))
    time.sleep(600)


def _middle(report: Connection, kernel_signal: bool, ignore_term: bool) -> None:
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = mp.get_context("fork")  # fork keeps an ignored signal, as the media fork server does
    ctx.Process(target=_child, args=(report, kernel_signal), daemon=False).start()
    time.sleep(600)


def start_pair(kernel_signal: bool = True, ignore_term: bool = False) -> tuple[mp.Process, int]:
    """(the middle process, its child's pid) once the child is watching."""
    reader, writer = mp.Pipe(duplex=False)
    middle = mp.get_context("spawn").Process(
        target=_middle, args=(writer, kernel_signal, ignore_term), daemon=False
    )
    middle.start()
    assert wait_until(lambda: reader.poll() or not middle.is_alive(), timeout=120)
    assert middle.is_alive(), f"the middle process exited with {middle.exitcode}"
    pid, watching = reader.recv()
    assert watching
    return middle, pid


def ends_after(middle: mp.Process, child: int, target: int, sig: int = signal.SIGKILL) -> bool:
    """Send `sig` to `target`; whether the child then ends (both are killed in the end)."""
    try:
        os.kill(target, sig)
        return wait_until(lambda: process_dead(child), timeout=30)
    finally:
        middle.kill()
        if not process_dead(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("kernel_signal", [True, False])
def test_a_child_exits_when_its_parent_is_killed(kernel_signal: bool) -> None:
    middle, child = start_pair(kernel_signal)
    assert not process_dead(child)
    assert ends_after(middle, child, middle.pid)


def test_a_child_ends_on_sigterm_though_its_parent_ignored_it() -> None:
    middle, child = start_pair(ignore_term=True)
    assert ends_after(middle, child, child, signal.SIGTERM)


def test_a_process_multiprocessing_did_not_start_is_left_alone() -> None:
    assert parent_watch.exit_with_parent() is False


def test_every_process_of_a_server_ends_when_its_main_process_is_killed(tmp_path: Path) -> None:
    """SIGKILL of launch.py at tp 2: the ranks, the detokenizer, the media fork server and its
    workers (and multiprocessing's resource tracker, which they hold open) all end on their
    own. Before issue 57 the ranks and the detokenizer stayed for good."""
    folder = make_checkpoint("qwen2_vl", tmp_path / "qwen2_vl")
    flags = ["--model-path", str(folder), "--tp", "2", "--device", "cpu"]
    srv = LaunchedServer(flags, tmp_path / "server.log")
    try:
        srv.wait_healthy(300)
        children = [pid for pid in group_pids(srv.proc.pid) if pid != srv.proc.pid]
        assert len(children) >= 5  # 2 ranks, detokenizer, fork server, media workers
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(30)
        gone = wait_until(lambda: not group_pids(srv.proc.pid), timeout=60)
        assert gone, f"left behind: {group_pids(srv.proc.pid)}\n{srv.log.read_text()[-3000:]}"
    finally:
        if srv.group_alive():
            os.killpg(srv.proc.pid, signal.SIGKILL)
