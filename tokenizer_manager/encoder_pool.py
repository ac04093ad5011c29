"""The front end's pool of encoder servers (`--encoder-urls`): a request's images and videos are
encoded there before the request goes to a replica, which then never runs its own tower.

`EncoderPool.embed` sends the items (already preprocessed, with their digests) as jobs and
replaces each item's pixels with its embedding rows (`item.embedded`). An item goes to the
encoder server its digest ranks first (rendezvous hashing over the servers that are up: a
repeated image finds its cached embedding, from every replica and every LLM server using the
pool), unless that server has `LOAD_SLACK` more jobs in flight than the least loaded one, which
then takes it. A job that gets no answer within --encoder-timeout, or whose server is gone,
goes to the next server (at most --encoder-retries more); a server that failed is skipped
until a health probe answers (every `PROBE_S` at most), so a restarted server is used again.
When no server answers, `EncoderUnavailable` (the request's 503, or the local tower with
--encoder-fallback local); a job the server refuses is `EncoderRefused` (that request's error).
Every wait has a deadline; shared-memory files sent with a job are removed when it ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import zmq
import zmq.asyncio

from runtime.logging_utils import get_logger
from runtime.multimodal import MultimodalDataItem
from runtime.transport.encoder_wire import Channel, Header, WireError, client_channel, endpoint
from runtime.transport.shm import SharedTensor, link_copy, remove_file

logger = get_logger(__name__)

LOAD_SLACK = 4  # jobs in flight beyond the least loaded server's before the digest's choice yields
PROBE_S = 1.0  # a down server is probed at most this often
PROBE_TIMEOUT_S = 5.0  # a health probe's answer
CONNECT_MS = 1000  # how long a job waits for a server's connection before it goes elsewhere


class EncoderUnavailable(RuntimeError):
    """No encoder server answered the job (each tried, or none up)."""


class EncoderRefused(RuntimeError):
    """An encoder server refused the job: its message says why."""


@dataclass(eq=False)
class EncoderServerLink:
    """One encoder server: its socket, the jobs awaiting answers, whether it is up."""

    url: str
    channel: Channel
    sock: zmq.asyncio.Socket
    index: int
    up: bool = True
    probed: float = 0.0
    jobs_sent: int = 0
    failures: int = 0
    pending: dict[int, asyncio.Future] = field(default_factory=dict)

    def info(self) -> dict[str, object]:
        return {
            "url": self.url, "up": self.up, "in_flight": len(self.pending),
            "jobs_sent": self.jobs_sent, "failures": self.failures,
        }  # fmt: skip


class EncoderPool:
    """Encoder servers shared by every replica of this front end (see the module doc)."""

    def __init__(self, urls: Sequence[str], key: bytes | None, timeout_s: float, retries: int):
        if not urls:
            raise ValueError("an encoder pool needs at least one --encoder-urls entry")
        self.key, self.timeout_s, self.retries = key, timeout_s, retries
        self.ctx = zmq.asyncio.Context()
        self.links = [self._connect(url, i) for i, url in enumerate(urls)]
        self.items_sent = 0
        self.failovers = 0
        self.spilled = 0  # requests a replica's own tower encoded (--encoder-fallback spill)
        self._jobs = itertools.count(1)
        self._tasks = [asyncio.ensure_future(self._receive(link)) for link in self.links]

    def _connect(self, url: str, index: int) -> EncoderServerLink:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a server that is not connected
        sock.connect(endpoint(url))
        return EncoderServerLink(url, client_channel(url, self.key), sock, index)

    def info(self) -> dict[str, object]:
        return {
            "servers": [link.info() for link in self.links],
            "items_sent": self.items_sent,
            "failovers": self.failovers,
            "spilled_requests": self.spilled,
        }

    def busy(self) -> bool:
        """Every server that is up has a job in flight (or none is up): a new job would wait
        behind another one."""
        return all(link.pending for link in self.links if link.up)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.ctx.destroy(linger=0)

    # ------------------------------------------------------------------ encoding
    async def embed(self, items: list[MultimodalDataItem]) -> None:
        """Replace each item's pixels by its embedding rows (items of one digest share them)."""
        unique = list({item.hash: item for item in items}.values())
        if not any(link.up for link in self.links):  # all down: one may be back (restarted)
            await asyncio.gather(*(self._probe(link) for link in self.links))
        groups: dict[int, list[MultimodalDataItem]] = {}
        for item in unique:
            groups.setdefault(self.choose(item.hash).index, []).append(item)
        results = await asyncio.gather(*(self._job(g, self.links[i]) for i, g in groups.items()))
        rows = {h: emb for found in results for h, emb in found.items()}
        for item in items:
            item.feature, item.embedded = rows[item.hash], True

    def choose(self, digest: int, tried: Sequence[EncoderServerLink] = ()) -> EncoderServerLink:
        """The server for `digest`: its first by rendezvous hash among those up (and not tried),
        unless another is less loaded by `LOAD_SLACK` jobs."""
        now = time.monotonic()
        live = [link for link in self.links if link not in tried and self._usable(link, now)]
        if not live:
            raise EncoderUnavailable("no encoder server is up")
        first = max(live, key=lambda link: rendezvous(digest, link.url))
        least = min(live, key=lambda link: (len(link.pending), link.index))
        return least if len(first.pending) > len(least.pending) + LOAD_SLACK else first

    def _usable(self, link: EncoderServerLink, now: float) -> bool:
        if not link.up and now - link.probed >= PROBE_S:
            link.probed = now
            asyncio.ensure_future(self._probe(link))
        return link.up

    async def _job(
        self, items: list[MultimodalDataItem], link: EncoderServerLink
    ) -> dict[int, torch.Tensor]:
        tried: list[EncoderServerLink] = []
        while True:
            try:
                return await self._attempt(items, link)
            except (TimeoutError, zmq.ZMQError) as exc:
                self._failed(link, exc)
            tried.append(link)
            if len(tried) > self.retries:
                raise EncoderUnavailable(f"no encoder server answered ({len(tried)} tried)")
            link = self.choose(items[0].hash, tried)
            self.failovers += 1

    def _failed(self, link: EncoderServerLink, exc: BaseException) -> None:
        logger.warning("encoder server %s failed a job (%r); marked down", link.url, exc)
        link.up, link.probed = False, time.monotonic()
        link.failures += 1

    async def _attempt(
        self, items: list[MultimodalDataItem], link: EncoderServerLink
    ) -> dict[int, torch.Tensor]:
        job = next(self._jobs)
        rows, tensors, links = job_rows(items, link.channel.shm_dir)
        header = {"op": "encode", "job": job, "shm": link.channel.shm_dir is not None}
        written: list[str] = []
        try:
            header["items"] = rows
            reply, embeddings = await self._ask(link, job, header, tensors, written)
        finally:
            for path in written + [s.path for s in links]:
                remove_file(path)  # the server removed what it read; the rest goes now
        if reply.get("op") == "error":
            raise EncoderRefused(str(reply.get("message", "the encoder server refused the job")))
        if reply.get("op") != "embeddings" or reply.get("digests") != [r["digest"] for r in rows]:
            raise EncoderRefused(f"encoder server {link.url}: an answer that does not match")
        self.items_sent += len(rows)
        return dict(zip(reply["digests"], embeddings))

    async def _ask(
        self, link: EncoderServerLink, job: int, header: Header, tensors: list, written: list[str],
        timeout_s: float | None = None,
    ) -> tuple[Header, list[torch.Tensor]]:
        """Send one message and wait for its answer, at most `timeout_s` (--encoder-timeout)."""
        future = asyncio.get_running_loop().create_future()
        link.pending[job] = future
        try:
            frames = link.channel.pack(header, tensors, written)
            if not await link.sock.poll(CONNECT_MS, zmq.POLLOUT):  # connected (or not)
                raise TimeoutError(f"not connected to {link.url} within {CONNECT_MS} ms")
            await link.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            link.jobs_sent += 1
            return await asyncio.wait_for(future, timeout_s or self.timeout_s)
        finally:
            link.pending.pop(job, None)

    async def _probe(self, link: EncoderServerLink) -> None:
        job = next(self._jobs)
        link.probed = time.monotonic()
        try:
            header, wait = {"op": "health", "job": job}, min(self.timeout_s, PROBE_TIMEOUT_S)
            reply, _ = await self._ask(link, job, header, [], [], wait)
        except (TimeoutError, zmq.ZMQError):
            return
        if reply.get("ok") is True:
            logger.info("encoder server %s answers again", link.url)
            link.up = True

    async def _receive(self, link: EncoderServerLink) -> None:
        """Every answer of `link`, matched to its job (a late one, after its deadline, is read
        and dropped: its shared-memory file is removed with it)."""
        while True:
            parts = await link.sock.recv_multipart(copy=False)
            try:
                header, tensors = link.channel.unpack([p.buffer for p in parts])
            except WireError as exc:
                logger.warning("encoder server %s: dropped an answer: %s", link.url, exc)
                continue
            future = link.pending.get(header.get("job"))
            if future is not None and not future.done():
                future.set_result((header, tensors))


def rendezvous(digest: int, url: str) -> int:
    """The rank of `url` for `digest` (the highest wins): stable as servers come and go."""
    data = digest.to_bytes(16, "little", signed=False) + url.encode()  # 128-bit digests
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def job_rows(
    items: list[MultimodalDataItem], shm_dir: str | None
) -> tuple[list[Header], list, list[SharedTensor]]:
    """The job's items and their pixel tensors; a pixel file goes by a link of its own when the
    server shares the node (the links are returned, for removal when the job ends)."""
    rows, tensors, links = [], [], []
    for item in items:
        pixels = item.feature
        if isinstance(pixels, SharedTensor) and shm_dir is not None:
            pixels = link_copy(pixels, shm_dir)
            links.append(pixels)
        elif isinstance(pixels, SharedTensor):
            pixels = SharedTensor(pixels.path, pixels.shape, pixels.dtype, owned=False).load()
        elif not isinstance(pixels, torch.Tensor):
            pixels = torch.from_numpy(pixels)
        row = {"digest": item.hash, "modality": str(item.modality.value), "pixels": len(tensors)}
        rows.append({**row, "grid": [int(n) for n in item.grid_thw]})
        tensors.append(pixels)
    return rows, tensors, links

