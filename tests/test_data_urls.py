"""Data: URLs lifted out of a request body before its JSON parse: the parsed value, the request
model and every error are exactly what the ordinary parse gives; only long data: URLs that are
certainly whole JSON string values are lifted."""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import orjson
import pytest

from tokenizer_manager.api import data_urls
from tokenizer_manager.api.body import decode_body
from tokenizer_manager.api.data_urls import MIN_LIFT, lift_data_urls, put_back
from tokenizer_manager.protocol import APIError, ChatCompletionRequest


def url(n: int, seed: int = 0, kind: str = "image/png") -> str:
    payload = random.Random(seed).randbytes(n * 3 // 4)
    return f"data:{kind};base64," + base64.b64encode(payload).decode()


def chat(*urls: str) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content = [*parts, {"type": "text", "text": "Look at these."}]
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 3}


def lifted_value(body: bytes) -> tuple[Any, int]:
    rest, urls = lift_data_urls(body)
    return put_back(orjson.loads(rest), urls), len(urls)


def test_a_chat_with_two_images_parses_to_the_same_value() -> None:
    body = json.dumps(chat(url(800_000, 1), url(800_000, 2))).encode()
    rest, urls = lift_data_urls(body)
    assert len(urls) == 2 and len(rest) < 1000
    assert put_back(orjson.loads(rest), urls) == orjson.loads(body)
    request = decode_body(body, ChatCompletionRequest, 64)
    assert request == ChatCompletionRequest.model_validate(orjson.loads(body))
    parts = request.messages[0].content
    assert [type(p.image_url.url) for p in parts[:2]] == [str, str]


@pytest.mark.parametrize(
    "text",
    [
        '{"a": ["' + url(MIN_LIFT * 2) + '"]}',  # an array element: not after a colon
        '{"' + url(MIN_LIFT * 2) + '": 1}',  # a key
        '{"a": "' + url(MIN_LIFT * 2).replace("/", "\\/") + '"}',  # escaped slashes
        '{"a": "x \\"' + url(MIN_LIFT * 2) + '\\" y"}',  # inside another string
        '{"a": "' + url(MIN_LIFT // 2) + '"}',  # short
        '{"a": "' + url(MIN_LIFT * 2) + 'é"}',  # not ASCII
    ],
    ids=["array", "key", "escaped_slash", "inside_text", "short", "not_ascii"],
)
def test_what_is_not_certainly_a_whole_value_is_left_to_the_parser(text: str) -> None:
    body = text.encode()
    value, lifted = lifted_value(body)
    assert lifted == 0 and value == orjson.loads(body)


@pytest.mark.parametrize("seed", range(40))
def test_random_documents_parse_alike(seed: int) -> None:
    """Data: URLs as values, keys, array items, inside texts, escaped or not, next to
    whitespace and nesting: the lifted parse always equals the ordinary one."""
    rng = random.Random(seed)

    def leaf() -> Any:
        u = url(rng.choice([100, MIN_LIFT, 3 * MIN_LIFT]), rng.randrange(1 << 30))
        return rng.choice([u, u.replace("/", "\\/"), f'say "{u}"', 7, None, "data:"])

    def node(depth: int) -> Any:
        if depth > 3 or rng.random() < 0.3:
            return leaf()
        if rng.random() < 0.5:
            return [node(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["url", url(MIN_LIFT * 2), "k"]) + str(i): node(depth + 1)
                for i in range(rng.randint(0, 3))}

    doc = {"model": "demo", "x": node(0), "y": leaf()}
    body = json.dumps(doc, indent=rng.choice([None, 1]), separators=rng.choice(
        [(",", ":"), (", ", ": "), (",", " :  ")])).encode()
    value, _ = lifted_value(body)
    assert value == orjson.loads(body) == doc


def test_a_placeholder_a_client_sends_is_its_own_text() -> None:
    forged = "\x00tessera-data-url-0123456789abcdef-0"
    doc = {"a": url(MIN_LIFT * 2), "b": forged, "c": "\x00" + data_urls._TAG + "7"}
    value, lifted = lifted_value(json.dumps(doc).encode())
    assert lifted == 1 and value == doc


def test_invalid_json_keeps_its_error_and_position() -> None:
    body = json.dumps(chat(url(MIN_LIFT * 4))).encode()[:-1] + b", }"
    with pytest.raises(APIError) as lifted:
        decode_body(body, ChatCompletionRequest, 64)
    with pytest.raises(APIError) as plain:
        decode_body(body, ChatCompletionRequest, 64, (body, {}))
    assert lifted.value.code == plain.value.code == "invalid_json"
    assert str(lifted.value) == str(plain.value)
    unterminated = b'{"a": "' + url(MIN_LIFT * 2).encode()
    assert lift_data_urls(unterminated) == (unterminated, {})


def test_deep_nesting_with_a_lifted_url_is_walked_without_recursion() -> None:
    """A lifted URL 900 levels deep (orjson allows about a thousand; Python's recursion
    limit is about the same): put back without recursion."""
    inner = url(MIN_LIFT * 2, 3).encode()
    body = (b'{"a": "' + url(MIN_LIFT * 2).encode() + b'", "b": ' + b'[{"u": ' * 450
            + b'{"v": "' + inner + b'"}' + b"}]" * 450 + b"}")
    rest, urls = lift_data_urls(body)
    node = put_back(orjson.loads(rest), urls)
    assert len(urls) == 2 and node["a"] == url(MIN_LIFT * 2)
    node = node["b"]
    for _ in range(449):
        node = node[0]["u"]
    assert node[0]["u"]["v"] == inner.decode()


def test_hostile_bodies_cost_a_bounded_scan() -> None:
    """Past MAX_CANDIDATES `"data:` strings, or past MAX_GAP bytes of white space after the
    colon, nothing more is lifted (the ordinary parse takes the rest): the scan on the event
    loop stays bounded, and the value is still exactly the parser's."""
    long = url(MIN_LIFT * 2)
    crowded = ('{"a": [' + '"data:",' * data_urls.MAX_CANDIDATES + '"x"], "b": "' + long + '"}')
    value, lifted = lifted_value(crowded.encode())
    assert lifted == 0 and value == orjson.loads(crowded)
    early = '{"b": "' + long + '", "a": [' + '"data:",' * 1000 + '"x"]}'
    value, lifted = lifted_value(early.encode())
    assert lifted == 1 and value == orjson.loads(early)
    for gap, expected in ((data_urls.MAX_GAP - 1, 1), (data_urls.MAX_GAP + 5, 0)):
        spaced = '{"b":' + " " * gap + '"' + long + '"}'
        value, lifted = lifted_value(spaced.encode())
        assert lifted == expected and value == orjson.loads(spaced)
