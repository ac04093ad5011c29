"""End to end with GLM-4.1V: `launch.py --model-path <glm4v folder>` at tp 1 (and tp 2 with the
DP encoder) on CPU, used with the official openai client. Greedy text and prompt_tokens of text,
image and video chats equal transformers' generate on the checkpoint's tokenizer, chat template,
Glm4vImageProcessor inputs and the video as the server decodes it (its timestamped prompt
checked against Glm4vProcessor's in test_glm4v); the boundary and placeholder tokens typed by a
client are refused with a 400 naming the field, and so are the frame settings GLM's video
processor does not take; nothing is left held after the requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import family_server as fs
import pytest
from test_server import Server, client, mp4_bytes
from vlm_cases import Checkpoint, gradient_image, load_hf, noise_image, run_hf, video_frames

from runtime.tiny_checkpoint import make_checkpoint
from tokenizer_manager.media.limits import MediaLimits
from tokenizer_manager.media.types import ProcessorSpec
from tokenizer_manager.media.worker import process_video_bytes

NEW_TOKENS = 16
QUESTION = "What is in the picture?"
VIDEO = mp4_bytes(video_frames(8, (56, 84)))  # 2 s at 4 fps: frames 0, 2, 4, 6 at GLM's 2 fps
CHATS = {
    "text": ["Describe the cat."],
    "one_image": [noise_image(), QUESTION],
    "large_image": [noise_image((168, 252), seed=2), QUESTION],  # 12 x 18 patches
    "two_images": [gradient_image(), "and", noise_image(), "Compare them."],
    "video": [VIDEO, "What happens?"],
}
# transformers 5.23's Glm4vModel cannot take both in one prompt (its image and video masks are
# one mask): no oracle, served and released all the same
VIDEO_AND_IMAGE = [noise_image(), VIDEO, "Which came first?"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("glm4v", tmp_path_factory.mktemp("glm_server") / "glm4v")


@pytest.fixture(scope="module")
def oracle(folder: Path) -> dict:
    """HF's greedy text and prompt length per chat (its own Conv3d patch embedding)."""
    ckpt, model = Checkpoint(folder), load_hf(folder, gemm_patch_embed=False)
    spec = ProcessorSpec.from_checkpoint(str(folder), MediaLimits())
    video = process_video_bytes(VIDEO, spec, MediaLimits()).to_prepared()
    assert video.grid_thw == (2, 4, 6) and video.frame_times == (0.0, 1.0)
    out = {}
    for name, content in CHATS.items():
        case = ckpt.case(name, [video if isinstance(p, bytes) else p for p in content])
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


@pytest.mark.parametrize("name", ["two_images", "video"])
def test_tokenize_counts_every_media_token(server: Server, oracle: dict, name: str) -> None:
    body = {"messages": [{"role": "user", "content": fs.parts(CHATS[name])}]}
    out = fs.post(server, "/tokenize", body)
    assert out.status_code == 200
    assert out.json()["count"] == oracle[name][1]  # media tokens, boundaries, timestamps


@pytest.mark.parametrize("token", ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>"])
def test_typed_media_tokens_are_refused(server: Server, token: str) -> None:
    fs.assert_typed_token_refused(server, "glm4v", token)


def video_chat(server: Server, content: list, **kw: Any) -> Any:
    return client(server).chat.completions.create(
        model="glm4v", messages=[{"role": "user", "content": fs.parts(content)}],
        max_tokens=NEW_TOKENS, temperature=0, **kw,
    )  # fmt: skip


def test_streamed_video_chat_equals_hf(server: Server, oracle: dict) -> None:
    chunks = list(video_chat(server, CHATS["video"], stream=True,
                             stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == oracle["video"][0]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == oracle["video"][1]


def test_video_conversation_sent_again_reports_cached_tokens(server: Server) -> None:
    """The same video shares its KV (its pad values are its digest's); another video does not
    past the text before it."""
    content = [mp4_bytes(video_frames(8, (56, 84), seed=5)), "What happens?"]
    first, second = video_chat(server, content), video_chat(server, content)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    other = video_chat(server, [mp4_bytes(video_frames(8, (56, 84), seed=6)), "What happens?"])
    assert other.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2


@pytest.mark.parametrize("token", ["<|begin_of_video|>", "<|end_of_video|>", "<|video|>"])
def test_typed_video_tokens_are_refused(server: Server, token: str) -> None:
    fs.assert_typed_token_refused(server, "glm4v", token)


@pytest.mark.parametrize("key", ["num_frames", "min_frames", "max_frames"])
def test_frame_settings_glm_does_not_take_are_refused(server: Server, key: str) -> None:
    content = fs.parts(CHATS["video"])
    body = {"model": "glm4v", "messages": [{"role": "user", "content": content}],
            "mm_processor_kwargs": {key: 4}}  # fmt: skip
    out = fs.post(server, "/v1/chat/completions", body)
    assert out.status_code == 400
    assert out.json()["error"]["param"] == f"mm_processor_kwargs.{key}"


def test_nothing_is_left_held(server: Server) -> None:
    content = fs.parts(VIDEO_AND_IMAGE)
    body = {"model": "glm4v", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    fs.assert_nothing_held(server, body)


@pytest.fixture(scope="module")
def dp_server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """tp 2 with the DP encoder."""
    yield from fs.serve(folder, tmp_path_factory, "glm_dp_log", dp_encoder=True)


@pytest.mark.parametrize("name", ["large_image", "two_images", "video"])
def test_dp_encoder_chat_at_tp2_equals_hf(dp_server: Server, oracle: dict, name: str) -> None:
    fs.assert_chat_is_hfs(dp_server, "glm4v", CHATS[name], oracle[name], NEW_TOKENS)
