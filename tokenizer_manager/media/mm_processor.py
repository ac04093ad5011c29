"""AsyncMMDataProcessor: the request side of media (budgets, deadlines, fetch), off the loop.

Three pools keep the asyncio loop free:
- a fetch thread pool for http(s) URLs (at most `fetches_per_request` of them per request, so a
  request of stalling URLs cannot take every thread), and an I/O thread pool for data: URLs and
  allowed local files; both read image headers, so most bad media are refused before any CPU work;
- a small pool of CPU worker processes (cpu_pool.WorkerPool, forked from a fork server that
  has imported their code) runs the worker side (`worker`: decode, resize, patchify,
  digest); the values both sides share live in `types` and `limits`.

Every item is fetched and header-checked before any is decoded: the images' tokens (the
checkpoint's resize rule over the header size) must fit what the context leaves, and the decoded
bytes of the request are reserved in a budget shared by all requests (`MemoryBudget`).

With `cache_bytes` > 0 (`--mm-processor-cache-gb`), items already processed come from a
`ProcessedCache` by their digest (the encoded bytes and the processor settings, hashed on the
loop): a resent image skips its worker and needs no decoded-bytes reservation. A data: URL whose
text was seen before is found by a digest of that text, before its base64 decode, header read
or thread hop (the same text is the same bytes).

Errors: a client's bad media raises `MediaError` (400, param image_url / video_url). When a
request's media take longer than `per_request_timeout`, the error is blamed on the client
(400, code "media_timeout") if one of its items was still being fetched, since a slow or stalled
URL is the usual cause; if everything was already fetched and the time went into waiting for or
running our CPU workers, it is a 503 with the same code. A job that runs past the job timeout, or
uses more than `MediaLimits.max_cpu_seconds` of CPU time (a decoder CPU bomb), has its worker
killed and replaced, and only its request fails (400, "media_processing_timeout"). A
worker that dies in a job is our own failure: it is replaced and a RuntimeError (a 500) is raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from runtime.logging_utils import get_logger
from runtime.multimodal import Modality, item_tokens
from runtime.server_args import ServerArgs
from runtime.transport.shm import (
    local_shm_dir,
    new_media_path,
    remove_file,
    sweep_media_files,
)
from tokenizer_manager.cpu_pool import JobTimeout, WorkerDied, WorkerPool
from tokenizer_manager.media.fetch import MediaFetcher
from tokenizer_manager.media.image_headers import INLINE_HEADER_PIECES, header_pieces
from tokenizer_manager.media.limits import MediaError, MediaLimits, media_param
from tokenizer_manager.media.load import load_media_bytes, open_image
from tokenizer_manager.media.multimodal_inputs import PreparedMedia, new_digest
from tokenizer_manager.media.processed_cache import ProcessedCache, cache_words
from tokenizer_manager.media.types import MediaFile, MediaRef, ProcessedMedia, ProcessorSpec
from tokenizer_manager.media.video_processor import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS
from tokenizer_manager.media.worker import (
    init_worker,
    media_digest,
    process_image_bytes,
    process_video_bytes,
)

logger = get_logger(__name__)

INLINE_DATA_URL_CHARS = 256 << 10  # data: URLs this small are decoded on the event loop (~0.1 ms)


def share_input(data: bytes, shm_dir: str | None) -> bytes | MediaFile:
    """The bytes in a new shared file (removed by the caller when the job has ended), or the
    bytes themselves without shared memory or when it is full."""
    if shm_dir is None:
        return data
    path = new_media_path(shm_dir)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with open(fd, "wb") as out:
            out.write(data)
    except OSError:
        remove_file(path)
        return data
    return MediaFile(path)


@dataclass
class _Fetched:
    """An item's bytes, fetched and (for images) header-checked; nothing decoded yet."""

    modality: Modality
    data: bytes
    tokens: int | None  # known from the header for images; None for videos
    decoded_bytes: int  # an upper estimate of the memory its decoding will take


@dataclass
class _RequestState:
    """Per-request bookkeeping: bytes fetched so far, items still fetching, the fetch cap."""

    max_bytes: int
    fetch_slots: asyncio.Semaphore
    spec: ProcessorSpec  # the server's, or the request's own (`settings.request_spec`)
    fetched_bytes: int = 0
    fetching: dict[int, Modality] = dataclasses.field(default_factory=dict)

    def add_bytes(self, count: int, modality: Modality) -> None:
        self.fetched_bytes += count
        if self.fetched_bytes > self.max_bytes:
            raise MediaError(
                f"the media of this request exceed {self.max_bytes} bytes in total",
                param=media_param(modality),
                code="media_too_large",
            )


class MemoryBudget:
    """Bytes of decoded media in flight across all requests; a request waits for its share.

    A request larger than the whole budget is let in alone (when nothing else is in flight).
    """

    def __init__(self, limit: int, max_wait: float):
        self.limit, self.max_wait = limit, max_wait
        self.in_flight = 0
        self._changed = asyncio.Condition()

    async def acquire(self, amount: int) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._fits(amount)), self.max_wait
                )
            except asyncio.TimeoutError:
                raise MediaError(
                    "the server is busy decoding other media; try again shortly",
                    status=503,
                    param="messages",
                    code="media_busy",
                ) from None
            self.in_flight += amount

    def _fits(self, amount: int) -> bool:
        return self.in_flight == 0 or self.in_flight + amount <= self.limit

    async def release(self, amount: int) -> None:
        async with self._changed:
            self.in_flight -= amount
            self._changed.notify_all()


class InFlight:
    """Items some request is decoding now, by digest: a request that misses the cache on one of
    them waits for that decode and copies its result from the cache, instead of decoding the
    same bytes again (a wave of chats that all send one new image decodes it once)."""

    def __init__(self) -> None:
        self._decoding: dict[int, asyncio.Event] = {}
        self.shared = 0  # items a request took from another's decode

    def split(
        self, misses: list[int], digests: dict[int, int | None]
    ) -> tuple[list[int], list[int]]:
        """(the misses this request decodes, now marked in flight; those it waits for)."""
        leads, follows = [], []
        for i in misses:
            digest = digests[i]
            if digest is not None and digest in self._decoding:
                follows.append(i)
                continue
            if digest is not None:
                self._decoding[digest] = asyncio.Event()
            leads.append(i)
        return leads, follows

    async def wait(self, digest: int) -> None:
        event = self._decoding.get(digest)
        if event is not None:
            await event.wait()

    def finish(self, digests: Iterable[int | None]) -> None:
        """The decodes of `digests` ended (done, failed or cancelled): their waiters go on."""
        for digest in digests:
            event = None if digest is None else self._decoding.pop(digest, None)
            if event is not None:
                event.set()


class AsyncMMDataProcessor:
    """Turns a request's media references into `PreparedMedia`, in order, off the event loop.

    Network fetches run in their own thread pool, at most `fetches_per_request` at a time per
    request, so URLs that stall cannot hold up data: URLs or local files. Every item is fetched
    and its header read before any is decoded: the images' token count is then checked against
    the request's budget, and the decoded bytes are reserved in a budget shared by all requests.
    """

    def __init__(
        self,
        model_path: str,
        limits: MediaLimits,
        *,
        io_workers: int = 8,
        net_workers: int = 16,
        fetches_per_request: int = 4,
        cpu_workers: int = 1,
        max_concurrent_calls: int = 32,
        per_request_timeout: float = 30.0,
        job_timeout: float | None = None,
        max_inflight_bytes: int = 4 << 30,
        video_min_pixels: int = VIDEO_MIN_PIXELS,
        video_max_pixels: int = VIDEO_MAX_PIXELS,
        shm_dir: str | None = None,
        cache_bytes: int = 0,
    ):
        self.limits = limits
        # workers write pixels there (see runtime/transport/shm.py: SharedTensor); None: inline
        self.shm_dir = shm_dir
        if sweep_media_files(shm_dir):
            logger.info("removed media files that stopped servers left in %s", shm_dir)
        self.spec = ProcessorSpec.from_checkpoint(
            model_path, limits, video_min_pixels=video_min_pixels, video_max_pixels=video_max_pixels
        )
        self.cpu_workers = cpu_workers
        self.per_request_timeout = per_request_timeout
        self.fetches_per_request = fetches_per_request
        self._io = ThreadPoolExecutor(io_workers, thread_name_prefix="tessera-media-io")
        self._net = ThreadPoolExecutor(net_workers, thread_name_prefix="tessera-media-net")
        self._cpu = WorkerPool(
            cpu_workers,
            job_timeout=job_timeout or per_request_timeout,
            cpu_seconds=limits.max_cpu_seconds,
            initializer=init_worker,
            initargs=(self.spec.model_path,),
        )
        self._fetcher = MediaFetcher(limits.url_policy, limits.http_timeout)
        self._slots = asyncio.Semaphore(max_concurrent_calls)
        self._memory = MemoryBudget(max_inflight_bytes, max_wait=per_request_timeout / 2)
        self._closed = False
        # processed items by digest; None: every item goes to a worker
        self.cache = ProcessedCache(cache_bytes, shm_dir) if cache_bytes > 0 else None
        self._in_flight = InFlight()  # items being decoded, by digest, for requests that miss
        logger.info(
            "media: %d I/O threads, %d fetch threads (%d per request), %d CPU worker processes, "
            "%s",
            io_workers,
            net_workers,
            fetches_per_request,
            cpu_workers,
            cache_words(self.cache),
        )

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> AsyncMMDataProcessor:
        """The front end's media processor, from resolved flags (`build_front_end` builds it)."""
        if not isinstance(args.media_workers, int):
            raise ValueError("--media-workers auto is resolved by ServerArgs.resolve()")
        return cls(
            args.model_path,
            MediaLimits.from_server_args(args),
            io_workers=8,
            cpu_workers=args.media_workers,
            max_concurrent_calls=args.mm_max_concurrent_calls,
            per_request_timeout=args.mm_per_request_timeout,
            fetches_per_request=args.mm_max_fetches_per_request,
            max_inflight_bytes=args.mm_max_inflight_mb << 20,
            shm_dir=local_shm_dir(args.nnodes),
            cache_bytes=int(args.mm_processor_cache_gb * (1 << 30)),
        )

    # ------------------------------------------------------------------ lifecycle
    async def warmup(self) -> None:
        """Wait until every CPU worker has started (and built its processor)."""
        if not await asyncio.to_thread(self._cpu.wait_ready):
            raise RuntimeError("the media worker processes did not start")

    def info(self) -> dict[str, object]:
        """For /server_info: the processed-item cache's size and counters (None when off)."""
        cache = None if self.cache is None else self.cache.info()
        return {"processed_cache": cache, "waited_for_other_requests": self._in_flight.shared}

    def worker_pids(self) -> list[int]:
        return self._cpu.pids()

    async def close(self) -> None:
        """Stop the pools; a busy worker gets a few seconds, then is killed."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Blocking form of close(), for callers without an event loop."""
        self._closed = True
        self._cpu.shutdown()
        self._io.shutdown(wait=False, cancel_futures=True)
        self._net.shutdown(wait=False, cancel_futures=True)
        self._fetcher.close()
        if self.cache is not None:
            self.cache.clear()
        sweep_media_files(self.shm_dir, os.getpid())

    async def __aenter__(self) -> AsyncMMDataProcessor:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ processing
    async def process(
        self,
        parts: list[MediaRef],
        max_image_tokens: int | None = None,
        spec: ProcessorSpec | None = None,
    ) -> list[PreparedMedia]:
        """Fetch and preprocess every part; results keep the order of `parts`. `spec` is the
        request's own processor settings (the server's by default): it sizes, digests and so
        keys in the cache every item of the request.

        `max_image_tokens` bounds the images' tokens together (what the context has left); it is
        checked from the headers, before any image is decoded. Raises the first MediaError (in
        item order among the items that failed before the rest were cancelled), or MediaError
        with code "media_timeout" after `per_request_timeout`.
        """
        if self._closed:
            raise RuntimeError("the media processor is closed")
        if not parts:
            return []
        state = _RequestState(
            self.limits.max_request_bytes,
            asyncio.Semaphore(self.fetches_per_request),
            spec or self.spec,
        )
        known = [self._by_id(ref, state.spec) or self._by_data_url(ref, state) for ref in parts]
        if all(result is not None for result in known):  # a resent turn: no fetch, no decode
            tokens = sum(self._image_tokens(result) for result in known)
            check_image_tokens([], max_image_tokens, tokens)
            return self._finish(parts, known, [], state.spec)
        work = self._process_all(parts, known, state, max_image_tokens)
        try:
            return await asyncio.wait_for(work, self.per_request_timeout)
        except asyncio.TimeoutError:
            raise self._timeout_error(state) from None

    def _timeout_error(self, state: _RequestState) -> MediaError:
        seconds = self.per_request_timeout
        if state.fetching:
            modality = state.fetching[min(state.fetching)]
            message = f"fetching this request's media took longer than {seconds:g} s"
            return MediaError(message, param=media_param(modality), code="media_timeout")
        message = f"the server could not preprocess this request's media within {seconds:g} s"
        return MediaError(message, status=503, param="messages", code="media_timeout")

    async def _process_all(
        self,
        parts: list[MediaRef],
        results: list[ProcessedMedia | None],
        state: _RequestState,
        max_image_tokens: int | None,
    ) -> list[PreparedMedia]:
        """`results` holds the items known by id or data: URL text (None: to fetch)."""
        todo = [i for i, result in enumerate(results) if result is None]
        fetches = [self._fetch_one(i, parts[i], state) for i in todo]
        fetched = dict(zip(todo, await _all_or_first_error(fetches)))
        known = sum(self._image_tokens(result) for result in results if result is not None)
        check_image_tokens(list(fetched.values()), max_image_tokens, known)
        digests = {i: self._digest(item, state.spec) for i, item in fetched.items()}
        for i, digest in digests.items():
            results[i] = self._cached(digest)
        misses = [i for i in todo if results[i] is None]
        leads, follows = self._in_flight.split(misses, digests)
        try:
            jobs = [
                self._lead(leads, fetched, digests, state.spec),
                *(self._follow(fetched[i], digests[i], state.spec) for i in follows),
            ]
            decoded, *followed = await _all_or_first_error(jobs)
        finally:  # also when the leading job was cancelled before it started
            self._in_flight.finish(digests[i] for i in leads)
        for i, result in zip([*leads, *follows], [*decoded, *followed]):
            results[i] = result
        return self._finish(parts, results, todo, state.spec)

    def _finish(
        self, parts: list[MediaRef], results: list[Any], fetched: list[int], spec: ProcessorSpec
    ) -> list[PreparedMedia]:
        """Remember the request's ids and its fetched data: URLs; the items to send."""
        for ref, result in zip(parts, results):  # an id first given with a known item too
            self._remember_id(ref, result, spec)
        for i in fetched:
            self._remember_data_url(parts[i], results[i], spec)
        return [result.to_prepared() for result in results]

    def _digest(self, item: _Fetched, spec: ProcessorSpec) -> int | None:
        """The item's key in the processed-item cache; None without the cache."""
        return None if self.cache is None else media_digest(item.modality, item.data, spec)

    def _cached(self, digest: int | None) -> ProcessedMedia | None:
        """The item from the processed-item cache (a copy this request owns), or None."""
        return None if self.cache is None or digest is None else self.cache.get(digest)

    async def _lead(
        self,
        leads: list[int],
        fetched: dict[int, _Fetched],
        digests: dict[int, int | None],
        spec: ProcessorSpec,
    ) -> list[ProcessedMedia]:
        """Decode the items this request leads; whoever waits for them goes on once they are
        cached (or failed)."""
        try:
            return await self._decode_all(leads, fetched, spec)
        finally:
            self._in_flight.finish(digests[i] for i in leads)

    async def _decode_all(
        self, misses: list[int], fetched: dict[int, _Fetched], spec: ProcessorSpec
    ) -> list[ProcessedMedia]:
        """Decode the misses in the workers (their decoded bytes reserved together) and put
        each result in the cache."""
        reserved = sum(fetched[i].decoded_bytes for i in misses)
        await self._memory.acquire(reserved)
        try:
            jobs = [self._decode_one(fetched[i], spec) for i in misses]
            decoded = await _all_or_first_error(jobs)
        finally:
            await self._memory.release(reserved)
        if self.cache is not None:
            for result in decoded:
                self.cache.put(result)
        return decoded

    async def _follow(self, item: _Fetched, digest: int, spec: ProcessorSpec) -> ProcessedMedia:
        """An item another request (or an earlier part of this one) is decoding: wait for it,
        then take a copy from the cache; decode it here if that did not leave it cached (the
        other failed or was cancelled, or the cache could not keep it)."""
        await self._in_flight.wait(digest)
        found = self._cached(digest)
        if found is not None:
            self._in_flight.shared += 1
            return found
        (result,) = await self._decode_all([0], {0: item}, spec)
        return result

    def _by_id(self, ref: MediaRef, spec: ProcessorSpec) -> ProcessedMedia | None:
        """The item the client's id names (nothing fetched), or None to fetch it; an unknown id
        without media is the client's error."""
        if ref.uuid is None:
            return None
        found = None if self.cache is None else self.cache.get_by_id(_media_id(ref, spec))
        if found is None and not ref.url:
            raise MediaError(
                f"media uuid {ref.uuid!r} is not known to this server: send the "
                f"{ref.modality.value} with it",
                param="uuid",
                code="unknown_media_uuid",
            )
        return found

    def _by_data_url(self, ref: MediaRef, state: _RequestState) -> ProcessedMedia | None:
        """A data: URL whose text was processed before (so the same bytes): the cached item,
        without its base64 decode, header read or thread hop; None otherwise."""
        if self.cache is None or not _is_data_url(ref.url):
            return None
        found = self.cache.get_by_id(_data_url_id(ref, state.spec))
        if found is not None:
            state.add_bytes(len(ref.url) * 3 // 4, ref.modality)  # about its decoded size
        return found

    def _remember_id(self, ref: MediaRef, result: ProcessedMedia, spec: ProcessorSpec) -> None:
        if ref.uuid is not None and self.cache is not None and result.digest:
            self.cache.remember(_media_id(ref, spec), result.digest)

    def _remember_data_url(
        self, ref: MediaRef, result: ProcessedMedia, spec: ProcessorSpec
    ) -> None:
        if _is_data_url(ref.url) and self.cache is not None and result.digest:
            self.cache.remember(_data_url_id(ref, spec), result.digest)

    def _image_tokens(self, item: ProcessedMedia) -> int:
        if item.modality != Modality.IMAGE:
            return 0
        return item_tokens(item.grid_thw, self.spec.image.merge_size)

    async def _fetch_one(self, index: int, ref: MediaRef, state: _RequestState) -> _Fetched:
        remote = _is_remote(ref.url)
        # A URL waits for its request's fetch slot only: stalled URLs never hold the shared
        # slots that data: URLs and decoding need.
        async with state.fetch_slots if remote else self._slots:
            state.fetching[index] = ref.modality
            if _decodes_quickly(ref.url):  # two thread hops cost more than the work
                fetched = await self._fetch_small(ref, state.spec)
            else:
                pool = self._net if remote else self._io
                fetched = await self._run(pool, self._fetch, ref, state.spec)
            del state.fetching[index]
        state.add_bytes(len(fetched.data), ref.modality)
        return fetched

    async def _fetch_small(self, ref: MediaRef, spec: ProcessorSpec) -> _Fetched:
        """A small data: URL, decoded on the event loop; its image header is read there too
        when PIL walks few pieces of it (image_headers.py), else in an I/O thread."""
        data = self._load(ref)
        pieces = header_pieces(data, INLINE_HEADER_PIECES) if ref.modality == Modality.IMAGE else 0
        if pieces > INLINE_HEADER_PIECES:
            return await self._run(self._io, self._fetch, ref, spec, data)
        return self._fetch(ref, spec, data)

    def _load(self, ref: MediaRef) -> bytes:
        return load_media_bytes(ref.url, self.limits, modality=ref.modality, fetcher=self._fetcher)

    def _fetch(self, ref: MediaRef, spec: ProcessorSpec, data: bytes | None = None) -> _Fetched:
        """I/O thread: the bytes (unless given), plus a header read for images (no pixels
        decoded yet)."""
        data = self._load(ref) if data is None else data
        if ref.modality == Modality.VIDEO:
            return _Fetched(ref.modality, data, None, spec.video_bytes_bound())
        with open_image(data, self.limits) as image:
            width, height = image.size
        return _Fetched(ref.modality, data, *spec.image_cost(height, width))

    async def _decode_one(self, item: _Fetched, spec: ProcessorSpec) -> ProcessedMedia:
        work = process_image_bytes if item.modality == Modality.IMAGE else process_video_bytes
        async with self._slots:
            path = new_media_path(self.shm_dir) if self.shm_dir else None
            source = share_input(item.data, self.shm_dir)
            future = self._cpu.submit(work, source, spec, self.limits, path)
            done = False
            try:
                result = await asyncio.wrap_future(future)
                done = True
                return result
            except JobTimeout as exc:  # wall clock or CPU time (CpuTimeExceeded)
                raise MediaError(
                    f"preprocessing this {item.modality.value} {exc} and was stopped",
                    param=media_param(item.modality),
                    code="media_processing_timeout",
                ) from None
            except WorkerDied as exc:
                raise RuntimeError("a media worker process died while preprocessing") from exc
            finally:
                if isinstance(source, MediaFile):
                    remove_file(source.path)
                if path and not done:  # no result owns the file: remove what may be there
                    remove_file(path)

    @staticmethod
    async def _run(pool: Executor, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _decodes_quickly(url: str) -> bool:
    """A data: URL small enough to decode on the event loop (pybase64: about 1 ms per 3 MB)
    and read the image header of there; a larger one goes to a thread (invariant 18)."""
    return len(url) <= INLINE_DATA_URL_CHARS and _is_data_url(url)


def _is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def _is_remote(url: str) -> bool:
    return url.lstrip()[:8].lower().startswith(("http://", "https://"))


async def _all_or_first_error(jobs: list[Any]) -> list[Any]:
    """Run the coroutines concurrently; on the first error cancel the rest and raise it."""
    if not jobs:
        return []
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    failed = [t for t in tasks if not t.cancelled() and t.exception() is not None]
    if failed:
        raise failed[0].exception()
    return [task.result() for task in tasks]


def _media_id(ref: MediaRef, spec: ProcessorSpec) -> tuple[str, str, str]:
    """A client's id within its scope and the processor settings: an id names an item as
    processed with one set of settings, never for another."""
    settings = media_digest(ref.modality, b"", spec)
    return (ref.scope, f"{ref.modality.value}|{settings:x}", ref.uuid or "")


DATA_URL_SCOPE = "\0data-url"  # no client's scope ("" or a key digest) can equal it


def _data_url_id(ref: MediaRef, spec: ProcessorSpec) -> tuple[str, str, str]:
    """A data: URL's own id: XXH3-128 of its text (the same text is the same bytes) with the
    processor settings, in a scope of its own."""
    settings = media_digest(ref.modality, b"", spec)
    text = new_digest()
    text.update(ref.url.encode("utf-8", "surrogatepass"))
    return (DATA_URL_SCOPE, f"{ref.modality.value}|{settings:x}", text.hexdigest())


def check_image_tokens(fetched: list[_Fetched], limit: int | None, known: int = 0) -> None:
    """Refuse before decoding when the images' tokens (from their headers, plus `known` tokens
    of images taken by id) exceed `limit` (invariants 7 and 14)."""
    tokens = known + sum(item.tokens or 0 for item in fetched)
    if limit is not None and tokens > limit:
        raise MediaError(
            f"the images of this request take {tokens} tokens; only {max(0, limit)} fit in the "
            "context with the prompt",
            param="messages",
            code="context_length_exceeded",
        )
