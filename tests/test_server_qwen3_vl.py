"""End to end with Qwen3-VL: `launch.py --model-path <qwen3_vl folder> --tp 2
--mm-enable-dp-encoder` on CPU, used with the official openai client; greedy outputs for image
and timestamped video chats against HF generate."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
from test_server import (
    QUESTION,
    Server,
    chat_oracle,
    client,
    image_part,
    serve_then_check_teardown,
)
from vlm_cases import gradient_image, noise_image

from runtime.tiny_checkpoint import make_checkpoint

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen3_vl", tmp_path_factory.mktemp("server3") / "qwen3_vl"))


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log3") / "server.log"
    yield from serve_then_check_teardown(Server(folder, log))


@pytest.fixture(scope="module")
def oracle(folder: str) -> dict:
    return chat_oracle(folder, (64, 96), NEW_TOKENS)


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
