"""An encoder server (`launch.py --encoder-only`): the checkpoint's vision tower alone, on --tp
ranks in the tp, dp or auto encoder mode, taking encode jobs from LLM servers and answering
with embeddings keyed by item digest (the wire: runtime/transport/encoder_wire.py).

Rank 0 owns the ZMQ ROUTER socket (bound to --host:--port; loopback, or a private address with
--encoder-secret). Each loop it reads the jobs that arrived, checks them (a job that is not one
is that job's error, answered at once), and broadcasts the good ones to the other ranks; every
rank then encodes the step's items in one call through its own per-item `EncoderCache` (hits
agreed across ranks, misses deduplicated over the jobs and balanced in one pass), and rank 0
answers each job. A job item may come without pixels: its digest must then be cached here
(an LLM server that knows this server encoded it), else the job fails with "unknown digest".

A job:   {"op": "encode", "job": id, "shm": bool, "items": [{"digest", "modality", "grid",
          "pixels": index of its tensor, or null}]}
Answers: {"op": "embeddings", "job": id, "digests": [...]} with one tensor per digest;
         {"op": "error", "job": id, "message": ...}; {"op": "health", ...} to {"op": "health"}.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch
import zmq

from runtime.allocator import freeze_startup_objects, keep_freed_memory
from runtime.cpus import threads_per_rank
from runtime.distributed import TPGroup, destroy_tp_group, init_tp_group
from runtime.io_struct import ReadyReport
from runtime.logging_utils import configure_logging, get_logger
from runtime.multimodal import Modality, MultimodalDataItem
from runtime.parent_watch import exit_with_parent
from runtime.server_args import ServerArgs
from runtime.transport.broadcast import broadcast_frames, release_loaded
from runtime.transport.encoder_wire import Channel, Header, WireError, check_bind, is_loopback
from runtime.transport.frames import from_frames, to_frames
from runtime.transport.shm import local_shm_dir
from scheduler.encoder_cache import EncoderCache, agree_on_misses
from vision.vlm import VisionEncoderModel, build_model

logger = get_logger(__name__)

IDLE_POLL_MS = 20
MAX_ITEMS_PER_JOB = 256
MAX_PATCHES_PER_JOB = 1 << 22
DIGEST_BITS = 128  # an item's digest (tokenizer_manager/media/multimodal_inputs.py)


class JobError(ValueError):
    """What is wrong with one job: answered as that job's error."""


@dataclass
class Job:
    """One checked encode job: its items (pixels or digest only), as every rank runs it."""

    job: int
    items: list[MultimodalDataItem]
    shm: bool = False
    peer: bytes = b""  # rank 0 only: the ROUTER identity to answer

    @property
    def digests(self) -> list[int]:
        return list(dict.fromkeys(item.hash for item in self.items))


@dataclass
class Outcome:
    """A job's answer: embeddings per digest, or why it failed."""

    job: Job
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict)
    error: str = ""


def check_job(header: Header, tensors: list[torch.Tensor], model: VisionEncoderModel) -> Job:
    """The job a message asks for; JobError names what is wrong with it."""
    items = header.get("items")
    if not isinstance(items, list) or not 0 < len(items) <= MAX_ITEMS_PER_JOB:
        raise JobError(f"a job has 1 to {MAX_ITEMS_PER_JOB} items")
    checked = [check_item(raw, tensors, model) for raw in items]
    if sum(item.num_patches for item in checked) > MAX_PATCHES_PER_JOB:
        raise JobError(f"a job has at most {MAX_PATCHES_PER_JOB} patches")
    return Job(int(header["job"]), checked, bool(header.get("shm")))


def check_item(
    raw: object, tensors: list[torch.Tensor], model: VisionEncoderModel
) -> MultimodalDataItem:
    if not isinstance(raw, dict):
        raise JobError("a job item is a JSON object")
    digest, grid, pixels = raw.get("digest"), raw.get("grid"), raw.get("pixels")
    if type(digest) is not int or not 0 <= digest < 2**DIGEST_BITS:
        raise JobError(f"bad digest {digest!r}")
    if not (isinstance(grid, list) and len(grid) == 3 and all(type(n) is int for n in grid)):
        raise JobError(f"item {digest}: bad grid {grid!r}")
    if min(grid) < 1:
        raise JobError(f"item {digest}: bad grid {grid!r}")
    try:
        modality = Modality(raw.get("modality", "image"))
    except ValueError:
        raise JobError(f"item {digest}: bad modality {raw.get('modality')!r}") from None
    item = MultimodalDataItem(modality, hash=digest, grid_thw=tuple(grid))
    if item.num_patches % model.config.vision.spatial_merge_size**2:
        raise JobError(f"item {digest}: grid {grid} is not whole merged patches")
    if pixels is not None:
        item.feature = check_pixels(digest, pixels, tensors, item.num_patches, model)
    return item


def check_pixels(
    digest: int, index: object, tensors: list[torch.Tensor], rows: int, model: VisionEncoderModel
) -> torch.Tensor:
    if type(index) is not int or not 0 <= index < len(tensors):
        raise JobError(f"item {digest}: bad pixels index {index!r}")
    pixels, width = tensors[index], model.config.vision.patch_dim
    if not pixels.is_floating_point() or tuple(pixels.shape) != (rows, width):
        raise JobError(
            f"item {digest}: pixels of shape {list(pixels.shape)} ({pixels.dtype}); its grid "
            f"needs float [{rows}, {width}]"
        )
    return pixels


class EncoderServer:
    """One rank's encoding of a step's jobs through its cache; every rank runs the same jobs."""

    def __init__(self, model: VisionEncoderModel, tp: TPGroup, cache: EncoderCache):
        self.model, self.tp, self.cache = model, tp, cache
        self.jobs_done = 0
        self.jobs_failed = 0

    def run(self, jobs: list[Job]) -> list[Outcome]:
        """Each job's outcome: jobs naming a digest this server lacks fail; the others'
        items are encoded in one call (a call that fails is retried job by job)."""
        outcomes = [Outcome(job) for job in jobs]
        self._fail_unknown(outcomes)
        good = [o for o in outcomes if not o.error]
        try:
            self._encode(good)
        except Exception:  # noqa: BLE001 - one job's bad input must not fail the others
            if len(good) == 1:
                good[0].error = f"the encoder failed: {traceback.format_exc(limit=1)}"
            else:
                for outcome in good:
                    self._encode_alone(outcome)
        for outcome in outcomes:
            self.jobs_done += 1
            self.jobs_failed += bool(outcome.error)
        return outcomes

    def _fail_unknown(self, outcomes: list[Outcome]) -> None:
        """Items without pixels must be cached on every rank (one agreed MAX of miss flags,
        joined by every rank, also with none)."""
        keyed = [(o, i.hash) for o in outcomes for i in o.job.items if i.feature is None]
        digests = [h for _, h in keyed]
        if not digests:  # the same on every rank: they all run the same jobs
            return
        missing = set(agree_on_misses(digests, self.cache, self.tp))
        for outcome, digest in keyed:
            if digest in missing and not outcome.error:
                outcome.error = f"unknown digest {digest}: send the item's pixels"

    def _encode(self, outcomes: list[Outcome]) -> None:
        keyed = [i for o in outcomes for i in o.job.items if i.feature is None]
        pixels = [i for o in outcomes for i in o.job.items if i.feature is not None]
        out = self.cache.encode_with_cache(keyed + pixels, self.model.encode_items, self.tp)
        for outcome in outcomes:
            outcome.embeddings = {h: out[h] for h in outcome.job.digests}

    def _encode_alone(self, outcome: Outcome) -> None:
        try:
            self._encode([outcome])
        except Exception:  # noqa: BLE001 - see `run`
            outcome.error = f"the encoder failed: {traceback.format_exc(limit=1)}"

    def health(self) -> Header:
        stats = self.cache.stats()
        return {
            "op": "health",
            "ok": True,
            "tp": self.tp.size,
            "mode": self.model.encoder_mode,
            "row_dim": self.model.config.vision.embed_row_dim,
            "jobs": self.jobs_done,
            "jobs_failed": self.jobs_failed,
            "items_encoded": stats.items_encoded,
            "hits": stats.hits,
            "misses": stats.misses,
            "entries": stats.entries,
        }


class EncoderSocket:
    """Rank 0's ROUTER socket: jobs in (checked), answers out."""

    def __init__(self, args: ServerArgs, model: VisionEncoderModel):
        check_bind(args.encoder_bind_url, args.encoder_key)
        self.model = model
        local = is_loopback(args.encoder_bind_url)
        self.channel = Channel(args.encoder_key, local_shm_dir(1) if local else None)
        self.inline = Channel(args.encoder_key)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(args.encoder_bind_url)

    def receive(self, server: EncoderServer, wait_ms: int) -> list[Job]:
        """The jobs that arrived; health probes and bad jobs are answered here and now."""
        if wait_ms and not self.sock.poll(wait_ms):
            return []
        jobs: list[Job] = []
        while self.sock.poll(0):
            peer, *frames = self.sock.recv_multipart(copy=False)
            job = self._take(peer.bytes, [f.buffer for f in frames], server)
            if job is not None:
                jobs.append(job)
        return jobs

    def _take(self, peer: bytes, frames: list, server: EncoderServer) -> Job | None:
        try:
            header, tensors = self.channel.unpack(frames)
        except WireError as exc:
            logger.warning("encoder: dropped a message: %s", exc)
            return None
        job_id = header.get("job")
        if type(job_id) is not int:
            logger.warning("encoder: dropped a message without a job id")
            return None
        if header.get("op") == "health":
            self._send(peer, {**server.health(), "job": job_id})
            return None
        try:
            if header.get("op") != "encode":
                raise JobError(f"unknown op {header.get('op')!r}")
            job = check_job(header, tensors, self.model)
        except JobError as exc:
            self._send(peer, {"op": "error", "job": job_id, "message": str(exc)})
            return None
        job.peer = peer
        return job

    def answer(self, outcome: Outcome) -> None:
        job = outcome.job
        if outcome.error:
            self._send(job.peer, {"op": "error", "job": job.job, "message": outcome.error})
            return
        header = {"op": "embeddings", "job": job.job, "digests": job.digests}
        tensors = [outcome.embeddings[h] for h in job.digests]
        self._send(job.peer, header, tensors, shared=job.shm)

    def _send(
        self, peer: bytes, header: Header, tensors: list[torch.Tensor] = (), shared: bool = False
    ) -> None:
        channel = self.channel if shared else self.inline
        self.sock.send_multipart([peer, *channel.pack(header, tensors)], copy=False)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def share_jobs(jobs: list[Job] | None, tp: TPGroup, shm_dir: str | None) -> list[Job]:
    """Rank 0's jobs on every rank (pixels through shared memory on one node)."""
    if tp.size == 1:
        return jobs or []
    sent = [to_frames([(j.job, j.items, j.shm) for j in jobs])] if tp.is_first else None
    frames = broadcast_frames(sent, tp.rank, tp.cpu_group, tp.size, shm_dir)
    loaded: list[str] = []
    rows = from_frames(frames[0], loaded)
    release_loaded(loaded, tp.rank, tp.cpu_group, tp.size)
    if tp.is_first:
        return jobs
    return [Job(job, items, shm) for job, items, shm in rows]


def serve_encoder(server: EncoderServer, tp: TPGroup, sock: EncoderSocket | None) -> None:
    shm_dir = local_shm_dir(1)
    while True:
        jobs = sock.receive(server, IDLE_POLL_MS) if sock is not None else None
        jobs = share_jobs(jobs, tp, shm_dir)
        if not jobs:
            continue
        for outcome in server.run(jobs):
            if sock is not None:
                sock.answer(outcome)


def build_encoder_server(args: ServerArgs, tp: TPGroup) -> EncoderServer:
    """Everything one encoder rank owns, from the flags (the server and the tests build here)."""
    device = f"cuda:{torch.cuda.current_device()}" if args.use_cuda else "cpu"
    model = build_model(
        args.model_path, tp, attention_backend=args.attention_backend,
        encoder_mode=args.mm_encoder_mode, dtype=args.dtype, device=device,
        cpu_linear=args.cpu_linear, pad_vit_mlp=not args.disable_vit_mlp_padding,
        encoder_only=True,
    )  # fmt: skip
    return EncoderServer(model, tp, EncoderCache(args.mm_cache_size_mb * 2**20))


def run_encoder_process(
    args: ServerArgs, tp_rank: int, dist_init_method: str, ready: Connection
) -> None:
    """Entry point of encoder rank `tp_rank`: load the tower, report ready, then serve jobs."""
    exit_with_parent()
    configure_logging(args.log_level, prefix=f"ENC{tp_rank}")
    keep_freed_memory()
    if args.use_cuda:
        torch.cuda.set_device(tp_rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(threads_per_rank(args.tp_size))
    sock = None
    try:
        tp = init_tp_group(tp_rank, args.tp_size, dist_init_method, use_cuda=args.use_cuda)
        server = build_encoder_server(args, tp)
        sock = EncoderSocket(args, server.model) if tp.is_first else None
        ready.send(ReadyReport("ready", rank=tp_rank))
    except Exception:
        ready.send(ReadyReport.failed(traceback.format_exc(), rank=tp_rank))
        raise
    freeze_startup_objects()
    try:
        with torch.inference_mode():
            serve_encoder(server, tp, sock)
    finally:
        if sock is not None:
            sock.close()
        destroy_tp_group()
