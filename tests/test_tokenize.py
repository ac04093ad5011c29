"""POST /tokenize and /detokenize in vLLM's shapes, on a real TokenizerManager (the media
processor stood in for, as in test_request_path): images counted as the tokens they take."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from test_request_path import (  # noqa: F401
    IMAGE_URL,
    chat_input,
    checkpoint,
    front_end,
    manager,
    run,
)

CHAT = {
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": IMAGE_URL}},
                {"type": "text", "text": "hi"},
            ],
        }
    ]
}


@pytest.fixture
def http(checkpoint: Path) -> TestClient:  # noqa: F811
    return TestClient(front_end(checkpoint).app)


def test_a_prompt_tokenizes_as_the_tokenizer_does(http: TestClient) -> None:
    tm = http.app.state.tm
    out = http.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
    assert out["tokens"] == tm.tokenizer("Hello there")["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == tm.context_length
    assert "".join(out["token_strs"]) == "".join(tm.tokenizer.convert_ids_to_tokens(out["tokens"]))
    back = http.post("/detokenize", json={"tokens": out["tokens"]}).json()
    assert back == {"prompt": "Hello there"}


def test_messages_count_every_image_token_as_generation_would(http: TestClient) -> None:
    """The count equals the prompt length a chat request with the same messages gets."""
    tm = http.app.state.tm
    out = http.post("/tokenize", json=CHAT).json()
    expected = run(tm, chat_input()).input_ids
    assert out["count"] == len(expected)
    image = tm.config.image_token_id
    assert out["tokens"].count(image) == 6  # the stand-in image: 6 tokens
    asyncio.run(tm.close())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", **CHAT}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "chat_template": "{{ x }}"}, "chat_template"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    http: TestClient, path: str, body: dict, param: str
) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_chat_template_kwargs_reach_the_template_as_in_hf(http: TestClient) -> None:
    """Qwen2-VL's add_vision_id numbers the pictures: the count is HF's apply_chat_template's
    with the same kwarg (and differs from the count without it)."""
    tm = http.app.state.tm
    body = {**CHAT, "chat_template_kwargs": {"add_vision_id": True}}
    with_ids = http.post("/tokenize", json=body).json()["count"]
    without = http.post("/tokenize", json=CHAT).json()["count"]
    hf = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]

    def hf_count(**kw: object) -> int:
        ids = tm.tokenizer.apply_chat_template(
            hf, chat_template=tm.chat_template, add_generation_prompt=True, return_dict=False, **kw
        )
        return len(ids) - 1 + 6  # the one <|image_pad|> stands for the stand-in's 6 tokens

    assert (with_ids, without) == (hf_count(add_vision_id=True), hf_count())
    assert with_ids > without
    asyncio.run(tm.close())
