"""End to end: `launch.py --tp 2 --mm-enable-dp-encoder --device cpu` on a tiny checkpoint, used
with the official openai client and raw HTTP; outputs against HF generate; bad input; teardown."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from dist_utils import free_port
from PIL import Image
from stress import LaunchedServer, group_pids
from test_media import png_header_only
from vlm_cases import Checkpoint, gradient_image, load_hf, noise_image, run_hf, video_frames
from waits import wait_until

from runtime.tiny_checkpoint import make_checkpoint
from tokenizer_manager.media.limits import MediaLimits
from tokenizer_manager.media.types import ProcessorSpec
from tokenizer_manager.media.worker import process_video_bytes

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 8
QUESTION = "What is in the picture?"
RESENT_IMAGES = (gradient_image((56, 84)), noise_image((84, 56), seed=7))  # sent only by one test


def png_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def mp4_bytes(frames: np.ndarray, fps: int = 4) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


class Server(LaunchedServer):
    """launch.py at tp 2 (or `tp`) with the DP encoder on CPU; teardown checks that no process is
    left."""

    def __init__(self, folder: str, log: Path, *extra: str, encoder: str = "dp", tp: int = 2):
        mode = ["--mm-enable-dp-encoder"] if encoder == "dp" else ["--mm-encoder-mode", encoder]
        flags = ["--model-path", folder, "--tp", str(tp), *mode, "--device", "cpu"]
        super().__init__([*flags, "--max-total-tokens", "6000", *extra], log)
        try:
            self.wait_healthy(240)
        except BaseException:
            self.stop()
            raise

    def pid_of(self, name: str) -> int:
        match = re.search(rf"started {name} \(pid (\d+)\)", self.log.read_text())
        assert match, f"no pid logged for {name}"
        return int(match.group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.group_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("server") / "qwen2_vl"))


def serve_then_check_teardown(srv: Server) -> Iterator[Server]:
    """A server fixture's body: serve, then SIGTERM must end every process of the server and
    leave none of their shared-memory media files behind."""
    yield srv
    pids = group_pids(srv.proc.pid)
    srv.stop()
    assert srv.proc.returncode is not None
    assert wait_until(lambda: not srv.group_alive()), "SIGTERM left a process of the server behind"
    assert [name for pid in pids for name in shm_media_files(pid)] == []


def shm_media_files(pid: int) -> list[str]:
    """The media files in /dev/shm that process `pid` created."""
    prefix = f"tessera-media-{pid}-"
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def chat_oracle(folder: str, frame_size: tuple[int, int], new_tokens: int) -> dict:
    """HF greedy text for the one-image, two-image and video chats the tests send (the video
    decoded as the server decodes it)."""
    ckpt = Checkpoint(Path(folder))
    video = mp4_bytes(video_frames(8, frame_size))
    spec = ProcessorSpec.from_checkpoint(folder, MediaLimits())
    prepared = process_video_bytes(video, spec, MediaLimits()).to_prepared()
    cases = {
        "one_image": ckpt.case("one_image", [noise_image(), QUESTION]),
        "other_image": ckpt.case("other_image", [gradient_image(), QUESTION]),
        "two_images": ckpt.case("two_images", [gradient_image(), noise_image(), "Compare."]),
        "resent": ckpt.case("resent", [*RESENT_IMAGES, "Compare."]),
        "video": ckpt.case("video", [prepared, "What happens?"]),
    }
    model = load_hf(Path(folder))
    for case in cases.values():
        run_hf(model, case, new_tokens)
    decode = ckpt.tokenizer.decode
    text = {k: decode(c.hf_tokens, skip_special_tokens=True) for k, c in cases.items()}
    return {"text": text, "video": video, "frame_times": prepared.frame_times}


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serve_then_check_teardown(Server(folder, log))


@pytest.fixture(scope="module")
def oracle(folder: str) -> dict:
    return chat_oracle(folder, (56, 84), NEW_TOKENS)


def client(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def image_part(image: Image.Image) -> dict:
    return {"type": "image_url", "image_url": {"url": png_url(image)}}


def chat(server: Server, content: list[dict], **kw):
    return client(server).chat.completions.create(
        model="qwen2_vl",
        messages=[{"role": "user", "content": content}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        **kw,
    )


def test_chat_one_image_equals_hf(server: Server, oracle: dict) -> None:
    out = chat(server, [image_part(noise_image()), {"type": "text", "text": QUESTION}])
    assert out.choices[0].message.content == oracle["text"]["one_image"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == NEW_TOKENS


def test_chat_two_images_equals_hf(server: Server, oracle: dict) -> None:
    content = [
        image_part(gradient_image()),
        image_part(noise_image()),
        {"type": "text", "text": "Compare."},
    ]
    assert chat(server, content).choices[0].message.content == oracle["text"]["two_images"]


def test_a_resent_conversation_is_served_from_the_processed_cache(
    server: Server, oracle: dict
) -> None:
    """A client resends the conversation's images: the second request takes them from the
    processed-item cache (no media worker) and answers as HF does; the cache's pixels are the
    main process's own shared-memory files, one per cached item."""
    content = [*map(image_part, RESENT_IMAGES), {"type": "text", "text": "Compare."}]
    before = idle_info(server)["media"]["processed_cache"]
    first = chat(server, content).choices[0].message.content
    second = chat(server, content).choices[0].message.content
    after = idle_info(server)["media"]["processed_cache"]
    assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (2, 2)
    assert first == second == oracle["text"]["resent"]
    assert 0 < after["bytes"] <= after["max_bytes"]
    assert len(shm_media_files(server.proc.pid)) == after["items"]


def test_a_client_media_id_stands_for_its_image(server: Server, oracle: dict) -> None:
    """Parts with a `uuid`: sent once with the image, then by the id alone (no bytes), the
    answer is HF's; an id the server does not know, without its image, is a 400 naming it."""
    first = [image_part(img) | {"uuid": f"resent-{i}"} for i, img in enumerate(RESENT_IMAGES)]
    by_id = [{"type": "image_url", "uuid": f"resent-{i}"} for i in range(2)]
    text = {"type": "text", "text": "Compare."}
    for parts in (first, by_id):
        out = chat(server, [*parts, text]).choices[0].message.content
        assert out == oracle["text"]["resent"]
    unknown = {"type": "image_url", "image_url": None, "uuid": "never-sent"}
    body = {"model": "qwen2_vl", "messages": [{"role": "user", "content": [unknown, text]}]}
    reply = post_chat(server, body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "uuid" and "never-sent" in reply.text
    body["messages"][0]["content"] = [{"type": "text", "text": "hi", "uuid": "x"}]
    assert post_chat(server, body).status_code == 400


def test_an_image_the_ranks_hold_goes_by_key(server: Server, oracle: dict) -> None:
    """Once sent, an image goes to the ranks by key: with the ranks' encoder caches holding it
    (after other text, so the radix cache cannot), no pixel byte is sent and the answer is the
    one the pixels give; after a flush (the ranks lost it) the ranks ask, get the pixels once,
    and the answer is HF's. Idle: no pixels held, no pin, KV all free or evictable."""
    image, question = image_part(noise_image()), {"type": "text", "text": QUESTION}
    look = [{"type": "text", "text": "Look closely."}, image, question]
    chat(server, [image, question])  # sent once (by key already if another test sent it)
    flush = lambda: httpx.post(server.url + "/flush_cache", timeout=30).status_code  # noqa: E731

    def delta(turn: list[dict]) -> tuple[str, dict[str, int]]:
        before = idle_info(server)
        text = chat(server, turn).choices[0].message.content
        after = idle_info(server)
        keys = ("pixel_bytes_sent", "items_sent_by_key", "items_asked_again")
        moved = {k: after["media"][k] - before["media"][k] for k in keys}
        moved["hits"] = after["encoder_cache"]["hits"] - before["encoder_cache"]["hits"]
        return text, moved

    assert flush() == 200
    text, moved = delta([image, question])
    assert text == oracle["text"]["one_image"]
    assert moved["items_sent_by_key"] == moved["items_asked_again"] == 1
    assert moved["pixel_bytes_sent"] > 0  # the answer to the ranks' question
    hit, moved = delta(look)
    assert moved == {
        "pixel_bytes_sent": 0, "items_sent_by_key": 1, "items_asked_again": 0, "hits": 1
    }
    assert flush() == 200
    miss, moved = delta(look)
    assert miss == hit and moved["items_asked_again"] == 1
    info = idle_info(server)
    assert info["media"]["requests_holding_pixels"] == 0 and info["encoder_cache"]["pins"] == 0
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]
    assert len(shm_media_files(server.proc.pid)) == info["media"]["processed_cache"]["items"]


def test_chat_video_equals_hf(server: Server, oracle: dict) -> None:
    url = "data:video/mp4;base64," + base64.b64encode(oracle["video"]).decode()
    content = [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "What happens?"},
    ]
    out = client(server).chat.completions.create(
        model="qwen2_vl",
        messages=[{"role": "user", "content": content}],
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    assert out.choices[0].message.content == oracle["text"]["video"]


def test_streaming_with_usage(server: Server, oracle: dict) -> None:
    stream = chat(
        server,
        [image_part(noise_image()), {"type": "text", "text": QUESTION}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == oracle["text"]["one_image"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == NEW_TOKENS
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


def test_ranks_wait_for_work_without_spinning(server: Server) -> None:
    """On CPU the ranks' OpenMP threads sleep when idle (unless the user chose otherwise)."""
    expected = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    for rank in ("scheduler-TP0", "scheduler-TP1"):
        environ = Path(f"/proc/{server.pid_of(rank)}/environ").read_bytes().split(b"\0")
        assert f"OMP_WAIT_POLICY={expected}".encode() in environ


def test_repeated_prompt_reports_cached_tokens(server: Server) -> None:
    content = [image_part(gradient_image()), {"type": "text", "text": "Once more."}]
    first = chat(server, content)
    second = chat(server, content)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_completions_and_native_generate(server: Server) -> None:
    out = client(server).completions.create(
        model="qwen2_vl", prompt="Hello there", max_tokens=4, temperature=0
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    body = {
        "text": "Describe.",
        "image_data": png_url(noise_image()),
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
    }
    native = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert len(native["output_ids"]) == 3 and native["meta_info"]["prompt_tokens"] > 4


FRONT_STAGES = ("receive", "parse", "template", "tokenize", "media", "build")


def test_models_metrics_and_idle_server_info(server: Server) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["qwen2_vl"]
    before = metric_values(server)
    chat(server, [image_part(gradient_image((56, 56))), {"type": "text", "text": "Hi."}])
    after = metric_values(server)
    assert after["tessera_kv_total_tokens[0]"] > 0  # labelled by replica
    for name in (
        "tessera_time_to_first_token_seconds_count",
        "tessera_e2e_request_latency_seconds_count",
        "tessera_request_stage_seconds_count[media]",
        "tessera_request_stage_seconds_count[decode]",
        "tessera_request_stage_seconds_count[queue]",
        "tessera_request_stage_seconds_count[encoder]",
        "tessera_request_stage_seconds_count[prefill]",
        *(f"tessera_request_stage_seconds_count[{stage}]" for stage in FRONT_STAGES),
        "tessera_request_stage_seconds_count[send]",
    ):
        assert after[name] == before.get(name, 0) + 1, name
    took = {  # seconds of this request in each stage
        stage: after[f"tessera_request_stage_seconds_sum[{stage}]"]
        - before.get(f"tessera_request_stage_seconds_sum[{stage}]", 0)
        for stage in (*FRONT_STAGES, "send", "first_token")
    }
    # the main process's stages follow each other between arrival and the send to the scheduler
    assert 0 < sum(took[stage] for stage in FRONT_STAGES) <= took["send"] <= took["first_token"]
    assert (
        after["tessera_inter_token_latency_seconds_count"]
        >= before.get("tessera_inter_token_latency_seconds_count", 0) + NEW_TOKENS - 1
    )
    info = idle_info(server)
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]
    assert info["kv_protected"] == 0 and info["encoder_cache"]["pins"] == 0
    # both processes froze their start-up objects (imports, tokenizer, model) once ready
    assert info["main_gc_frozen"] > 10_000 and info["gc_frozen"] > 10_000


def metric_values(server: Server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        s.name + "".join(f"[{v}]" for v in s.labels.values()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def server_info(server: Server, headers: dict | None = None) -> dict:
    return httpx.get(server.url + "/server_info", headers=headers, timeout=30).json()


def idle_info(server: Server, headers: dict | None = None) -> dict:
    """/server_info once nothing runs or waits (or after a generous deadline, for the caller's
    assertions to report)."""
    def idle() -> bool:
        info = server_info(server, headers)
        return info["running"] == 0 and info["waiting"] == 0

    wait_until(idle)
    return server_info(server, headers)


def send_and_hold(server: Server, path: str, body: dict, headers: dict | None = None
                  ) -> socket.socket:
    """Send a request on a plain socket and keep the connection open without reading: closing
    the socket is the client hanging up, at a moment the test chooses."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    lines = ["POST " + path + " HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {len(payload)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
    return sock


HEADER_ONLY_IMAGE = {  # ~100 bytes that announce 3000x3000 pixels (256 tokens here)
    "type": "image_url",
    "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(png_header_only(3000, 3000)).decode()
    },
}


def huge_png() -> str:
    return png_url(Image.new("RGB", (8000, 8000)))


BAD = {
    "malformed_json": (b"{not json", None),
    "no_messages": ({"model": "qwen2_vl", "messages": []}, None),
    "bad_base64": (
        [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
        "image_url",
    ),
    "not_an_image": (
        [
            {
                "type": "image_url",
                "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(b"hello world").decode()
                },
            }
        ],
        "image_url",
    ),
    "too_many_pixels": ([{"type": "image_url", "image_url": {"url": huge_png()}}], "image_url"),
    "unreachable_url": (
        [{"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{free_port()}/x.png"}}],
        "image_url",
    ),
    "local_file_refused": (
        [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}],
        "image_url",
    ),
    "too_many_images": ([{"type": "image_url", "image_url": {"url": "data:,"}}] * 17, "messages"),
    "deep_json": (b"[" * 50_000 + b"]" * 50_000, None),
    "huge_int": (b'{"model": "qwen2_vl", "max_tokens": ' + b"9" * 5000 + b"}", None),
    "image_header_beyond_context": (  # refused from the headers: decoding would say image_url
        {
            "model": "qwen2_vl",
            "max_tokens": 3500,
            "messages": [{"role": "user", "content": [HEADER_ONLY_IMAGE] * 4}],
        },
        "messages",
    ),
}


def post_chat(server: Server, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(
            server.url + "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def bad_body(case: str) -> object:
    body, _ = BAD[case]
    if isinstance(body, list):
        return {
            "model": "qwen2_vl",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [*body, {"type": "text", "text": "x"}]}],
        }
    return body


@pytest.mark.parametrize("case", list(BAD))
def test_bad_media_and_json_give_openai_errors(server: Server, case: str) -> None:
    resp = post_chat(server, bad_body(case))
    assert 400 <= resp.status_code < 500, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    expected = BAD[case][1]
    if expected:
        assert err["param"] == expected


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("temperature", -1),
        ("max_tokens", 10**7),
        ("model", "gpt-4"),
        ("top_p", 0),
        ("use_beam_search", True),
    ],
)
def test_bad_fields_give_400(server: Server, field: str, value: object) -> None:
    body = {
        "model": "qwen2_vl",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        field: value,
    }
    resp = post_chat(server, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_server_healthy_and_leak_free_after_bad_input(server: Server, oracle: dict) -> None:
    for case in BAD:
        post_chat(server, bad_body(case))
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    out = chat(server, [image_part(noise_image()), {"type": "text", "text": QUESTION}])
    assert out.choices[0].message.content == oracle["text"]["one_image"]
    info = idle_info(server)
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]
    assert info["kv_protected"] == 0 and info["encoder_cache"]["pins"] == 0


def test_killing_a_rank_stops_the_server(folder: str, tmp_path: Path) -> None:
    srv = Server(folder, tmp_path / "kill.log")
    try:
        os.kill(srv.pid_of("scheduler-TP1"), signal.SIGKILL)
        # the supervisor stops the server on its own (a hang would run into the generous wait)
        code = srv.proc.wait(60)
        assert code != 0
        assert "scheduler-TP1 exited unexpectedly" in (tmp_path / "kill.log").read_text()
    finally:
        srv.stop()
    assert wait_until(lambda: not srv.group_alive())


def test_a_busy_port_fails_the_launch_before_any_child_starts(folder: str) -> None:
    """The HTTP port is bound first thing: taken, the launch ends at once with a clear error
    (not after every rank has loaded the model, and no child process is started)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        cmd = [sys.executable, str(ROOT / "launch.py"), "--port", str(port),
               "--model-path", folder, "--tp", "2", "--device", "cpu"]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode != 0
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in run.stderr
    assert "started scheduler" not in run.stdout + run.stderr


def test_the_child_killed_first_is_named_not_the_rank_that_failed_after_it() -> None:
    """A killed rank's peer fails its next collective and exits with code 1 a few milliseconds
    later; when the supervisor finds both dead, the killed one is the reason (a CI run named
    TP0 for a SIGKILL of TP1)."""
    from types import SimpleNamespace

    from launch import death_reason

    def child(name: str, code: int | None) -> tuple:
        return name, SimpleNamespace(is_alive=lambda: code is None, exitcode=code), None

    live = [child("scheduler-TP0", None), child("detokenizer", None)]
    assert death_reason(live) is None
    both = [child("scheduler-TP0", 1), child("scheduler-TP1", -9), child("detokenizer", None)]
    assert death_reason(both) == (
        "scheduler-TP1 exited unexpectedly with code -9 (also exited: scheduler-TP0 with code 1)"
    )
    assert death_reason([child("scheduler-TP0", 1), child("detokenizer", 0)]) == (
        "scheduler-TP0 exited unexpectedly with code 1 (also exited: detokenizer with code 0)"
    )


def test_client_disconnect_aborts_on_every_rank(server: Server) -> None:
    body = {
        "model": "qwen2_vl",
        "max_tokens": 3000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell a long story."}],
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content": ""' not in line:
                break  # one real token arrived; now hang up
    info = idle_info(server)
    assert info["running"] == 0 and info["waiting"] == 0
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]
    assert info["kv_protected"] == 0
    assert info["counters"]["aborted"] >= 1


@pytest.fixture(scope="module")
def keyed_server(folder: str, tmp_path_factory: pytest.TempPathFactory):
    """The second server: two API keys from a file, and the auto encoder mode."""
    key = tmp_path_factory.mktemp("key") / "api-key"
    key.write_text(f"{API_KEY}\n{OTHER_KEY}\n")
    log = tmp_path_factory.mktemp("log") / "keyed.log"
    srv = Server(folder, log, "--api-key-file", str(key), encoder="auto")
    yield srv
    srv.stop()


def test_auto_encoder_mode_serves_hf_greedy(keyed_server: Server, oracle: dict) -> None:
    """Through HTTP with --mm-encoder-mode auto (calibrated at start-up): HF's greedy text."""
    from openai import OpenAI

    http = OpenAI(base_url=keyed_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    video = "data:video/mp4;base64," + base64.b64encode(oracle["video"]).decode()
    contents = {
        "one_image": [image_part(noise_image()), {"type": "text", "text": QUESTION}],
        "two_images": [
            image_part(gradient_image()),
            image_part(noise_image()),
            {"type": "text", "text": "Compare."},
        ],
        "video": [
            {"type": "video_url", "video_url": {"url": video}},
            {"type": "text", "text": "What happens?"},
        ],
    }
    for name, content in contents.items():
        out = http.chat.completions.create(
            model="qwen2_vl",
            messages=[{"role": "user", "content": content}],
            max_tokens=NEW_TOKENS,
            temperature=0,
        )
        assert out.choices[0].message.content == oracle["text"][name], name
    info = httpx.get(
        keyed_server.url + "/server_info", headers={"authorization": f"Bearer {API_KEY}"}
    ).json()
    assert info["mm_encoder_mode"] == "auto"
    assert sum(info["encoder_plans"].values()) >= len(contents)


API_KEY = "sekret-key"
OTHER_KEY = "another-tenant"


def test_client_media_ids_belong_to_the_key_that_sent_them(keyed_server: Server, oracle: dict):
    """The same `uuid` under two API keys names two items: the second key cannot take the
    first key's item by its id (a 400 without bytes), and its own bytes give its own answer.
    Within one key, an id reused with other bytes serves the id's first item."""
    from openai import BadRequestError, OpenAI

    def ask(key: str, part: dict) -> str:
        http = OpenAI(base_url=keyed_server.url + "/v1", api_key=key, max_retries=0, timeout=120)
        out = http.chat.completions.create(
            model="qwen2_vl",
            messages=[{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}],
            max_tokens=NEW_TOKENS,
            temperature=0,
        )
        return out.choices[0].message.content

    noise = image_part(noise_image()) | {"uuid": "tenant-id"}
    gradient = image_part(gradient_image()) | {"uuid": "tenant-id"}
    bare = {"type": "image_url", "uuid": "tenant-id"}
    assert oracle["text"]["one_image"] != oracle["text"]["other_image"]
    assert ask(API_KEY, noise) == oracle["text"]["one_image"]
    with pytest.raises(BadRequestError) as refused:
        ask(OTHER_KEY, bare)
    assert refused.value.body["param"] == "uuid"
    assert ask(OTHER_KEY, gradient) == oracle["text"]["other_image"]
    assert ask(OTHER_KEY, bare) == oracle["text"]["other_image"]
    assert ask(API_KEY, gradient) == oracle["text"]["one_image"]  # the id's first item
    assert ask(API_KEY, bare) == oracle["text"]["one_image"]
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
HANG_UP = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go on."}], **LONG}),
    "chat_stream": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Go on."}], "stream": True, **LONG},
    ),
    "completions": ("/v1/completions", {"prompt": "Once upon a time", **LONG}),
    "generate": (
        "/generate",
        {"text": "Once", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}},
    ),
}


def hang_up(server: Server, path: str, body: dict, headers: dict) -> None:
    """Send the request, then go away: after one chunk when streaming, else once the scheduler
    has it."""
    if body.get("stream"):
        with httpx.stream("POST", server.url + path, json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        return
    def in_flight() -> bool:
        info = server_info(server, headers)
        return info["running"] + info["waiting"] > 0

    sock = send_and_hold(server, path, body, headers)
    try:
        assert wait_until(in_flight)
    finally:
        sock.close()


@pytest.mark.parametrize("keyed", [False, True], ids=["no_key", "api_key"])
@pytest.mark.parametrize("case", list(HANG_UP))
def test_a_client_that_hangs_up_aborts_its_request(
    request: pytest.FixtureRequest, keyed: bool, case: str
) -> None:
    server = request.getfixturevalue("keyed_server" if keyed else "server")
    headers = {"authorization": f"Bearer {API_KEY}"} if keyed else {}
    aborted = idle_info(server, headers)["counters"]["aborted"]
    hang_up(server, *HANG_UP[case], headers)
    info = idle_info(server, headers)
    assert info["running"] == 0 and info["waiting"] == 0, "the request kept running"
    assert info["counters"]["aborted"] == aborted + 1
    log = server.log.read_text()
    assert "already running" not in log and "internal error" not in log


def test_api_key_is_checked() -> None:
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from runtime.server_args import ServerArgs
    from tokenizer_manager.http.server import create_app
    from tokenizer_manager.metrics import ServingMetrics

    args = ServerArgs(model_path="/models/demo", api_key="sekret")
    fake_tm = SimpleNamespace(
        args=args, context_length=128, healthy=lambda: True, metrics=ServingMetrics()
    )
    app = create_app(fake_tm)
    http = TestClient(app)
    assert http.get("/health").status_code == 200
    denied = http.get("/v1/models")
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    wrong = http.get("/v1/models", headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401
    ok = http.get("/v1/models", headers={"authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "demo"
