"""End to end with Qwen3-VL: `launch.py --model-path <qwen3_vl folder> --tp 2
--mm-enable-dp-encoder` on CPU, used with the official openai client; greedy outputs for image
and timestamped video chats against HF generate."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest
from make_tiny_checkpoint import make_checkpoint
from test_server import QUESTION, Server, client, image_part, mp4_bytes
from vlm_cases import Checkpoint, gradient_image, load_hf, noise_image, run_hf, video_frames

from tokenizer_manager.media import MediaLimits
from tokenizer_manager.mm_processor import ProcessorSpec, process_video_bytes

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen3_vl", tmp_path_factory.mktemp("server3") / "qwen3_vl"))


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(folder, tmp_path_factory.mktemp("log3") / "server.log")
    yield srv
    srv.stop()
    deadline = time.monotonic() + 10
    while srv.group_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not srv.group_alive(), "SIGTERM left a process of the server behind"


@pytest.fixture(scope="module")
def oracle(folder: str) -> dict:
    """HF greedy text for the messages the tests send (the video decoded as the server does)."""
    ckpt = Checkpoint(Path(folder))
    video = mp4_bytes(video_frames(8, (64, 96)))
    spec = ProcessorSpec.from_checkpoint(folder, MediaLimits())
    prepared = process_video_bytes(video, spec, MediaLimits()).to_prepared()
    cases = {
        "one_image": ckpt.case("one_image", [noise_image(), QUESTION]),
        "two_images": ckpt.case("two_images", [gradient_image(), noise_image(), "Compare."]),
        "video": ckpt.case("video", [prepared, "What happens?"]),
    }
    model = load_hf(Path(folder))
    for case in cases.values():
        run_hf(model, case, NEW_TOKENS)
    decode = ckpt.tokenizer.decode
    text = {k: decode(c.hf_tokens, skip_special_tokens=True) for k, c in cases.items()}
    return {"text": text, "video": video, "frame_times": prepared.frame_times}


def chat(server: Server, content: list[dict]) -> str:
    out = client(server).chat.completions.create(
        model="qwen3_vl",
        messages=[{"role": "user", "content": content}],
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    assert out.usage.completion_tokens == NEW_TOKENS
    return out.choices[0].message.content


def test_oracle_outputs_differ(oracle: dict) -> None:
    """Different media, different greedy text: the comparisons below can fail."""
    assert len(set(oracle["text"].values())) == len(oracle["text"])


def test_chat_one_image_equals_hf(server: Server, oracle: dict) -> None:
    content = [image_part(noise_image()), {"type": "text", "text": QUESTION}]
    assert chat(server, content) == oracle["text"]["one_image"]


def test_chat_two_images_equals_hf(server: Server, oracle: dict) -> None:
    content = [
        image_part(gradient_image()),
        image_part(noise_image()),
        {"type": "text", "text": "Compare."},
    ]
    assert chat(server, content) == oracle["text"]["two_images"]


def test_chat_timestamped_video_equals_hf(server: Server, oracle: dict) -> None:
    assert oracle["frame_times"] is not None and len(oracle["frame_times"]) > 1
    url = "data:video/mp4;base64," + base64.b64encode(oracle["video"]).decode()
    content = [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "What happens?"},
    ]
    assert chat(server, content) == oracle["text"]["video"]
