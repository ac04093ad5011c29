"""Encoder servers (`launch.py --encoder-only`): the tower alone answers encode jobs over ZMQ with
the embeddings the composite model's encode step computes (DeepStack levels included), keeps
them by digest, refuses bad jobs as those jobs' errors, and checks the mac when it has a key.
The wire's pure parts are tested in-process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from encoder_servers import EncoderProc, start_encoder
from waits import wait_until

from runtime.distributed import TPGroup
from runtime.multimodal import Modality, MultimodalDataItem
from runtime.tiny_checkpoint import make_checkpoint
from runtime.transport.encoder_wire import (
    Channel,
    WireError,
    ZmqEncoderTransport,
    check_bind,
)
from runtime.transport.shm import SHM_DIR, new_media_path
from vision.vlm import build_model

GRIDS = [(1, 4, 6), (2, 4, 4)]


def items_for(folder: str, seed: int = 0) -> list[MultimodalDataItem]:
    from runtime.model_config import ModelConfig

    width = ModelConfig.from_dir(folder).vision.patch_dim
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, grid in enumerate(GRIDS):
        rows = grid[0] * grid[1] * grid[2]
        pixels = torch.randn(rows, width, generator=gen)
        digest = 1000 + seed * 10 + i
        out.append(MultimodalDataItem(Modality.IMAGE, pixels, hash=digest, grid_thw=grid))
    return out


def job(n: int, items: list[MultimodalDataItem], pixels: bool = True) -> tuple[dict, list]:
    rows, tensors = [], []
    for item in items:
        row = {"digest": item.hash, "modality": "image", "grid": list(item.grid_thw)}
        row["pixels"] = len(tensors) if pixels else None
        if pixels:
            tensors.append(item.feature)
        rows.append(row)
    return {"op": "encode", "job": n, "shm": True, "items": rows}, tensors


def ask(client: ZmqEncoderTransport, header: dict, tensors: list = (), wait: float = 120):
    client.send(header, tensors)
    reply = client.recv(wait)
    assert reply is not None, "the encoder server did not answer"
    return reply


def reference(folder: str, items: list[MultimodalDataItem]) -> dict[int, torch.Tensor]:
    model = build_model(folder, TPGroup())
    with torch.inference_mode():
        return model.encode_items(items)


def media_files() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("tessera-media-")}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint(request.param, tmp_path_factory.mktemp("enc") / request.param))


@pytest.fixture(scope="module")
def encoder(family: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EncoderProc]:
    proc = start_encoder(family, tmp_path_factory.mktemp("enclog") / "encoder.log")
    yield proc
    proc.stop()


def test_embeddings_equal_the_composite_encode_and_are_kept_by_digest(
    family: str, encoder: EncoderProc
) -> None:
    items = items_for(family)
    expected = reference(family, items)
    client = ZmqEncoderTransport(encoder.job_url)
    try:
        header, tensors = ask(client, *job(1, items))
        assert header["op"] == "embeddings" and header["job"] == 1
        assert header["digests"] == [i.hash for i in items]
        for item, got in zip(items, tensors):
            torch.testing.assert_close(got, expected[item.hash], rtol=1e-5, atol=1e-5)
        again, cached = ask(client, *job(2, items, pixels=False))  # digests only
        assert again["op"] == "embeddings"
        for first, got in zip(tensors, cached):
            assert torch.equal(got, first)
        health, _ = ask(client, {"op": "health", "job": 3})
        assert health["items_encoded"] == 2 and health["hits"] == 2
        assert health["row_dim"] == tensors[0].shape[1]
    finally:
        client.close()


def test_a_bad_job_is_that_jobs_error(family: str, encoder: EncoderProc) -> None:
    client = ZmqEncoderTransport(encoder.job_url)
    try:
        unknown = MultimodalDataItem(Modality.IMAGE, hash=77, grid_thw=(1, 4, 4))
        header, _ = ask(client, *job(10, [unknown], pixels=False))
        assert header == {"op": "error", "job": 10, "message": header["message"]}
        assert "unknown digest 77" in header["message"]
        bad = items_for(family, seed=5)[:1]
        bad[0].feature = bad[0].feature[:, :7]
        header, _ = ask(client, *job(11, bad))
        assert header["op"] == "error" and "pixels of shape" in header["message"]
        assert ask(client, {"op": "frobnicate", "job": 12})[0]["op"] == "error"
        good = items_for(family, seed=6)
        assert ask(client, *job(13, good))[0]["op"] == "embeddings"  # it still serves
    finally:
        client.close()
    assert wait_until(lambda: not {n for n in media_files() if str(encoder.proc.pid) in n})


def test_tp2_dp_encoder_server_matches(tmp_path: Path) -> None:
    folder = str(make_checkpoint("qwen2_vl", tmp_path / "ckpt"))
    items = items_for(folder, seed=2)
    expected = reference(folder, items)
    proc = start_encoder(folder, tmp_path / "log", "--tp", "2", "--mm-enable-dp-encoder")
    client = ZmqEncoderTransport(proc.job_url)
    try:
        header, tensors = ask(client, *job(1, items))
        assert header["op"] == "embeddings"
        for item, got in zip(items, tensors):
            torch.testing.assert_close(got, expected[item.hash], rtol=1e-5, atol=1e-5)
        assert ask(client, {"op": "health", "job": 2})[0]["mode"] == "dp"
    finally:
        client.close()
        proc.stop()


def test_a_keyed_server_answers_only_signed_messages(tmp_path: Path) -> None:
    folder = str(make_checkpoint("qwen2_vl", tmp_path / "ckpt"))
    proc = start_encoder(folder, tmp_path / "log", "--encoder-secret", "s3cret")
    wrong = ZmqEncoderTransport(proc.job_url, b"other")
    right = ZmqEncoderTransport(proc.job_url, b"s3cret")
    try:
        wrong.send({"op": "health", "job": 1})
        assert wrong.recv(3) is None
        assert ask(right, {"op": "health", "job": 2})[0]["ok"] is True
        assert "mac does not verify" in proc.log.read_text()
    finally:
        wrong.close()
        right.close()
        proc.stop()


# ---------------------------------------------------------------------- the wire, in-process


def test_channel_round_trip_inline_and_shared() -> None:
    tensors = [torch.arange(12, dtype=torch.float32).view(3, 4), torch.randn(200, 100)]
    tensors.append(torch.randn(5, 3).to(torch.bfloat16))
    for channel in (Channel(b"k"), Channel(b"k", SHM_DIR), Channel()):
        header, got = channel.unpack(channel.pack({"op": "x", "job": 1}, tensors))
        assert header == {"op": "x", "job": 1}
        for a, b in zip(tensors, got):
            assert a.dtype == b.dtype and torch.equal(a, b)
    before = media_files()
    frames = Channel(None, SHM_DIR).pack({"job": 1}, [torch.randn(300, 100)])
    assert len(media_files() - before) == 1
    Channel(None, SHM_DIR).unpack(frames)
    assert media_files() == before  # the receiver removed it


def test_channel_refuses_what_is_not_a_message() -> None:
    frames = Channel(b"k").pack({"job": 1}, [torch.ones(3)])
    with pytest.raises(WireError, match="mac"):
        Channel(b"other").unpack(frames)
    with pytest.raises(WireError, match="mac"):
        Channel(b"k").unpack([frames[0], frames[1], b"\0" * 12])
    forged = Channel(None, SHM_DIR)
    for path in ("/etc/passwd", new_media_path("/tmp")):
        body = f'{{"job": 1, "tensors": [{{"dtype": "uint8", "shape": [4], "shm": "{path}"}}]}}'
        with pytest.raises(WireError, match="may read"):
            forged.unpack([b"", body.encode()])
    with pytest.raises(WireError, match="dtype|description"):
        Channel().unpack([b"", b'{"tensors": [{"dtype": "object", "shape": [1]}]}'])
    with pytest.raises(WireError, match="matching buffer"):
        Channel().unpack([b"", b'{"tensors": [{"dtype": "uint8", "shape": [4]}]}', b"12"])


def test_binding_stays_internal() -> None:
    check_bind("tcp://127.0.0.1:5000", None)
    check_bind("tcp://10.0.0.3:5000", b"key")
    with pytest.raises(ValueError, match="encoder-secret"):
        check_bind("tcp://10.0.0.3:5000", None)
    with pytest.raises(ValueError, match="loopback or a private"):
        check_bind("tcp://8.8.8.8:5000", b"key")
    with pytest.raises(ValueError, match="loopback or a private"):
        check_bind("tcp://0.0.0.0:5000", b"key")
