"""End to end with Gemma 3 at tp 2 with the DP encoder (`launch.py --model-path <gemma3 folder>
--tp 2 --mm-enable-dp-encoder` on CPU), used with the official openai client: greedy text and
prompt_tokens of one image, two images, a conversation that sends its image again (its cached
tokens reported) and an image with pan-and-scan crops (`mm_processor_kwargs.do_pan_and_scan`:
the whole image and two crops, three tiles the DP encoder spreads over the ranks) equal
transformers' generate on the inputs of its own Gemma3Processor (bidirectional images:
`token_type_ids`).

The tp 1 paths (text, images, streamed, /tokenize, chunks of 8 that would cut every image,
typed media tokens and videos refused, the pan-and-scan count) run on the one Gemma 3 server
of tests/test_family_paths.py, beside every other family's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import family_server as fs
import pytest
import torch
from test_gemma3 import WIDE, hf_processor, image_media, make_case
from test_server import Server, client
from vlm_cases import gradient_image, noise_image, processor_case, run_hf

from runtime.model_config import ModelConfig
from runtime.tiny_checkpoint import hf_model_class, make_checkpoint

NEW_TOKENS = 16
QUESTION = "What is in the picture?"
CHATS = {
    "one_image": [noise_image((80, 60)), QUESTION],
    "two_images": [gradient_image(), "and", noise_image(), "Compare them."],
    "pan_and_scan": [WIDE, QUESTION],
}
CROPS = {"pan_and_scan": {"do_pan_and_scan": True}}  # a chat's mm_processor_kwargs
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
        run(name, make_case(processor, config, name, content, name in CROPS))
    turns = conversation(out["one_image"][0])
    keys = ("pixel_values", "token_type_ids")
    run("conversation", processor_case(processor, config, "conversation", [], image_media,
                                       keys, False, turns))  # fmt: skip
    return out


def test_oracle_outputs_differ(oracle: dict) -> None:
    """Every chat's greedy tokens are its own (texts of byte tokens may decode alike), and the
    crops are three runs of the one item."""
    tokens = [oracle[f"{name}_tokens"] for name in (*CHATS, "conversation")]
    assert len(set(tokens)) == len(tokens)
    assert len(oracle["pan_and_scan_mm"].items[0].offsets) == 3


@pytest.fixture(scope="module")
def dp_server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """tp 2 with the DP encoder."""
    yield from fs.serve(folder, tmp_path_factory, "gemma_dp_log", dp_encoder=True)


def assert_chat_is_hfs(server: Server, name: str, oracle: dict) -> None:
    """A greedy chat of CHATS[name] (with its mm_processor_kwargs) answers HF's text and
    prompt length."""
    body = {"model": "gemma3", "max_tokens": NEW_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": fs.parts(CHATS[name])}]}  # fmt: skip
    if name in CROPS:
        body["mm_processor_kwargs"] = CROPS[name]
    out = fs.post(server, "/v1/chat/completions", body)
    assert out.status_code == 200, out.text
    answer = out.json()
    text, prompt_tokens = oracle[name]
    assert answer["choices"][0]["message"]["content"] == text, name
    assert answer["usage"]["prompt_tokens"] == prompt_tokens, name


def test_dp_encoder_at_tp2_equals_hf(dp_server: Server, oracle: dict) -> None:
    """One and two images, an image with its crops, then the conversation that sends the first
    image again: HF's answer, and the KV of the first turn's prompt (its image included) comes
    from the cache; nothing is held after."""
    for name in CHATS:
        assert_chat_is_hfs(dp_server, name, oracle)
    turns = conversation(oracle["one_image"][0])
    out = fs.assert_chat_is_hfs(dp_server, "gemma3", [], oracle["conversation"], NEW_TOKENS,
                                turns)  # fmt: skip
    image_end = oracle["conversation_mm"].items[0].offsets[0][1]
    assert out.usage.prompt_tokens_details.cached_tokens >= image_end
    messages = [{"role": "user", "content": fs.parts(CHATS["two_images"])}]
    fs.assert_nothing_held(dp_server, {"model": "gemma3", "max_tokens": 4, "messages": messages})


def test_the_crops_answer_differs_from_the_whole_images(dp_server: Server, oracle: dict) -> None:
    """The same wide image after it was sent with pan-and-scan, now without: another item (the
    setting is in its digest; served from the processed-media cache by its bytes alone it would
    be the cropped item again, with its longer prompt), nothing reused past the image's start."""
    out = client(dp_server).chat.completions.create(
        model="gemma3", messages=[{"role": "user", "content": fs.parts(CHATS["pan_and_scan"])}],
        max_tokens=2, temperature=0,
    )  # fmt: skip
    assert out.usage.prompt_tokens < oracle["pan_and_scan"][1]
    start = oracle["pan_and_scan_mm"].items[0].offsets[0][0]
    assert (out.usage.prompt_tokens_details.cached_tokens or 0) <= start
