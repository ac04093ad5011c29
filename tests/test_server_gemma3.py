"""End to end with Gemma 3: `launch.py --model-path <gemma3 folder>` at tp 1 (and tp 2 with the
DP encoder) on CPU, used with the official openai client. Greedy text and prompt_tokens of a
text chat, one image, two images, a conversation that sends its image again (its cached tokens
reported) and a streamed chat equal transformers' generate on the inputs of its own
Gemma3Processor (bidirectional images: `token_type_ids`); so do image chats on a server whose
chunk size (8) would cut every image (16 soft tokens) in two, where the scheduler moves each
chunk end off the image instead. The boundary and soft tokens typed by a client, and videos,
are 400s naming the field; nothing is left held after the requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import family_server as fs
import pytest
import torch
from test_gemma3 import LONG_TEXT, hf_processor, image_media, make_case
from test_server import Server, client
from vlm_cases import gradient_image, noise_image, processor_case, run_hf

from runtime.model_config import ModelConfig
from runtime.tiny_checkpoint import hf_model_class, make_checkpoint

NEW_TOKENS = 16
QUESTION = "What is in the picture?"
CHATS = {
    "text": [LONG_TEXT],
    "one_image": [noise_image((80, 60)), QUESTION],
    "two_images": [gradient_image(), "and", noise_image(), "Compare them."],
}
FOLLOW_UP = "And what colors does it have?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("gemma3", tmp_path_factory.mktemp("gemma_server") / "gemma3")


def conversation(answer: str) -> list[tuple[str, list]]:
    """The one-image chat, its answer, and a follow-up question: the image is sent again."""
    return [("user", CHATS["one_image"]), ("assistant", [answer]), ("user", [FOLLOW_UP])]


@pytest.fixture(scope="module")
def oracle(folder: Path) -> dict[str, Any]:
    """HF's greedy text and prompt length per chat (and the conversation's, built on HF's own
    answer to the one-image chat), and where the first image ends in that prompt."""
    processor, config = hf_processor(folder), ModelConfig.from_dir(folder)
    model = hf_model_class("gemma3").from_pretrained(folder, dtype=torch.float32).eval()
    out: dict[str, Any] = {}

    def run(name: str, case: Any) -> None:
        run_hf(model, case, NEW_TOKENS)
        text = processor.tokenizer.decode(case.hf_tokens, skip_special_tokens=True)
        out[name] = (text, len(case.input_ids))
        out[f"{name}_mm"], out[f"{name}_tokens"] = case.mm, tuple(case.hf_tokens)

    for name, content in CHATS.items():
        run(name, make_case(processor, config, name, content))
    turns = conversation(out["one_image"][0])
    keys = ("pixel_values", "token_type_ids")
    run("conversation", processor_case(processor, config, "conversation", [], image_media,
                                       keys, False, turns))  # fmt: skip
    return out


def test_oracle_outputs_differ(oracle: dict) -> None:
    """Every chat's greedy tokens are its own (texts of byte tokens may decode alike)."""
    tokens = [oracle[f"{name}_tokens"] for name in (*CHATS, "conversation")]
    assert len(set(tokens)) == len(tokens)


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from fs.serve(folder, tmp_path_factory, "gemma_log")


def assert_conversation_reuses_the_image(server: Server, oracle: dict) -> None:
    """The one-image chat, then the conversation that sends its image again: HF's answer, and
    the KV of the first turn's prompt (its image included) comes from the cache."""
    fs.assert_chat_is_hfs(server, "gemma3", CHATS["one_image"], oracle["one_image"], NEW_TOKENS)
    turns = conversation(oracle["one_image"][0])
    out = fs.assert_chat_is_hfs(server, "gemma3", [], oracle["conversation"], NEW_TOKENS, turns)
    image_end = oracle["conversation_mm"].items[0].offsets[0][1]
    assert out.usage.prompt_tokens_details.cached_tokens >= image_end


def test_repeated_image_conversation_equals_hf_from_the_cache(server: Server, oracle) -> None:
    assert_conversation_reuses_the_image(server, oracle)


@pytest.mark.parametrize("name", CHATS)
def test_chat_equals_hf(server: Server, oracle: dict, name: str) -> None:
    """Text, one image, two images: HF's greedy text and prompt length."""
    fs.assert_chat_is_hfs(server, "gemma3", CHATS[name], oracle[name], NEW_TOKENS)


def test_streamed_chat_equals_hf(server: Server, oracle: dict) -> None:
    stream = client(server).chat.completions.create(
        model="gemma3", messages=[{"role": "user", "content": fs.parts(CHATS["two_images"])}],
        max_tokens=NEW_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == oracle["two_images"][0]
    assert chunks[-1].usage.prompt_tokens == oracle["two_images"][1]


def test_tokenize_counts_every_image_token(server: Server, oracle: dict) -> None:
    """Both images' soft tokens, their boundaries and the newlines around them."""
    messages = [{"role": "user", "content": fs.parts(CHATS["two_images"])}]
    answer = fs.post(server, "/tokenize", {"messages": messages})
    assert (answer.status_code, answer.json()["count"]) == (200, oracle["two_images"][1])


def test_typed_media_tokens_and_videos_are_refused_and_nothing_is_held(server: Server) -> None:
    """A client's <start_of_image>, <end_of_image> or <image_soft_token> is a 400 naming
    messages, a video one naming video_url (Gemma 3 takes images only); after a last chat
    nothing is held."""
    for token in ("<start_of_image>", "<end_of_image>", "<image_soft_token>"):
        fs.assert_typed_token_refused(server, "gemma3", token)
    fs.assert_video_refused(server, "gemma3")
    messages = [{"role": "user", "content": fs.parts(CHATS["two_images"])}]
    fs.assert_nothing_held(server, {"model": "gemma3", "max_tokens": 4, "messages": messages})


@pytest.fixture(scope="module")
def chunked_server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """tp 1 with chunks of 8 prompt tokens: every image (16 tokens) would be cut."""
    yield from fs.serve(folder, tmp_path_factory, "gemma_chunk_log", False,
                        "--chunked-prefill-size", "8")  # fmt: skip


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_chunked_prefill_never_splits_an_image(chunked_server, oracle, name: str) -> None:  # noqa: ANN001
    mm = oracle[f"{name}_mm"]
    assert any(lo % 8 and hi - lo > 8 for item in mm.items for lo, hi in item.offsets)
    fs.assert_chat_is_hfs(chunked_server, "gemma3", CHATS[name], oracle[name], NEW_TOKENS)


def test_chunked_server_conversation_equals_hf(chunked_server: Server, oracle: dict) -> None:
    assert_conversation_reuses_the_image(chunked_server, oracle)
    fs.assert_nothing_held(chunked_server, {"model": "gemma3", "max_tokens": 2, "messages": [
        {"role": "user", "content": fs.parts(CHATS["one_image"])}]})  # fmt: skip


@pytest.fixture(scope="module")
def dp_server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """tp 2 with the DP encoder."""
    yield from fs.serve(folder, tmp_path_factory, "gemma_dp_log", dp_encoder=True)


def test_dp_encoder_at_tp2_equals_hf(dp_server: Server, oracle: dict) -> None:
    """One and two images, then the conversation that sends the first image again."""
    for name in ("one_image", "two_images"):
        fs.assert_chat_is_hfs(dp_server, "gemma3", CHATS[name], oracle[name], NEW_TOKENS)
    assert_conversation_reuses_the_image(dp_server, oracle)
