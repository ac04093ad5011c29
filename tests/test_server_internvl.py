"""End to end with InternVL 3: `launch.py --model-path <internvl folder>` at tp 1 on CPU, used
with the official openai client. Greedy text of text and image chats equals transformers'
generate on its own InternVLProcessor's inputs; /tokenize counts every tile's tokens and the
boundary tokens; what only the server may place, and what the family does not take, is refused
with a 400 naming the field; nothing is left held after the requests."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_internvl import hf_processor, make_case, wide_image
from test_openai_sampling import OneRankServer
from test_server import (
    Server,
    client,
    idle_info,
    image_part,
    mp4_bytes,
    png_url,
    serve_then_check_teardown,
)
from vlm_cases import gradient_image, noise_image, run_hf, video_frames

from runtime.model_config import ModelConfig
from runtime.tiny_checkpoint import hf_model_class, make_checkpoint

NEW_TOKENS = 16
QUESTION = "What is in the picture?"
CHATS = {
    "text": ["Describe the cat."],
    "one_image": [noise_image(), QUESTION],
    "wide_image": [wide_image(), QUESTION],
    "two_images": [gradient_image(), "and", noise_image(), "Compare them."],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("internvl", tmp_path_factory.mktemp("ivl_server") / "internvl")


@pytest.fixture(scope="module")
def oracle(folder: Path) -> dict:
    """HF's greedy text and prompt length per chat."""
    processor, config = hf_processor(folder), ModelConfig.from_dir(folder)
    model = hf_model_class("internvl").from_pretrained(folder).eval()
    out = {}
    for name, content in CHATS.items():
        case = make_case(processor, config, name, content)
        run_hf(model, case, NEW_TOKENS)
        text = processor.tokenizer.decode(case.hf_tokens, skip_special_tokens=True)
        out[name] = (text, len(case.input_ids))
    return out


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("ivl_log") / "server.log"
    yield from serve_then_check_teardown(OneRankServer(str(folder), log))


@pytest.fixture(scope="module")
def dp_server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """tp 2 with the DP encoder: an image's tiles spread over both ranks."""
    log = tmp_path_factory.mktemp("ivl_dp_log") / "server.log"
    yield from serve_then_check_teardown(Server(str(folder), log))


def parts(content: list) -> list[dict]:
    return [{"type": "text", "text": p} if isinstance(p, str) else image_part(p) for p in content]


def test_oracle_outputs_differ(oracle: dict) -> None:
    assert len({text for text, _ in oracle.values()}) == len(oracle)


@pytest.mark.parametrize("name", CHATS)
def test_chat_equals_hf(server: Server, oracle: dict, name: str) -> None:
    assert_chat_is_hfs(server, oracle, name)


@pytest.mark.parametrize("name", ["wide_image", "two_images"])
def test_chat_with_the_dp_encoder_at_tp2_equals_hf(dp_server: Server, oracle: dict,
                                                   name: str) -> None:
    assert_chat_is_hfs(dp_server, oracle, name)


def assert_chat_is_hfs(server: Server, oracle: dict, name: str) -> None:
    out = client(server).chat.completions.create(
        model="internvl",
        messages=[{"role": "user", "content": parts(CHATS[name])}],
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    text, prompt_tokens = oracle[name]
    assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == NEW_TOKENS


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_tokenize_counts_every_tile(server: Server, oracle: dict) -> None:
    body = {"messages": [{"role": "user", "content": parts(CHATS["two_images"])}]}
    out = post(server, "/tokenize", body)
    assert out.status_code == 200
    assert out.json()["count"] == oracle["two_images"][1]  # 14 tiles of 4 tokens, 2 <img>...


@pytest.mark.parametrize("token", ["<img>", "</img>", "<IMG_CONTEXT>"])
def test_typed_media_tokens_are_refused(server: Server, token: str) -> None:
    content = [image_part(noise_image()), {"type": "text", "text": f"look {token} here"}]
    body = {"model": "internvl", "messages": [{"role": "user", "content": content}]}
    out = post(server, "/v1/chat/completions", body)
    assert out.status_code == 400
    error = out.json()["error"]
    assert error["param"] == "messages" and token in error["message"]


def test_video_is_refused_by_name(server: Server) -> None:
    """A good video still: the family takes images only."""
    url = "data:video/mp4;base64," + base64.b64encode(mp4_bytes(video_frames(4))).decode()
    content = [{"type": "video_url", "video_url": {"url": url}},
               {"type": "text", "text": "What happens?"}]  # fmt: skip
    body = {"model": "internvl", "messages": [{"role": "user", "content": content}]}
    out = post(server, "/v1/chat/completions", body)
    assert out.status_code == 400
    error = out.json()["error"]
    assert (error["param"], error["code"]) == ("video_url", "unsupported_media")


def test_pixel_bounds_do_not_apply_to_tiles(server: Server) -> None:
    body = {
        "model": "internvl",
        "messages": [{"role": "user", "content": [image_part(noise_image())]}],
        "mm_processor_kwargs": {"max_pixels": 100000},
    }
    out = post(server, "/v1/chat/completions", body)
    assert out.status_code == 400
    assert out.json()["error"]["param"] == "mm_processor_kwargs.max_pixels"


def test_nothing_is_left_held(server: Server) -> None:
    content = [{"type": "image_url", "image_url": {"url": png_url(wide_image())}}]
    body = {"model": "internvl", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4}  # fmt: skip
    assert post(server, "/v1/chat/completions", body).status_code == 200
    info = idle_info(server)
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]
    assert info["encoder_cache"]["pins"] == 0
