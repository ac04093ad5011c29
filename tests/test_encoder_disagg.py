"""LLM servers with `--encoder-urls`: the front end has each item encoded by an encoder server
(`--encoder-only`) before the request goes to a replica, whose ranks load no tower. Greedy
outputs equal HF's (text, one and two images, streamed), a repeated image is encoded once
across requests and across two `--dp` replicas sharing one encoder server, and the idle check
holds."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest
from encoder_servers import EncoderProc, start_encoder
from test_server import (
    NEW_TOKENS,
    QUESTION,
    Server,
    chat,
    chat_oracle,
    idle_info,
    image_part,
    serve_then_check_teardown,
)
from vlm_cases import Checkpoint, gradient_image, load_hf, noise_image, run_hf

from runtime.tiny_checkpoint import make_checkpoint
from runtime.transport.encoder_wire import ZmqEncoderTransport

TEXT = "Say something about the sea."
SECRET = "disagg-test-key"  # the module's encoder server signs (and checks) every message
KEYED = ("--encoder-secret", SECRET)
KEY = SECRET.encode()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("disagg") / "qwen2_vl"))


@pytest.fixture(scope="module")
def oracle(folder: str) -> dict:
    out = chat_oracle(folder, (56, 84), NEW_TOKENS)
    ckpt = Checkpoint(Path(folder))
    case = ckpt.case("text", [TEXT])
    run_hf(load_hf(Path(folder)), case, NEW_TOKENS)
    out["text"]["text"] = ckpt.tokenizer.decode(case.hf_tokens, skip_special_tokens=True)
    return out


@pytest.fixture(scope="module")
def encoder(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EncoderProc]:
    proc = start_encoder(folder, tmp_path_factory.mktemp("enclog") / "encoder.log", *KEYED)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def llm(folder: str, encoder: EncoderProc, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("llmlog") / "server.log"
    flags = ["--tp", "1", "--encoder-urls", encoder.job_url, *KEYED]
    yield from serve_then_check_teardown(Server(folder, log, *flags))


def encoded(encoder: EncoderProc, key: bytes | None = None) -> dict:
    """The encoder server's counters (its health answer)."""
    client = ZmqEncoderTransport(encoder.job_url, key)
    try:
        client.send({"op": "health", "job": 1})
        reply = client.recv(60)
        assert reply is not None, "the encoder server did not answer its health probe"
        return reply[0]
    finally:
        client.close()


def text_of(server: Server, content: list[dict], **kw) -> str:
    return chat(server, content, **kw).choices[0].message.content


def streamed(server: Server, content: list[dict]) -> str:
    chunks = chat(server, content, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def one_image() -> list[dict]:
    return [image_part(noise_image()), {"type": "text", "text": QUESTION}]


def two_images() -> list[dict]:
    parts = [image_part(gradient_image()), image_part(noise_image())]
    return [*parts, {"type": "text", "text": "Compare."}]


def assert_idle_and_leak_free(server: Server) -> None:
    info = idle_info(server)
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]
    assert info["kv_protected"] == 0 and info["encoder_cache"]["pins"] == 0


def test_outputs_equal_hf_with_an_encoder_server(
    llm: Server, encoder: EncoderProc, oracle: dict
) -> None:
    assert "no vision tower" in llm.log.read_text()  # the ranks did not load it
    before = encoded(encoder, KEY)
    assert text_of(llm, one_image()) == oracle["text"]["one_image"]
    assert text_of(llm, two_images()) == oracle["text"]["two_images"]
    assert streamed(llm, one_image()) == oracle["text"]["one_image"]
    assert text_of(llm, [{"type": "text", "text": TEXT}]) == oracle["text"]["text"]
    after = encoded(encoder, KEY)
    assert after["items_encoded"] - before["items_encoded"] == 2  # noise, gradient: once each
    assert after["jobs"] - before["jobs"] >= 3
    assert_idle_and_leak_free(llm)


def test_video_through_the_encoder_server_equals_hf(llm: Server, oracle: dict) -> None:
    url = "data:video/mp4;base64," + base64.b64encode(oracle["video"]).decode()
    content = [{"type": "video_url", "video_url": {"url": url}},
               {"type": "text", "text": "What happens?"}]  # fmt: skip
    assert text_of(llm, content) == oracle["text"]["video"]
    assert_idle_and_leak_free(llm)


def test_an_unsigned_health_probe_gets_no_answer(encoder: EncoderProc) -> None:
    """The keyed encoder server the LLM server uses answers signed messages only."""
    client = ZmqEncoderTransport(encoder.job_url)
    try:
        client.send({"op": "health", "job": 1})
        assert client.recv(3) is None
    finally:
        client.close()
    assert encoded(encoder, KEY)["ok"] is True


def test_a_repeated_image_is_encoded_once(llm: Server, encoder: EncoderProc, oracle: dict) -> None:
    content = [image_part(gradient_image()), {"type": "text", "text": QUESTION}]
    before = encoded(encoder, KEY)
    first, second = text_of(llm, content), text_of(llm, content)
    assert first == second == oracle["text"]["other_image"]
    after = encoded(encoder, KEY)
    assert after["items_encoded"] - before["items_encoded"] <= 1  # already seen: 0
    assert after["hits"] - before["hits"] >= 1
    assert_idle_and_leak_free(llm)


def test_two_replicas_share_one_encoder_server(
    folder: str, encoder: EncoderProc, oracle: dict, tmp_path: Path
) -> None:
    """--dp 2 with round robin: the same new image, sent twice, lands on both replicas and is
    encoded once by the shared encoder server."""
    flags = ["--tp", "1", "--dp", "2", "--dp-policy", "round_robin"]
    server = Server(folder, tmp_path / "dp.log", *flags, "--encoder-urls", encoder.job_url, *KEYED)
    try:
        content = [image_part(noise_image((84, 56), seed=11)), {"type": "text", "text": "Hi."}]
        before = encoded(encoder, KEY)
        first, second = text_of(server, content), text_of(server, content)
        assert first == second
        after = encoded(encoder, KEY)
        assert after["items_encoded"] - before["items_encoded"] == 1
        assert text_of(server, one_image()) == oracle["text"]["one_image"]
        assert streamed(server, two_images()) == oracle["text"]["two_images"]
        info = idle_info(server)
        routed = [r["routed"] for r in info["replicas"]]
        assert min(routed) >= 1  # both replicas served
        for replica in info["replicas"]:
            assert replica["kv_free"] + replica["kv_evictable"] == replica["kv_total"]
    finally:
        server.stop()


def test_llm_tp2_with_an_encoder_server_of_tp2(folder: str, oracle: dict, tmp_path: Path) -> None:
    enc = start_encoder(folder, tmp_path / "enc.log", "--tp", "2", "--mm-encoder-mode", "tp")
    try:
        server = Server(folder, tmp_path / "llm.log", "--encoder-urls", enc.job_url)  # tp 2
        try:
            assert text_of(server, one_image()) == oracle["text"]["one_image"]
            assert streamed(server, two_images()) == oracle["text"]["two_images"]
            assert_idle_and_leak_free(server)
        finally:
            server.stop()
        assert encoded(enc)["tp"] == 2
    finally:
        enc.stop()


def test_qwen3_vl_deepstack_rows_come_from_the_encoder_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Qwen3-VL's embedding rows carry its DeepStack levels: through the encoder server they
    reach the decoder as from its own tower (greedy text equal to HF's)."""
    folder = str(make_checkpoint("qwen3_vl", tmp_path_factory.mktemp("q3") / "qwen3_vl"))
    oracle = chat_oracle(folder, (64, 96), NEW_TOKENS)
    logs = tmp_path_factory.mktemp("q3log")
    enc = start_encoder(folder, logs / "enc.log")
    try:
        flags = ["--tp", "1", "--encoder-urls", enc.job_url]
        for server in serve_then_check_teardown(Server(folder, logs / "llm.log", *flags)):
            model = {"model": "qwen3_vl"}
            assert chat_text(server, one_image(), model) == oracle["text"]["one_image"]
            assert chat_text(server, two_images(), model) == oracle["text"]["two_images"]
            assert_idle_and_leak_free(server)
        assert encoded(enc)["row_dim"] > 64  # the main rows and the DeepStack levels
    finally:
        enc.stop()


def chat_text(server: Server, content: list[dict], body: dict) -> str:
    from test_server import client

    out = client(server).chat.completions.create(
        messages=[{"role": "user", "content": content}], max_tokens=NEW_TOKENS, temperature=0,
        **body,
    )
    return out.choices[0].message.content
