"""LLM servers with `--encoder-urls`: the front end has each item encoded by an encoder server
(`--encoder-only`) before the request goes to a replica, whose ranks load no tower. Greedy
outputs equal HF's (text, one and two images, streamed, video) for Qwen2-VL and, in one shared
test taking the family as a parameter, for InternVL 3, GLM-4.1V, Gemma 3, Qwen2.5-VL and
Qwen3-VL (LLM and encoder each at tp 1 and tp 2 over the families); a repeated image is encoded
once across requests and across two `--dp` replicas sharing one encoder server, and the idle
check holds."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import family_server as fs
import pytest
from encoder_servers import EncoderProc
from family_cases import FamilyCases
from test_openai_sampling import OneRankServer
from test_server import (
    NEW_TOKENS,
    QUESTION,
    Server,
    chat,
    chat_oracle,
    client,
    idle_info,
    image_part,
    mp4_bytes,
    serve_then_check_teardown,
)
from vlm_cases import Checkpoint, gradient_image, load_hf, noise_image, run_hf, video_frames

from runtime.tiny_checkpoint import make_checkpoint
from runtime.transport.encoder_wire import ZmqEncoderTransport
from tokenizer_manager.media.limits import MediaLimits
from tokenizer_manager.media.types import ProcessorSpec
from tokenizer_manager.media.worker import process_video_bytes

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
def started_encoder(
    folder: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EncoderProc]:
    """The module's encoder server, started (the LLM server starts beside it)."""
    proc = EncoderProc(folder, tmp_path_factory.mktemp("enclog") / "encoder.log", *KEYED)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def encoder(started_encoder: EncoderProc) -> EncoderProc:
    started_encoder.wait_ready()
    return started_encoder


@pytest.fixture(scope="module")
def llm(folder: str, started_encoder: EncoderProc, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("llmlog") / "server.log"
    flags = ["--tp", "1", "--encoder-urls", started_encoder.job_url, *KEYED]
    server = Server(folder, log, *flags)
    started_encoder.wait_ready()
    yield from serve_then_check_teardown(server)


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
    # the streamed resend's image is in the radix cache: it runs without its rows and may end
    # before its job leaves (the job is then cancelled), so two or three jobs
    assert after["jobs"] - before["jobs"] >= 2
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


# Every family beyond Qwen2-VL, one encoder server and one LLM server each: (LLM tp, the encoder
# server's flags). Between them each side runs at tp 1 and at tp 2 and the encoder in both its
# tp 2 modes; LLM tp 2 with encoder tp 2 on InternVL, whose image is one item of many tiles (a
# frame each: grid (tiles, 2, 2)), the shape furthest from Qwen2-VL's.
FAMILY_PAIRS = {
    "internvl": (2, ("--tp", "2", "--mm-encoder-mode", "tp")),
    "glm4v": (2, ()),  # images and video (frames of the image pad)
    "gemma3": (1, ("--tp", "2", "--mm-encoder-mode", "dp")),  # fixed-size SigLIP, pooled
    "qwen2_5_vl": (1, ("--tp", "2", "--mm-encoder-mode", "tp")),  # window attention
    "qwen3_vl": (1, ()),  # DeepStack levels ride in each embedding row
}
VIDEO = mp4_bytes(video_frames(8, (56, 84)))
FAMILY_CHATS = {
    "text": [TEXT],
    "one_image": [noise_image(), QUESTION],
    "wide_image": [noise_image((56, 392), seed=3), QUESTION],  # InternVL: 7 x 1 tiles + thumbnail
    "two_images": [gradient_image(), "and", noise_image(), "Compare them."],
    "video": [VIDEO, "What happens?"],
}


@pytest.fixture(scope="module", params=sorted(FAMILY_PAIRS))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def family_cases(family: str, tmp_path_factory: pytest.TempPathFactory) -> FamilyCases:
    return FamilyCases(make_checkpoint(family, tmp_path_factory.mktemp("families") / family))


def family_chats(cases: FamilyCases) -> dict[str, list]:
    return {k: v for k, v in FAMILY_CHATS.items() if k != "video" or cases.takes_video}


@pytest.fixture(scope="module")
def family_oracle(family_cases: FamilyCases) -> dict[str, tuple[str, int]]:
    """HF's greedy text and prompt length per chat (the video as the server decodes it)."""
    folder = str(family_cases.folder)
    spec = ProcessorSpec.from_checkpoint(folder, MediaLimits())
    model, out = family_cases.model(), {}
    for name, content in family_chats(family_cases).items():
        pieces = [process_video_bytes(p, spec, MediaLimits()).to_prepared()
                  if isinstance(p, bytes) else p for p in content]  # fmt: skip
        case = family_cases.case(name, pieces)
        run_hf(model, case, NEW_TOKENS)
        out[name] = (family_cases.text(case.hf_tokens), len(case.input_ids))
    return out


@pytest.fixture(scope="module")
def family_pair(
    family: str, family_cases: FamilyCases, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EncoderProc, Server]]:
    llm_tp, encoder_flags = FAMILY_PAIRS[family]
    folder, logs = str(family_cases.folder), tmp_path_factory.mktemp(f"{family}_logs")
    enc = EncoderProc(folder, logs / "enc.log", *encoder_flags)  # both start at once
    try:
        kind = Server if llm_tp == 2 else OneRankServer
        server = kind(folder, logs / "llm.log", "--encoder-urls", enc.job_url)
        enc.wait_ready()
        yield from ((enc, s) for s in serve_then_check_teardown(server))
    finally:
        enc.stop()


def test_each_family_through_an_encoder_server_equals_hf(
    family: str, family_cases: FamilyCases, family_pair: tuple, family_oracle: dict
) -> None:
    """Greedy text and prompt_tokens equal HF's for each chat, and streamed; each distinct item
    is encoded once by the encoder server (the noise image of two chats too), in rows as wide
    as the family's embedding rows; nothing is held after."""
    enc, server = family_pair
    assert "no vision tower" in server.log.read_text()
    before = encoded(enc)
    for name, content in family_chats(family_cases).items():
        fs.assert_chat_is_hfs(server, family, content, family_oracle[name], NEW_TOKENS)
    stream = client(server).chat.completions.create(
        model=family, messages=[{"role": "user", "content": fs.parts(FAMILY_CHATS["two_images"])}],
        max_tokens=NEW_TOKENS, temperature=0, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == family_oracle["two_images"][0]
    after = encoded(enc)
    media = 3 + family_cases.takes_video  # noise, wide, gradient (and the video)
    assert after["items_encoded"] - before["items_encoded"] == media
    assert after["tp"] == (2 if "--tp" in FAMILY_PAIRS[family][1] else 1)
    assert after["row_dim"] == family_cases.config.vision.embed_row_dim
    assert_idle_and_leak_free(server)
