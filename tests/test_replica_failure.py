"""A replica's failure is that replica's (invariant 20), end to end: `launch.py --dp 2 --tp 1` on
CPU under a small load on both replicas; replica 1's rank is SIGKILLed mid-load. Its requests
fail with their own 503 error (JSON, or an error event in a stream), replica 0's finish with the
greedy text taken before, /health stays 200, /server_info shows replica 1 restarting then up
with one restart, a request pinned to it is served again, every process of the dead replica is
gone and no other process was lost or added, and each replica is idle-clean afterwards. With
its restarts spent a replica stays down, and the death of the last one stops the server. With
--tp 2 a replica is ended and restarted whole, also when one of its ranks hangs (a stall). The
shared files of requests a dead replica never read are removed when it is declared dead, and
replicas that die together restart independently."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_openai_sampling import OneRankServer
from test_server import (
    Server,
    group_pids,
    image_part,
    serve_then_check_teardown,
    shm_media_files,
)
from vlm_cases import noise_image
from waits import process_dead, wait_until

from runtime.tiny_checkpoint import make_checkpoint

SHORT = 24  # replica 0's requests: short enough to finish while replica 1 is down
LONG = 1500  # replica 1's: still running when its rank is killed (3 fit its KV pool)
PROMPTS = ["Describe the cat.", "Count to ten.", "Name a colour."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("replica") / "qwen2_vl"))


def body(prompt: str, max_tokens: int, rank: int, **kw: Any) -> dict[str, Any]:
    return {
        "model": "qwen2_vl",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "data_parallel_rank": rank,
        **kw,
    }


def post(server: Server, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=240)


def info(server: Server) -> dict[str, Any]:
    return httpx.get(server.url + "/server_info", timeout=60).json()


def replica(server: Server, index: int) -> dict[str, Any]:
    return info(server)["replicas"][index]


def stream_events(server: Server, payload: dict[str, Any], events: list[Any]) -> None:
    """POST a streamed chat; each SSE data line (parsed) is appended to `events`."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload, timeout=240) as r:
        events.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))


def in_threads(calls: list[Any]) -> list[threading.Thread]:
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    return threads


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    flags = ["--dp", "2", "--health-stall-timeout", "20"]
    yield from serve_then_check_teardown(OneRankServer(folder, log, *flags))


def test_a_killed_replica_fails_its_own_requests_and_comes_back(server: Server) -> None:
    reference = [post(server, body(p, SHORT, 0)).json() for p in PROMPTS]
    texts = [r["choices"][0]["message"]["content"] for r in reference]
    before = {r["replica"]: r["pids"] for r in info(server)["replicas"]}
    processes = set(server.children())
    victim = before[1][0]

    short: list[httpx.Response] = []
    long: list[httpx.Response] = []
    stream: list[Any] = []
    calls = [lambda p=p: long.append(post(server, body(p, LONG, 1))) for p in PROMPTS[:2]]
    calls.append(lambda: stream_events(server, body(PROMPTS[2], LONG, 1, stream=True), stream))
    threads = in_threads(calls)
    assert wait_until(lambda: replica(server, 1)["running"] == 3, 120), replica(server, 1)
    threads += in_threads(
        [lambda p=p: short.append(post(server, body(p, SHORT, 0))) for p in PROMPTS]
    )
    os.kill(victim, signal.SIGKILL)

    health: list[int] = []
    states: list[str] = []

    def watch_until_up() -> bool:
        health.append(httpx.get(server.url + "/health", timeout=60).status_code)
        states.append(replica(server, 1)["state"])
        return states[-1] == "up" and len(states) > 1

    assert wait_until(watch_until_up, 180), states
    for thread in threads:
        thread.join(240)
    # replica 1's requests: each its own 503, typed; the stream ends with an error event
    assert [r.status_code for r in long] == [503, 503], [r.text for r in long]
    for r in long:
        error = r.json()["error"]
        assert error["code"] == "replica_unavailable" and "replica 1" in error["message"]
        assert set(error) >= {"message", "type", "param", "code"}
    assert stream[0] == 200 and "error" in stream[-1], stream[-3:]
    assert stream[-1]["error"]["code"] == "replica_unavailable"
    # replica 0's requests: served as before, the same greedy text
    assert sorted(r.status_code for r in short) == [200] * 3
    got = {r.json()["choices"][0]["message"]["content"] for r in short}
    assert got == set(texts)
    # the server stayed healthy; replica 1 went through restarting back to up, once
    assert set(health) == {200}, health
    assert "restarting" in states and states[-1] == "up"
    back = replica(server, 1)
    assert back["restarts"] == 1 and back["up"] and back["pids"] != before[1]
    assert replica(server, 0)["pids"] == before[0] and replica(server, 0)["restarts"] == 0
    # it serves again, from an empty cache
    again = post(server, body(PROMPTS[0], SHORT, 1)).json()
    assert again["choices"][0]["message"]["content"] == texts[0]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the dead rank is gone; the processes now are those before with the rank replaced
    assert wait_until(lambda: process_dead(victim))
    now = set(server.children())
    assert now == (processes - {victim}) | set(back["pids"]), (processes, now)
    log = server.log.read_text()
    assert "replica 1 failed: scheduler-DP1-TP0 exited unexpectedly with code -9" in log
    assert "replica 1 restarted (restart 1)" in log


def test_every_replica_is_idle_clean_after_the_restart(server: Server) -> None:
    def idle() -> bool:
        reps = info(server)["replicas"]
        return all(r["running"] == r["waiting"] == r["in_flight"] == 0 for r in reps)

    assert wait_until(idle, 120)
    for r in info(server)["replicas"]:
        assert r["state"] == "up" and r["load_tokens"] == 0
        assert r["kv_free"] + r["kv_evictable"] == r["kv_total"], r
        assert r["encoder_cache_pins"] == 0 and r["pixels"]["requests_holding_pixels"] == 0
    assert info(server)["api"]["in_flight"] == 0


def media_files(server: Server) -> set[str]:
    """The shared-memory media files of the server's processes."""
    return {name for pid in group_pids(server.proc.pid) for name in shm_media_files(pid)}


def test_a_dead_replicas_unread_requests_leave_no_shared_files(server: Server) -> None:
    """Replica 1's rank frozen (SIGSTOP): image chats sent to it wait unread in its socket, each
    with its pixels in a shared-memory file handed to its ranks, until the front end sees the
    replica stall (--health-stall-timeout 20) and has it killed. Once the replica is declared
    dead those files are removed at once (the front end's processed-media cache keeps its own,
    one per image), not left until the server stops; the replica then serves again."""
    assert wait_until(lambda: replica(server, 1)["in_flight"] == 0, 120)
    base = media_files(server)
    victim = replica(server, 1)["pids"][0]
    images = [noise_image((56, 56), seed=100 + i) for i in range(3)]
    payloads = [body(PROMPTS[0], 4, 1) for _ in images]
    for payload, image in zip(payloads, images, strict=True):
        payload["messages"][0]["content"] = [image_part(image), {"type": "text", "text": "Hi"}]
    failed: list[httpx.Response] = []
    os.kill(victim, signal.SIGSTOP)
    try:
        threads = in_threads([lambda p=p: failed.append(post(server, p)) for p in payloads])
        # per image: the cache's file and the ranks' link to it
        assert wait_until(lambda: len(media_files(server) - base) == 6, 120)
        assert wait_until(lambda: state_of(server, 1) == "restarting", 180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    assert len(media_files(server) - base) == 3, "the ranks' links outlived their replica"
    for thread in threads:
        thread.join(240)
    assert [r.status_code for r in failed] == [503] * 3
    assert wait_until(lambda: state_of(server, 1) == "up", 180)
    assert post(server, payloads[0]).status_code == 200  # served again, from the cache's file
    assert "replica 1 stalled" in server.log.read_text()


def state_of(server: Server, index: int) -> str | None:
    """A replica's state, None while /server_info cannot answer (a replica frozen)."""
    reply = httpx.get(server.url + "/server_info", timeout=60)
    return reply.json()["replicas"][index]["state"] if reply.status_code == 200 else None


def test_a_replica_with_no_restarts_left_stays_down_and_the_last_stops_the_server(
    folder: str, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    srv = OneRankServer(folder, log, "--dp", "2", "--replica-max-restarts", "0")
    try:
        pids = {r["replica"]: r["pids"][0] for r in info(srv)["replicas"]}
        os.kill(pids[1], signal.SIGKILL)
        assert wait_until(lambda: replica(srv, 1)["state"] == "down", 60)
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
        refused = post(srv, body(PROMPTS[0], 2, 1))
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "replica_unavailable"
        assert post(srv, body(PROMPTS[0], 2, 0)).status_code == 200
        assert "replica 1 stays down" in log.read_text()
        os.kill(pids[0], signal.SIGKILL)
        assert srv.proc.wait(120) == 1
        assert "every replica is down, with its restarts spent" in log.read_text()
        assert wait_until(lambda: not srv.group_alive(), 60)
    finally:
        srv.stop()



def test_a_replica_of_two_ranks_is_ended_whole_and_one_that_stalls_is_restarted(
    folder: str, tmp_path: Path
) -> None:
    """--dp 2 --tp 2. Replica 1's second rank killed: its entry rank is ended with it (its
    collectives are broken) and both come back as new processes. Then its new second rank
    frozen (SIGSTOP) with a request in flight: after --health-stall-timeout without output the
    front end has the replica killed; the request fails with its 503, the replica restarts, and
    /health is 200 throughout (replica 0 serves)."""
    log = tmp_path / "server.log"
    flags = ["--dp", "2", "--tp", "2", "--health-stall-timeout", "5"]
    teardown = serve_then_check_teardown(OneRankServer(folder, log, *flags))
    srv = next(teardown)
    try:
        old = replica(srv, 1)["pids"]
        os.kill(old[1], signal.SIGKILL)
        assert wait_until(lambda: replica(srv, 1)["restarts"] == 1, 120)
        assert wait_until(lambda: replica(srv, 1)["state"] == "up", 240)
        assert all(wait_until(lambda p=p: process_dead(p)) for p in old)
        new = replica(srv, 1)["pids"]
        assert len(new) == 2 and not set(new) & set(old)
        assert "replica 1 failed: scheduler-DP1-TP1 exited unexpectedly with code -9" in (
            log.read_text()
        )

        os.kill(new[1], signal.SIGSTOP)
        stuck: list[httpx.Response] = []
        threads = in_threads([lambda: stuck.append(post(srv, body(PROMPTS[0], 8, 1)))])
        assert wait_until(lambda: replica(srv, 1)["restarts"] == 2, 120)
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
        assert post(srv, body(PROMPTS[1], 4, 0)).status_code == 200
        threads[0].join(120)
        assert stuck[0].status_code == 503 and "no output for 5s" in stuck[0].text
        assert wait_until(lambda: replica(srv, 1)["state"] == "up", 240)
        assert post(srv, body(PROMPTS[1], 4, 1)).status_code == 200
        assert all(wait_until(lambda p=p: process_dead(p)) for p in new)
        assert "replica 1 stalled (no output for 5s with requests in flight)" in log.read_text()
    finally:
        next(teardown, None)


def rank_starts(log: Path) -> list[tuple[int, int]]:
    """(replica, pid) of each start of a replica's entry rank the launch log names, in order."""
    found = re.findall(r"started scheduler-DP(\d+)-TP0 \(pid (\d+)\)", log.read_text())
    return [(int(r), int(p)) for r, p in found]


def test_replicas_that_die_together_restart_independently(folder: str, tmp_path: Path) -> None:
    """Both replicas' ranks killed at once: each replica restarts in a thread of its own, so
    with the first new rank frozen while it starts (it never reports ready), the other replica
    still comes back and serves; the frozen one follows once its rank runs again."""
    log = tmp_path / "server.log"
    teardown = serve_then_check_teardown(OneRankServer(folder, log, "--dp", "2"))
    srv = next(teardown)
    frozen = None
    try:
        for r in (0, 1):
            os.kill(replica(srv, r)["pids"][0], signal.SIGKILL)
        assert wait_until(lambda: len(rank_starts(log)) > 2, 120)
        slow, frozen = rank_starts(log)[2]  # the first restart to begin
        os.kill(frozen, signal.SIGSTOP)
        other = 1 - slow
        assert wait_until(lambda: state_of(srv, other) == "up", 180), "one restart waited"
        assert state_of(srv, slow) == "restarting"
        assert post(srv, body(PROMPTS[0], 4, other)).status_code == 200
        os.kill(frozen, signal.SIGCONT)
        frozen = None
        assert wait_until(lambda: state_of(srv, slow) == "up", 180)
        assert post(srv, body(PROMPTS[0], 4, slow)).status_code == 200
        assert [replica(srv, r)["restarts"] for r in (0, 1)] == [1, 1]
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        next(teardown, None)
