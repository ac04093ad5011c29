"""tokenizer_manager/front_end.py: the one factory of the main process's front end (what
launch.py serves with) builds, starts and stops the media processor, the TokenizerManager and the
HTTP app, and leaves no media worker behind, also when building fails half-way."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from pathlib import Path

import pytest
import torch
from waits import process_dead, wait_until

from runtime.io_struct import TokenizedGenerateReq
from runtime.multimodal import Modality, MultimodalDataItem, MultimodalInputs
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from tokenizer_manager.encoder_pool import EncoderPool
from tokenizer_manager.front_end import FrontEnd, build_front_end
from tokenizer_manager.http.connection_limits import BoundedHttpProtocol, ConnectionLimits
from tokenizer_manager.media.limits import MediaLimits
from tokenizer_manager.media.mm_processor import AsyncMMDataProcessor
from tokenizer_manager.metrics import RequestTimeline
from tokenizer_manager.tokenizer_manager import ReqState


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("front") / "qwen2_vl"))


def served_args(checkpoint: str) -> ServerArgs:
    return ServerArgs(model_path=checkpoint, device="cpu", media_workers=1, port=31999).resolve()


def all_dead(pids: list[int]) -> bool:
    return wait_until(lambda: all(process_dead(pid) for pid in pids))


def test_the_factory_builds_what_launch_serves(checkpoint: str) -> None:
    args = served_args(checkpoint)
    front = build_front_end(args, kv_total=300)
    assert isinstance(front.mm, AsyncMMDataProcessor)
    assert front.tm.mm is front.mm and front.app.state.tm is front.tm
    assert front.tm.budget.limit == min(front.tm.context_length, 300)
    config = front.uvicorn_config(timeout_graceful_shutdown=2)
    assert (config.host, config.port, config.log_level) == (args.host, 31999, args.log_level)
    assert isinstance(config.http, functools.partial)
    assert config.http.func is BoundedHttpProtocol
    assert config.http.keywords["limits"] == ConnectionLimits.from_server_args(args)

    async def serve_and_stop(front: FrontEnd) -> list[int]:
        await front.start()
        pids = front.mm.worker_pids()
        await front.close()
        return pids

    pids = asyncio.run(serve_and_stop(front))
    assert len(pids) == 1
    assert all_dead(pids), "a media worker outlived the front end"


def test_a_text_only_front_end_has_no_media(checkpoint: str) -> None:
    front = build_front_end(served_args(checkpoint), media=None)
    assert front.mm is None and front.tm.mm is None
    asyncio.run(front.close())


def test_a_failed_build_stops_the_media_workers(checkpoint: str, tmp_path: Path) -> None:
    """The media processor starts its workers; a TokenizerManager that cannot be built (no
    checkpoint in its folder) must not leave them running."""
    pids: list[int] = []

    def media(args: ServerArgs) -> AsyncMMDataProcessor:
        mm = AsyncMMDataProcessor(checkpoint, MediaLimits(), cpu_workers=1)
        assert wait_until(lambda: len(mm.worker_pids()) == 1), "the media worker did not start"
        pids.extend(mm.worker_pids())
        return mm

    empty = ServerArgs(model_path=str(tmp_path), device="cpu", media_workers=1).resolve()
    with pytest.raises(Exception):  # noqa: B017 - whatever the loader raises for an empty folder
        build_front_end(empty, media=media)
    assert len(pids) == 1
    assert all_dead(pids), "a media worker outlived the failed build"


def test_a_request_whose_media_are_encoding_does_not_run_the_stall_clocks(
    checkpoint: str,
) -> None:
    """With --encoder-urls a request is sent before its encoder jobs end; while they run its
    replica owes it nothing, so a slow encoder server is no stalled replica (with --dp it would
    be killed); once its rows go, its replica's clock starts from then."""
    args = dataclasses.replace(served_args(checkpoint), health_stall_timeout=0.5, dp_size=2)
    tm = build_front_end(args, media=None).tm
    state = tm.states["r-0"] = ReqState(RequestTimeline(tm.metrics), replica=1)
    state.encoding = True
    tm.last_progress = tm.replica_progress[1] = time.monotonic() - 10
    assert not tm.stalled() and tm.stalled_replicas() == [] and not tm.busy(1)
    tm.start_stall_clocks(1)  # what sending its rows does
    state.encoding = False
    assert not tm.stalled() and tm.stalled_replicas() == [] and tm.busy(1)
    tm.last_progress = tm.replica_progress[1] = time.monotonic() - 10
    assert tm.stalled() and tm.stalled_replicas() == [1]


def test_spill_gives_an_idle_replicas_tower_the_media_the_busy_encoders_would_queue(
    checkpoint: str,
) -> None:
    """--encoder-fallback spill: a request's media go to its replica's own tower only while
    every encoder server has a job in flight (or none is up) and that replica neither decodes
    nor encodes another spilled request; a text request, or the plain fallback, never spills."""
    flags = dict(encoder_urls="tcp://127.0.0.1:9", encoder_fallback="spill", dp_size=2)
    args = dataclasses.replace(served_args(checkpoint), **flags)
    tm = build_front_end(args, media=None).tm
    image = MultimodalDataItem(Modality.IMAGE, torch.zeros(4, 8), hash=7, grid_thw=(1, 2, 2))
    mm = MultimodalInputs([image], torch.zeros(3, 4, dtype=torch.long))
    req = TokenizedGenerateReq("r", [1, 2, 3, 4], SamplingParams(), mm_inputs=mm)
    text = TokenizedGenerateReq("t", [1, 2, 3, 4], SamplingParams())

    async def check() -> None:
        tm.encoders = pool = EncoderPool(args.encoder_url_list, None, 1.0, 0)
        items = tm.awaited_media(req)
        link = pool.links[0]
        assert not tm.spills(items, 0)  # the encoder server is idle: it takes the job
        link.pending[1] = asyncio.get_running_loop().create_future()
        assert tm.spills(items, 0) and not tm.spills(tm.awaited_media(text), 0)
        tm.states["a"] = ReqState(RequestTimeline(tm.metrics), replica=0, spilled=True)
        assert not tm.spills(items, 0)  # replica 0's tower encodes one spilled request already
        assert tm.spills(items, 1)
        tm.states["b"] = ReqState(RequestTimeline(tm.metrics), replica=1, started=True)
        assert not tm.spills(items, 1)  # replica 1 decodes a chat: the encode would stall it
        link.pending.clear()
        link.up = False  # the only server is down: the replica's tower at once, no job's timeout
        del tm.states["a"]
        assert pool.busy() and tm.spills(items, 0)
        assert pool.info()["spilled_requests"] == 3
        tm.args = dataclasses.replace(args, encoder_fallback="local")
        link.up, link.pending[1] = True, asyncio.get_running_loop().create_future()
        assert not tm.spills(items, 1)
        await pool.close()

    asyncio.run(check())
