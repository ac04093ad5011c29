"""The processed-item cache: a resent image skips its worker and gets the miss's pixels; the cache
stays within its byte bound; no shared-memory file outlives its owner."""

from __future__ import annotations

import asyncio
import gc
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_mm_processor import _error_of, data_url, hf_image, mp4_bytes, noise_image, png_bytes

from runtime.multimodal import Modality
from runtime.tiny_checkpoint import make_checkpoint
from runtime.transport.frames import from_frames, to_frames
from runtime.transport.shm import SharedTensor
from tokenizer_manager.media.limits import MediaError, MediaLimits
from tokenizer_manager.media.mm_processor import AsyncMMDataProcessor
from tokenizer_manager.media.multimodal_inputs import PreparedMedia
from tokenizer_manager.media.processed_cache import ProcessedCache, cache_words
from tokenizer_manager.media.types import MediaRef, ProcessedMedia

IMAGE, VIDEO = Modality.IMAGE, Modality.VIDEO
ITEM_BYTES = 4 * 1000  # the items of the bound test: 1000 float32 each


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("tiny-qwen2-vl")))


def image_ref(seed: int, size: tuple[int, int] = (70, 50)) -> MediaRef:
    return MediaRef(IMAGE, data_url(png_bytes(noise_image(size, seed)), "image/png"))


def received(out: list[PreparedMedia]) -> list[PreparedMedia]:
    """What the scheduler ranks receive; the request's files go with it (removed on receipt)."""
    shared: list[SharedTensor] = []
    back = from_frames(to_frames(out, shared))
    for handle in shared:
        handle.hand_off()
    return back


def media_files(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("tessera-media-"))


def refuse_jobs(*args: object, **kwargs: object) -> None:
    raise AssertionError("a cached item went to a media worker")


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "inline"])
def test_a_hit_returns_the_miss_without_a_worker(
    checkpoint: str, tmp_path: Path, shared: bool
) -> None:
    """The second request for the same image and video is served from the cache, with the same
    pixels, grid, frame times and digest as the first (HF's processor as the oracle)."""
    refs = [image_ref(1), MediaRef(VIDEO, data_url(mp4_bytes(), "video/mp4"))]
    shm_dir = str(tmp_path) if shared else None

    async def run() -> tuple[list, list, dict, list[str], list[str]]:
        async with AsyncMMDataProcessor(
            checkpoint, MediaLimits(), shm_dir=shm_dir, cache_bytes=64 << 20
        ) as mm:
            await mm.warmup()
            first = received(await mm.process(refs))
            mm._cpu.submit = refuse_jobs  # every item must now come from the cache
            out = await mm.process(refs)
            kinds = [type(m.pixel_values).__name__ for m in out]
            second = received(out)
            del out
            gc.collect()
            held = media_files(tmp_path)
            return first, second, mm.cache.info(), kinds, held

    first, second, info, kinds, held = asyncio.run(run())
    np.testing.assert_array_equal(
        first[0].pixel_values.numpy(), hf_image(checkpoint, noise_image((70, 50), 1))[0]
    )
    for miss, hit in zip(first, second):
        np.testing.assert_array_equal(hit.pixel_values.numpy(), miss.pixel_values.numpy())
        assert (hit.grid_thw, hit.digest, hit.frame_times) == (
            miss.grid_thw,
            miss.digest,
            miss.frame_times,
        )
        assert hit.second_per_grid_t == miss.second_per_grid_t
    assert info["hits"] == 2 and info["misses"] == 2 and info["items"] == 2
    assert kinds == ["SharedTensor" if shared else "Tensor"] * 2
    assert len(held) == (2 if shared else 0)  # the cache's own copies, not the requests'
    assert media_files(tmp_path) == []  # close() removed them


def refuse_fetch(*args: object, **kwargs: object) -> None:
    raise AssertionError("a data: URL seen before was decoded again")


def test_a_resent_data_url_is_not_decoded_again(checkpoint: str, tmp_path: Path) -> None:
    """The same data: URL text is the same bytes: its item comes from the cache without a base64
    decode or header read; other text for the same bytes is decoded, then found by its digest.
    Its bytes still count against the request's budget."""
    ref = image_ref(3)
    spelled = MediaRef(IMAGE, ref.url.replace("data:image/png", "data:image/PNG", 1))

    async def run() -> tuple[list, list, dict, MediaError]:
        limits = MediaLimits(max_request_bytes=len(ref.url))
        async with AsyncMMDataProcessor(
            checkpoint, limits, shm_dir=str(tmp_path), cache_bytes=64 << 20
        ) as mm:
            first = received(await mm.process([ref]))
            again = received(await mm.process([spelled]))  # decoded: its text is new
            mm._fetch = refuse_fetch
            mm._cpu.submit = refuse_jobs
            second = received(await mm.process([ref]))
            third = received(await mm.process([spelled]))
            info = mm.cache.info()
            over = await _error_of(mm.process([ref, ref]))
            return first, [*again, *second, *third], info, over

    first, later, info, over = asyncio.run(run())
    for hit in later:
        np.testing.assert_array_equal(hit.pixel_values.numpy(), first[0].pixel_values.numpy())
        assert hit.digest == first[0].digest
    assert (info["misses"], info["hits"], info["items"]) == (1, 3, 1)
    assert over.code == "media_too_large"


def test_a_resent_turn_never_waits_on_the_event_loop(checkpoint: str, tmp_path: Path) -> None:
    """A request whose images are all known (by data: URL text or by id) gets its items in one
    step of its coroutine: no task, no wait, so four such requests at once never queue behind
    each other's loop turns (the task and waits cost a resent turn about 3 ms of wall time at 4
    at a time). The image-token budget is still checked."""
    ref = image_ref(5)

    async def run() -> tuple[list, list, MediaError]:
        async with AsyncMMDataProcessor(
            checkpoint, MediaLimits(), shm_dir=str(tmp_path), cache_bytes=64 << 20
        ) as mm:
            first = received(await mm.process([ref]))
            step = mm.process([ref, ref])
            try:
                step.send(None)
            except StopIteration as done:  # finished without suspending once
                again = received(done.value)
            else:
                step.close()
                raise AssertionError("a request of known items waited on the loop")
            over = await _error_of(mm.process([ref], max_image_tokens=1))
            return first, again, over

    first, again, over = asyncio.run(run())
    for hit in again:
        np.testing.assert_array_equal(hit.pixel_values.numpy(), first[0].pixel_values.numpy())
    assert over.code == "context_length_exceeded"


def test_a_different_image_misses(checkpoint: str, tmp_path: Path) -> None:
    async def run() -> dict:
        async with AsyncMMDataProcessor(
            checkpoint, MediaLimits(), shm_dir=str(tmp_path), cache_bytes=64 << 20
        ) as mm:
            received(await mm.process([image_ref(1)]))
            received(await mm.process([image_ref(2)]))
            return mm.cache.info()

    info = asyncio.run(run())
    assert info["hits"] == 0 and info["items"] == 2


def shared_item(folder: Path, digest: int, value: float) -> ProcessedMedia:
    """A worker's result as the parent holds it: an owned file of ITEM_BYTES."""
    path = str(folder / f"tessera-media-{os.getpid()}-test{digest:08x}")
    written = SharedTensor.write(np.full((10, 100), value, np.float32), path)
    handle = SharedTensor(written.path, written.shape, written.dtype)
    return ProcessedMedia(IMAGE, handle, (1, 2, 5), digest=digest)


def no_links(src: str, dst: str) -> None:
    raise OSError("hard links are not supported here")


@pytest.mark.parametrize("links", [True, False], ids=["linked", "copied"])
def test_the_cache_stays_within_its_byte_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: bool
) -> None:
    """A stream of distinct items: the cached files never take more than the bound, the least
    recently used go first, and clear() removes every file (the cache's files are links to the
    requests' ones, or copies where links fail)."""
    if not links:
        monkeypatch.setattr(os, "link", no_links)
    cache = ProcessedCache(int(2.5 * ITEM_BYTES), str(tmp_path))
    for digest in range(1, 12):
        item = shared_item(tmp_path, digest, float(digest))
        cache.put(item)
        item.pixel_values.release()  # the request's own file goes with the request
        if digest == 6:
            assert cache.get(5) is not None  # 5 is now the most recently used
        files = media_files(tmp_path)
        assert sum(os.path.getsize(tmp_path / name) for name in files) == cache.nbytes
        assert cache.nbytes <= cache.max_bytes and len(files) == len(cache) <= 2
    assert cache.get(5) is None and cache.get(10) is not None
    hit = cache.get(11)
    assert hit is not None and float(hit.pixel_values.load()[0, 0]) == 11.0
    assert cache.info()["evictions"] == 9
    assert cache.get(1) is None
    too_big = ProcessedMedia(IMAGE, np.zeros(ITEM_BYTES, np.float32), (1, 2, 5), digest=99)
    cache.put(too_big)
    assert cache.get(99) is None
    cache.clear()
    del hit
    gc.collect()
    assert media_files(tmp_path) == [] and cache.nbytes == 0


def test_the_bound_leaves_three_quarters_of_shared_memory(tmp_path: Path) -> None:
    fs = os.statvfs(tmp_path)
    cache = ProcessedCache(1 << 62, str(tmp_path))
    assert cache.max_bytes == fs.f_blocks * fs.f_frsize // 4
    assert ProcessedCache(1 << 20, None).max_bytes == 1 << 20


def test_client_ids_name_the_first_item_within_their_scope(checkpoint: str) -> None:
    """An id serves the item first sent with it (even when other bytes come with it later: the
    id is the client's promise), without its media; another scope's id never matches."""
    first, other = image_ref(1), image_ref(2)

    def named(ref: MediaRef, scope: str = "alice", url: str | None = None) -> MediaRef:
        return MediaRef(ref.modality, ref.url if url is None else url, "photo-1", scope)

    async def run() -> tuple[list, list, list, MediaError, MediaError]:
        async with AsyncMMDataProcessor(checkpoint, MediaLimits(), cache_bytes=64 << 20) as mm:
            sent = await mm.process([named(first)])
            plain = await mm.process([other])  # the other image by content, for comparison
            submit, mm._cpu.submit = mm._cpu.submit, refuse_jobs
            by_id = await mm.process([named(first, url=""), named(other)])
            mm._cpu.submit = submit
            tenant = await mm.process([named(other, scope="bob")])
            tenant += await mm.process([named(first, scope="bob", url="")])
            unknown = await _error_of(mm.process([named(first, scope="carol", url="")]))
        async with AsyncMMDataProcessor(checkpoint, MediaLimits(), cache_bytes=0) as off:
            no_cache = await _error_of(off.process([named(first, url="")]))
        return sent + plain, by_id, tenant, unknown, no_cache

    (sent, plain), by_id, tenant, unknown, no_cache = asyncio.run(run())
    for got in by_id:  # by id alone, and by id with other bytes: the first item both times
        np.testing.assert_array_equal(got.pixel_values.numpy(), sent.pixel_values.numpy())
        assert got.digest == sent.digest
    for got in tenant:  # bob's "photo-1" is bob's image, sent or not
        np.testing.assert_array_equal(got.pixel_values.numpy(), plain.pixel_values.numpy())
        assert got.digest == plain.digest != sent.digest
    for error in (unknown, no_cache):
        assert (error.status, error.param, error.code) == (400, "uuid", "unknown_media_uuid")
        assert "photo-1" in error.message


def test_concurrent_misses_on_one_image_decode_it_once(checkpoint: str, tmp_path: Path) -> None:
    """A wave of requests that all send one new image (and a request that sends it twice): one
    worker job for it, every request gets the same pixels, and no file outlives its owner."""
    jobs: list[object] = []

    async def run() -> tuple[list[list[PreparedMedia]], dict]:
        async with AsyncMMDataProcessor(
            checkpoint, MediaLimits(), shm_dir=str(tmp_path), cache_bytes=64 << 20
        ) as mm:
            await mm.warmup()
            submit = mm._cpu.submit

            def counted(*args: object) -> object:
                jobs.append(args[0])
                return submit(*args)

            mm._cpu.submit = counted
            wave = [[image_ref(7)] for _ in range(6)] + [[image_ref(7), image_ref(7)]]
            outs = await asyncio.gather(*(mm.process(refs) for refs in wave))
            return [received(out) for out in outs], mm.info()

    outs, info = asyncio.run(run())
    assert len(jobs) == 1
    first = outs[0][0]
    for out in outs:
        for item in out:
            np.testing.assert_array_equal(item.pixel_values.numpy(), first.pixel_values.numpy())
            assert item.digest == first.digest
    # Each of the 7 others waited for that decode, or (on a slow machine, arriving after it
    # ended) found the item cached: never a second decode.
    assert 1 <= info["waited_for_other_requests"] <= 7
    assert media_files(tmp_path) == []


def test_a_cancelled_decode_lets_its_waiters_decode(checkpoint: str, tmp_path: Path) -> None:
    """The request that decodes an image goes away (a client hang-up) while others wait for
    it: they decode it themselves and get it."""

    async def run() -> tuple[list[PreparedMedia], dict]:
        async with AsyncMMDataProcessor(
            checkpoint, MediaLimits(), shm_dir=str(tmp_path), cache_bytes=64 << 20
        ) as mm:
            await mm.warmup()
            decode = mm._decode_one
            calls: list[int] = []

            async def first_never_ends(*args: Any) -> Any:
                calls.append(1)
                if len(calls) == 1:  # the leader's decode is still running when it is cancelled
                    await asyncio.Event().wait()
                return await decode(*args)

            mm._decode_one = first_never_ends
            leader = asyncio.ensure_future(mm.process([image_ref(8)]))
            while not calls:  # the leader is decoding it
                await asyncio.sleep(0.001)
            waiter = asyncio.ensure_future(mm.process([image_ref(8)]))
            await asyncio.sleep(0.05)  # the waiter waits for the leader
            leader.cancel()
            return received(await waiter), mm.info()

    (item,), info = asyncio.run(run())
    assert item.grid_thw is not None
    assert info["waited_for_other_requests"] == 0  # nothing came from the leader (it never ended)
    assert info["processed_cache"]["items"] == 1  # the waiter decoded and cached it
    assert media_files(tmp_path) == []


def test_the_start_up_log_names_an_empty_cache_by_its_bound() -> None:
    """An empty cache is falsy (`len` 0): the log said "0 MiB" for the default 1 GiB."""
    assert cache_words(ProcessedCache(1 << 30, None)) == "processed-item cache of 1024 MiB"
    assert cache_words(None) == "no processed-item cache"
