"""tessera behind sglang-router (issue 55, item 5): the router binary in front of two tp 1
servers on a tiny checkpoint, with the round-robin and the cache-aware policy. Text and image
chats (and /generate) through the router are the answers the workers give directly, streamed or
not; the router sees tessera's model name and load, fans /flush_cache out, and keeps serving
through the worker left when the other is killed. Every process is gone at the end."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image
from stress import LaunchedServer, free_port, group_alive, stop_and_time
from vlm_cases import gradient_image
from waits import wait_until

from runtime.tiny_checkpoint import make_checkpoint

pytest.importorskip(
    "sglang_router", reason="sglang-router is not installed (`pip install sglang-router`)"
)

POLICIES = ("round_robin", "cache_aware")
MODEL = "qwen2_vl"  # the checkpoint folder's name: what tessera serves it as
TIMEOUT = 120  # seconds for one request on a loaded machine
LONG = 30000  # output tokens of a request that is still running seconds after its first token


class Router:
    """`python -m sglang_router.launch_router` in its own session (its process renames itself,
    so it is found by its process group)."""

    def __init__(self, workers: list[str], policy: str, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers]
        cmd += ["--policy", policy, "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        cmd += ["--log-level", "warn", *extra]
        self.log = log
        self.proc = subprocess.Popen(
            cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def workers(self) -> list[dict]:
        try:
            return httpx.get(self.url + "/workers", timeout=10).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def wait_ready(self, count: int) -> None:
        """Until the router has registered `count` healthy workers."""

        def ready() -> bool:
            assert self.proc.poll() is None, self.log.read_text()[-4000:]
            workers = self.workers()
            return len(workers) == count and all(w["is_healthy"] for w in workers)

        assert wait_until(ready, 120), f"router not ready:\n{self.log.read_text()[-4000:]}"

    def group_alive(self) -> bool:
        return group_alive(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 30 s (stop_and_time); then no process of it is left."""
        stop_and_time(self)
        assert not self.group_alive(), "a router process was left behind"


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LaunchedServer]]:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("router") / MODEL)
    flags = ["--model-path", str(folder), "--tp", "1", "--device", "cpu"]
    flags += ["--context-length", str(LONG + 1000), "--max-total-tokens", str(LONG + 8000)]
    flags += ["--log-level", "warning"]
    logs = tmp_path_factory.mktemp("router-logs")
    servers = [LaunchedServer(flags, logs / f"worker{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.wait_healthy(300)
        yield servers
    finally:
        for server in servers:
            stop_and_time(server)
    assert not any(server.group_alive() for server in servers), "a worker process was left"


@pytest.fixture(scope="module")
def routers(
    workers: list[LaunchedServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Router]]:
    logs = tmp_path_factory.mktemp("router-logs")
    urls = [w.url for w in workers]
    started = {policy: Router(urls, policy, logs / f"{policy}.log") for policy in POLICIES}
    try:
        for router in started.values():
            router.wait_ready(2)
        yield started
    finally:
        for router in started.values():
            router.stop()


def png_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


TEXT = [{"role": "user", "content": "Say something about routers."}]
IMAGE = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": png_url(gradient_image())}},
            {"type": "text", "text": "What is in the picture?"},
        ],
    }
]
CHATS = {"text": TEXT, "image": IMAGE}


def chat_body(messages: list[dict], **kw: object) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **kw}


def chat(url: str, body: dict) -> str:
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def streamed(url: str, body: dict) -> str:
    """The content of a streamed chat, its deltas joined."""
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


@pytest.fixture(scope="module")
def oracle(workers: list[LaunchedServer]) -> dict[str, str]:
    """Each chat's greedy answer from the first worker, asked directly."""
    return {name: chat(workers[0].url, chat_body(messages)) for name, messages in CHATS.items()}


def served(workers: list[LaunchedServer]) -> list[int]:
    """How many API requests each worker has taken."""
    return [info(w)["api"]["requests"] for w in workers]


def info(worker: LaunchedServer) -> dict:
    return httpx.get(worker.url + "/server_info", timeout=30).json()


def idle(worker: LaunchedServer) -> dict:
    """/server_info once nothing runs or waits."""
    wait_until(lambda: info(worker)["running"] + info(worker)["waiting"] == 0)
    return info(worker)


def test_the_router_knows_tessera_by_its_model_name(
    routers: dict[str, Router], workers: list[LaunchedServer]
) -> None:
    """It registers each worker under tessera's served name (from /server_info) and passes its
    /model_info through; /get_loads shows tessera's load, not the -1 of a worker it cannot ask."""
    for router in routers.values():
        assert [w["model_id"] for w in router.workers()] == [MODEL, MODEL]
        models = httpx.get(router.url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [MODEL]
        model_info = httpx.get(router.url + "/get_model_info", timeout=30).json()
        assert Path(model_info["model_path"]).name == MODEL and model_info["is_generation"]
        loads = httpx.get(router.url + "/get_loads", timeout=30).json()["workers"]
        assert sorted(entry["worker"] for entry in loads) == sorted(w.url for w in workers)
        assert all(entry["load"] >= 0 for entry in loads), loads


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(CHATS))
def test_chats_through_the_router_are_the_workers_answers(
    routers: dict[str, Router], workers: list[LaunchedServer], oracle: dict, policy: str, name: str
) -> None:
    """Greedy, streamed or not, with the model named or not (the router then sends "unknown"):
    the answer the worker gives directly. Round robin spreads the requests over both workers;
    cache-aware sends a repeated prompt to the worker that served it first."""
    url, body = routers[policy].url, chat_body(CHATS[name])
    before = served(workers)
    unnamed = {k: v for k, v in body.items() if k != "model"}
    answers = [chat(url, body), chat(url, unnamed), streamed(url, body | {"stream": True})]
    assert answers == [oracle[name]] * 3
    took = [after - first for after, first in zip(served(workers), before)]
    assert sum(took) == 3
    if policy == "round_robin":
        assert min(took) >= 1, took
    else:
        assert max(took) == 3, took


def test_get_loads_shows_the_kv_a_running_request_holds(
    routers: dict[str, Router], workers: list[LaunchedServer]
) -> None:
    """While a long stream runs on the first worker (a token has come back), the router's
    /get_loads shows its load and none on the idle second; once the stream is dropped both are
    back to 0 and every KV slot is free or evictable."""
    busy, quiet = workers
    body = chat_body(TEXT, max_tokens=LONG, ignore_eos=True, stream=True)
    with httpx.stream("POST", busy.url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()  # kept open: a closed iterator would close the stream
        for line in lines:
            if '"content": "' in line and '"role"' not in line:
                break
        for router in routers.values():
            loads = httpx.get(router.url + "/get_loads", timeout=30).json()["workers"]
            by_url = {entry["worker"]: entry["load"] for entry in loads}
            assert by_url[busy.url] > 0 and by_url[quiet.url] == 0, by_url
    for worker in workers:
        after = idle(worker)
        assert after["kv_free"] + after["kv_evictable"] == after["kv_total"]
    loads = httpx.get(routers["round_robin"].url + "/get_loads", timeout=30).json()["workers"]
    assert [entry["load"] for entry in loads] == [0, 0]


def test_flush_cache_is_fanned_out_to_every_worker(
    routers: dict[str, Router], workers: list[LaunchedServer], oracle: dict
) -> None:
    for worker in workers:
        assert chat(worker.url, chat_body(TEXT)) == oracle["text"]
        assert idle(worker)["kv_evictable"] > 0  # the prompt stays cached
    resp = httpx.post(routers["cache_aware"].url + "/flush_cache", timeout=60)
    assert resp.status_code == 200 and resp.json()["workers_flushed"] == 2, resp.text
    for worker in workers:
        after = idle(worker)
        assert after["kv_free"] == after["kv_total"] and after["kv_evictable"] == 0


def test_generate_through_the_router_is_the_workers_answer(
    routers: dict[str, Router], workers: list[LaunchedServer]
) -> None:
    """The native API too: the router adds its own fields to the body (log_metrics, ...)."""
    body = {"text": "Say something.", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    direct = httpx.post(workers[0].url + "/generate", json=body, timeout=TIMEOUT).json()
    for router in routers.values():
        resp = httpx.post(router.url + "/generate", json=body, timeout=TIMEOUT)
        assert resp.status_code == 200, resp.text
        assert resp.json()["output_ids"] == direct["output_ids"]


def test_dp_aware_routing_sends_rank_0(
    workers: list[LaunchedServer], oracle: dict, tmp_path: Path
) -> None:
    """--dp-aware: the router reads dp_size 1 and adds data_parallel_rank 0 to each body. Its
    health checks here go to /health_generate, which runs the model."""
    extra = ["--dp-aware", "--health-check-endpoint", "/health_generate"]
    router = Router([workers[0].url], "round_robin", tmp_path / "dp.log", *extra)
    try:
        router.wait_ready(1)
        assert [w["url"] for w in router.workers()] == [workers[0].url + "@0"]
        assert chat(router.url, chat_body(TEXT)) == oracle["text"]
    finally:
        router.stop()


def test_a_killed_worker_is_taken_out_and_the_other_serves(
    routers: dict[str, Router], workers: list[LaunchedServer], oracle: dict
) -> None:
    """The second worker is killed (every process of it): after at most a few failed requests
    (the router's own 5xx), every request is served, right, by the first. Runs last."""
    dead = workers[1]
    os.killpg(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait()
    assert wait_until(lambda: not dead.group_alive())
    for policy, router in routers.items():
        statuses = []
        for _ in range(12):
            resp = httpx.post(
                router.url + "/v1/chat/completions", json=chat_body(TEXT), timeout=TIMEOUT
            )
            statuses.append(resp.status_code)
            if resp.status_code == 200:
                assert resp.json()["choices"][0]["message"]["content"] == oracle["text"]
            if statuses[-4:] == [200] * 4:
                break
        assert statuses[-4:] == [200] * 4, (policy, statuses)
        failed = [s for s in statuses if s != 200]
        assert len(failed) <= 3 and all(s >= 500 for s in failed), (policy, statuses)
