"""End to end with InternVL 3: `launch.py --model-path <internvl folder>` at tp 1 on CPU, used
with the official openai client. Greedy text of text and image chats equals transformers'
generate on its own InternVLProcessor's inputs; /tokenize counts every tile's tokens and the
boundary tokens; what only the server may place, and what the family does not take, is refused
with a 400 naming the field; nothing is left held after the requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import family_server as fs
import pytest
from test_internvl import hf_processor, make_case, wide_image
from test_server import Server, png_url
from vlm_cases import gradient_image, noise_image, run_hf

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
    yield from fs.serve(folder, tmp_path_factory, "ivl_log")


@pytest.fixture(scope="module")
def dp_server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """tp 2 with the DP encoder: an image's tiles spread over both ranks."""
    yield from fs.serve(folder, tmp_path_factory, "ivl_dp_log", dp_encoder=True)


def test_oracle_outputs_differ(oracle: dict) -> None:
    assert len({text for text, _ in oracle.values()}) == len(oracle)


@pytest.mark.parametrize("name", CHATS)
def test_chat_equals_hf(server: Server, oracle: dict, name: str) -> None:
    fs.assert_chat_is_hfs(server, "internvl", CHATS[name], oracle[name], NEW_TOKENS)


@pytest.mark.parametrize("name", ["wide_image", "two_images"])
def test_chat_with_the_dp_encoder_at_tp2_equals_hf(dp_server: Server, oracle: dict,
                                                   name: str) -> None:
    fs.assert_chat_is_hfs(dp_server, "internvl", CHATS[name], oracle[name], NEW_TOKENS)


def test_tokenize_counts_every_tile(server: Server, oracle: dict) -> None:
    body = {"messages": [{"role": "user", "content": fs.parts(CHATS["two_images"])}]}
    out = fs.post(server, "/tokenize", body)
    assert out.status_code == 200
    assert out.json()["count"] == oracle["two_images"][1]  # 14 tiles of 4 tokens, 2 <img>...


@pytest.mark.parametrize("token", ["<img>", "</img>", "<IMG_CONTEXT>"])
def test_typed_media_tokens_are_refused(server: Server, token: str) -> None:
    fs.assert_typed_token_refused(server, "internvl", token)


def test_video_is_refused_by_name(server: Server) -> None:
    """A good video still: the family takes images only."""
    fs.assert_video_refused(server, "internvl")


def test_pixel_bounds_do_not_apply_to_tiles(server: Server) -> None:
    body = {
        "model": "internvl",
        "messages": [{"role": "user", "content": fs.parts([noise_image()])}],
        "mm_processor_kwargs": {"max_pixels": 100000},
    }
    out = fs.post(server, "/v1/chat/completions", body)
    assert out.status_code == 400
    assert out.json()["error"]["param"] == "mm_processor_kwargs.max_pixels"


def test_nothing_is_left_held(server: Server) -> None:
    content = [{"type": "image_url", "image_url": {"url": png_url(wide_image())}}]
    body = {"model": "internvl", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4}  # fmt: skip
    fs.assert_nothing_held(server, body)
