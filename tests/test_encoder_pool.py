"""The front end's encoder pool against fake encoder servers: an item goes to the server its
digest ranks first; a hung or dead server's job goes to the next one within its deadline, and
the server is skipped until a health probe answers; no server: `EncoderUnavailable`; a refused
job: `EncoderRefused`; no shared-memory file the pool wrote is left behind."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from dist_utils import free_port
from encoder_servers import FakeEncoder
from waits import wait_until_async

from runtime.multimodal import Modality, MultimodalDataItem
from runtime.transport.shm import SHM_DIR, SharedTensor, new_media_path
from tokenizer_manager import encoder_pool
from tokenizer_manager.encoder_pool import (
    EncoderPool,
    EncoderRefused,
    EncoderUnavailable,
    rendezvous,
)

GRID = (1, 4, 4)


def my_files() -> set[str]:
    mine = f"tessera-media-{os.getpid()}-"
    return {n for n in os.listdir(SHM_DIR) if n.startswith(mine)}


def digest_preferring(first: str, other: str, start: int = 1) -> int:
    return next(d for d in range(start, 10_000) if rendezvous(d, first) > rendezvous(d, other))


def item(digest: int) -> MultimodalDataItem:
    pixels = SharedTensor.write(torch.randn(16, 1176).numpy(), new_media_path(SHM_DIR))
    owned = SharedTensor(pixels.path, pixels.shape, pixels.dtype)  # the request's, as in the TM
    return MultimodalDataItem(Modality.IMAGE, owned, hash=digest, grid_thw=GRID)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


def urls(ports: tuple[int, int]) -> list[str]:
    return [f"tcp://127.0.0.1:{p}" for p in ports]


def test_an_item_goes_where_its_digest_ranks_first(ports: tuple[int, int]) -> None:
    a, b = FakeEncoder(ports[0]), FakeEncoder(ports[1])
    before = my_files()

    async def go() -> None:
        pool = EncoderPool(urls(ports), None, 30, 1)
        try:
            for start in (1, 500):
                digest = digest_preferring(b.url, a.url, start)
                items = [item(digest), item(digest)]  # twice in one request: one job row
                await pool.embed(items)
                assert all(i.embedded and i.feature.shape == (4, 8) for i in items)
        finally:
            await pool.close()

    try:
        run(go())
        assert (a.jobs, b.jobs) == (0, 2)
        assert my_files() == before  # the links sent were removed; the items' own went too
    finally:
        a.close()
        b.close()


async def embed_preferring(
    ports: tuple[int, int], first: FakeEncoder, other: FakeEncoder, then=None
) -> tuple[MultimodalDataItem, dict]:
    """One item whose digest ranks `first` first, embedded by a pool with a 0.5 s deadline;
    `then()` is awaited before the pool closes. Returns the item and the pool's info."""
    pool = EncoderPool(urls(ports), None, 0.5, 1)
    try:
        target = item(digest_preferring(first.url, other.url))
        await pool.embed([target])
        if then is not None:
            await then()
        return target, pool.info()
    finally:
        await pool.close()


def test_a_hung_server_fails_over_within_its_deadline(ports: tuple[int, int]) -> None:
    hung, good = FakeEncoder(ports[0], "silent"), FakeEncoder(ports[1])
    before = my_files()
    try:
        target, info = run(embed_preferring(ports, hung, good))
        assert target.embedded
        first, second = info["servers"]
        assert first["up"] is False and first["failures"] == 1
        assert info["failovers"] == 1 and good.jobs == 1
        assert my_files() == before  # the link the hung server never read is gone
    finally:
        hung.close()
        good.close()


def test_a_late_answer_is_dropped_and_its_file_removed(ports: tuple[int, int]) -> None:
    """The first server answers after the job's deadline: the job has gone to the second; the
    late answer (large: a shared-memory file) is read and dropped."""
    late = FakeEncoder(ports[0], "late", row_dim=8192, delay_s=1.5)
    good = FakeEncoder(ports[1], row_dim=8192)
    before = my_files()

    async def late_answer_read() -> None:
        assert await wait_until_async(lambda: late.answers == 1, 30)  # it came, late
        assert await wait_until_async(lambda: my_files() == before, 30)

    try:
        target, _ = run(embed_preferring(ports, late, good, late_answer_read))
        assert target.embedded and float(target.feature.sum()) == 0  # the second's zeros
        assert late.jobs == 1 and good.jobs == 1
    finally:
        late.close()
        good.close()


def test_no_server_answers_and_a_restarted_one_is_used_again(ports: tuple[int, int]) -> None:
    """Nothing listens: EncoderUnavailable at once (no wait on a server that is not there);
    the server then starts: after a health probe it takes jobs again."""
    before = my_files()
    started: list[FakeEncoder] = []

    async def go() -> None:
        pool = EncoderPool(urls(ports)[:1], None, 5, 2)
        try:
            failed = item(3)
            with pytest.raises(EncoderUnavailable):
                await pool.embed([failed])
            assert pool.links[0].up is False and not failed.embedded
            failed.feature.release()  # the request's own pixels (it ended with its 503)
            started.append(FakeEncoder(ports[0]))

            def probed_up() -> bool:
                try:
                    pool.choose(3)  # while it is down, choosing sends a probe (at most 1/s)
                except EncoderUnavailable:
                    pass
                return pool.links[0].up

            await wait_until_async(probed_up, 30)
            assert pool.links[0].up
            target = item(3)
            await pool.embed([target])
            assert target.embedded
        finally:
            await pool.close()

    try:
        run(go())
        assert started[0].jobs == 1
        assert my_files() == before
    finally:
        for fake in started:
            fake.close()


def test_a_refused_job_is_that_jobs_error(ports: tuple[int, int]) -> None:
    fake = FakeEncoder(ports[0], "refuse")

    async def go() -> None:
        pool = EncoderPool(urls(ports)[:1], None, 5, 2)
        try:
            with pytest.raises(EncoderRefused, match="refused by the fake"):
                await pool.embed([item(9)])
            assert pool.links[0].up and pool.failovers == 0  # the server is fine
        finally:
            await pool.close()

    try:
        run(go())
    finally:
        fake.close()


def test_a_loaded_first_choice_yields_to_the_least_loaded(ports: tuple[int, int]) -> None:
    async def go() -> None:
        pool = EncoderPool(urls(ports), None, 5, 1)
        try:
            first, other = pool.links
            digest = digest_preferring(first.url, other.url)
            assert pool.choose(digest) is first
            loop = asyncio.get_running_loop()
            first.pending = {n: loop.create_future() for n in range(encoder_pool.LOAD_SLACK + 1)}
            assert pool.choose(digest) is other
        finally:
            await pool.close()

    run(go())
