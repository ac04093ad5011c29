"""End to end with GLM-4.1V: `launch.py --model-path <glm4v folder>` at tp 1 (and tp 2 with the
DP encoder) on CPU, used with the official openai client. Greedy text and prompt_tokens of text
and image chats equal transformers' generate on the checkpoint's tokenizer, chat template and
Glm4vImageProcessor inputs; the boundary and placeholder tokens typed by a client, and videos,
are refused with a 400 naming the field; nothing is left held after the requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import family_server as fs
import pytest
from test_server import Server
from vlm_cases import Checkpoint, gradient_image, load_hf, noise_image, run_hf

from runtime.tiny_checkpoint import make_checkpoint

NEW_TOKENS = 16
QUESTION = "What is in the picture?"
CHATS = {
    "text": ["Describe the cat."],
    "one_image": [noise_image(), QUESTION],
    "large_image": [noise_image((168, 252), seed=2), QUESTION],  # 12 x 18 patches
    "two_images": [gradient_image(), "and", noise_image(), "Compare them."],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("glm4v", tmp_path_factory.mktemp("glm_server") / "glm4v")


@pytest.fixture(scope="module")
def oracle(folder: Path) -> dict:
    """HF's greedy text and prompt length per chat (its own Conv3d patch embedding)."""
    ckpt, model = Checkpoint(folder), load_hf(folder, gemm_patch_embed=False)
    out = {}
    for name, content in CHATS.items():
        case = ckpt.case(name, content)
        run_hf(model, case, NEW_TOKENS)
        text = ckpt.tokenizer.decode(case.hf_tokens, skip_special_tokens=True)
        out[name] = (text, len(case.input_ids))
    return out


def test_oracle_outputs_differ(oracle: dict) -> None:
    assert len({text for text, _ in oracle.values()}) == len(oracle)


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from fs.serve(folder, tmp_path_factory, "glm_log")


@pytest.mark.parametrize("name", CHATS)
def test_chat_equals_hf(server: Server, oracle: dict, name: str) -> None:
    fs.assert_chat_is_hfs(server, "glm4v", CHATS[name], oracle[name], NEW_TOKENS)


def test_tokenize_counts_every_image_token(server: Server, oracle: dict) -> None:
    body = {"messages": [{"role": "user", "content": fs.parts(CHATS["two_images"])}]}
    out = fs.post(server, "/tokenize", body)
    assert out.status_code == 200
    assert out.json()["count"] == oracle["two_images"][1]  # 12 + 4 image tokens, boundaries


@pytest.mark.parametrize("token", ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>"])
def test_typed_media_tokens_are_refused(server: Server, token: str) -> None:
    fs.assert_typed_token_refused(server, "glm4v", token)


def test_video_is_refused_by_name(server: Server) -> None:
    """tessera serves GLM-4.1V's images only; its template marks a video with boundaries of
    its own, which must not be taken for typed tokens first."""
    fs.assert_video_refused(server, "glm4v")


def test_nothing_is_left_held(server: Server) -> None:
    content = fs.parts(CHATS["large_image"])
    body = {"model": "glm4v", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    fs.assert_nothing_held(server, body)


@pytest.fixture(scope="module")
def dp_server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """tp 2 with the DP encoder."""
    yield from fs.serve(folder, tmp_path_factory, "glm_dp_log", dp_encoder=True)


@pytest.mark.parametrize("name", ["large_image", "two_images"])
def test_dp_encoder_chat_at_tp2_equals_hf(dp_server: Server, oracle: dict, name: str) -> None:
    fs.assert_chat_is_hfs(dp_server, "glm4v", CHATS[name], oracle[name], NEW_TOKENS)
