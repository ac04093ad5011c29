"""The scheduler process: one per TP rank. Rank 0 talks ZMQ; every rank runs the same steps."""

from __future__ import annotations

import dataclasses
import traceback
from functools import partial
from multiprocessing.connection import Connection

import torch
import zmq
from torch import nn

from runtime.allocator import freeze_startup_objects, keep_freed_memory
from runtime.cpus import threads_per_rank
from runtime.distributed import TPGroup, destroy_tp_group, init_tp_group
from runtime.grammar import checkpoint_compiler
from runtime.io_struct import (
    BatchTokenOut,
    FlushCacheOut,
    RankBroadcast,
    ReadyReport,
    SchedulerRequest,
    ServerInfo,
    ShutdownReq,
)
from runtime.logging_utils import configure_logging, get_logger
from runtime.memory_plan import size_kv_pool
from runtime.multimodal import Modality
from runtime.parent_watch import exit_with_parent
from runtime.sampler import Sampler
from runtime.server_args import ServerArgs
from runtime.token_budget import context_length
from runtime.transport.broadcast import broadcast_frames, release_loaded
from runtime.transport.frames import Frame, from_frames
from runtime.transport.shm import local_shm_dir
from scheduler.encoder_cache import EncoderCache
from scheduler.grammar_state import GrammarBudget
from scheduler.input_checks import FaultsFactory, RequestFaults
from scheduler.model_runner import ModelRunner
from scheduler.radix_cache import RadixCache
from scheduler.scheduler import Scheduler, SchedulerConfig, StepResult
from vision.encoder_plan import EncoderCosts
from vision.vlm import build_model

logger = get_logger(__name__)

IDLE_POLL_MS = 20


class SchedulerChannel:
    """Rank 0's sockets: requests in (bound, one address per replica), outputs out to the
    detokenizer (connected; every replica's entry rank sends to the one detokenizer). Replies
    to control requests are stamped with the replica they come from."""

    def __init__(self, args: ServerArgs, replica: int = 0):
        self.replica = replica
        self.ctx = zmq.Context()
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.bind(args.scheduler_ipc(replica))
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.connect(args.detokenizer_ipc)

    def recv_all(self, wait_ms: int) -> list[list[Frame]]:
        """Every waiting message, each as its frames (runtime/transport/frames.py), undecoded."""
        msgs: list[list[Frame]] = []
        if wait_ms and not self.recv_sock.poll(wait_ms):
            return msgs
        while True:
            try:
                parts = self.recv_sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return msgs
            msgs.append([part.buffer for part in parts])

    def send(self, result: StepResult) -> None:
        if result.outputs or result.started or result.evicted:
            batch = BatchTokenOut(result.outputs, result.started, result.evicted, self.replica)
            self.send_sock.send_pyobj(batch)
        for reply in result.replies:
            if isinstance(reply, ServerInfo | FlushCacheOut):
                reply = dataclasses.replace(reply, replica=self.replica)
            self.send_sock.send_pyobj(reply)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def encoder_costs_override(args: ServerArgs) -> EncoderCosts | None:
    """--mm-encoder-costs as a cost model; None means: calibrate at start-up."""
    return EncoderCosts.from_json(args.mm_encoder_costs) if args.mm_encoder_costs else None


def build_scheduler(
    args: ServerArgs,
    tp: TPGroup,
    model: nn.Module | None = None,
    faults: FaultsFactory | None = None,
) -> Scheduler:
    """Everything one rank's scheduler owns, from the flags: the server, the tests and the
    benchmarks all build schedulers here (`model`: an already loaded model, else loaded now;
    `faults`: testing only, see scheduler/input_checks.py)."""
    model = model or load_model(args, tp)
    device = str(next(model.parameters()).device)
    context = context_length(args, model.config)
    tokens = size_kv_pool(args, model, model.language_model.kv_layout, tp)
    encoder_cache = EncoderCache(args.mm_cache_size_mb * 2**20)
    runner = ModelRunner(
        model,
        max_total_tokens=tokens,
        max_running_requests=args.max_running_requests + 1,
        max_context_len=context + 1,
        device=device,
        item_encoder=encoder_cache.wrap(model.encode_items, tp),
        cuda_graph_max_bs=args.decode_graph_bs,
        decode_threads=args.cpu_decode_threads,
    )
    cfg = SchedulerConfig(
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        context_length=context,
        schedule_policy=args.schedule_policy,
        eos_token_ids=model.config.eos_token_ids,
        enable_mixed_chunk=args.enable_mixed_chunk,
        max_encoder_patches_per_step=args.max_encoder_patches_per_step,
        enable_jump_forward=not args.disable_jump_forward,
        grammar_budget=GrammarBudget(args.grammar_ms_per_token),
        enable_overlap=args.overlap_schedule,
        vocab_size=model.config.text.vocab_size,
        media_token_ids={
            Modality.IMAGE: model.config.image_token_id,
            Modality.VIDEO: model.config.video_token_id,
        },
    )
    radix = RadixCache(runner.kv_pool, disable=args.disable_radix_cache)
    # the front end's dispatcher follows what rank 0 evicts where it routes by prefix
    radix.report_evictions = tp.is_first and args.dp_size > 1 and args.dp_policy == "cache_aware"
    eos, vocab = list(cfg.eos_token_ids), cfg.vocab_size
    compiler = partial(checkpoint_compiler, args.model_path, vocab, eos)  # built by rank 0 only
    sampler = Sampler(seed=args.random_seed)
    injected = rank_faults(faults, tp)
    return Scheduler(cfg, tp, runner, radix, encoder_cache, sampler, compiler, injected)


def rank_faults(faults: FaultsFactory | None, tp: TPGroup) -> RequestFaults | None:
    """This rank's test faults from the factory a test passed (None in production)."""
    if faults is None:
        return None
    logger.warning("TP rank %d: test faults from %r (testing only)", tp.rank, faults)
    return faults(tp.rank, tp.size)


def load_model(args: ServerArgs, tp: TPGroup) -> nn.Module:
    if not args.loads_tower:
        logger.info("TP rank %d: no vision tower; media come encoded from %s", tp.rank,
                    args.encoder_urls)
    device = f"cuda:{torch.cuda.current_device()}" if args.use_cuda else "cpu"
    return build_model(
        args.model_path,
        tp,
        attention_backend=args.attention_backend,
        encoder_mode=args.mm_encoder_mode,
        encoder_costs=encoder_costs_override(args),
        dtype=args.dtype,
        device=device,
        show_progress=tp.is_first,
        cpu_linear=args.cpu_linear,
        pad_vit_mlp=not args.disable_vit_mlp_padding,
        vision_tower=args.loads_tower,
    )


def serve(
    scheduler: Scheduler, tp: TPGroup, channel: SchedulerChannel | None, shm_dir: str | None
) -> None:
    while True:
        frames = None
        if channel is not None:
            frames = channel.recv_all(IDLE_POLL_MS if scheduler.blocked else 0)
        frames = broadcast_frames(frames, tp.rank, tp.cpu_group, tp.size, shm_dir)
        loaded: list[str] = []
        msgs: list[RankBroadcast] = [from_frames(f, loaded) for f in frames]
        release_loaded(loaded, tp.rank, tp.cpu_group, tp.size)
        requests = scheduler_requests(msgs)
        if requests is None:
            return
        result = step_or_die(scheduler, tp, requests)
        if channel is not None:
            channel.send(result)


def scheduler_requests(msgs: list[RankBroadcast]) -> list[SchedulerRequest] | None:
    """The step's messages for the scheduler, or None when one of them is a ShutdownReq (every
    rank leaves its loop: they all received the same messages)."""
    if any(isinstance(m, ShutdownReq) for m in msgs):
        return None
    return msgs


def step_or_die(scheduler: Scheduler, tp: TPGroup, msgs: list[SchedulerRequest]) -> StepResult:
    """A fault the scheduler could not pin on a request (a collective, the device, a bug) ends
    this rank; the supervisor then fails its replica's clients and restarts the replica (with
    --dp > 1), or fails every client and stops the server."""
    try:
        return scheduler.step(msgs)
    except Exception:
        logger.critical(
            "TP rank %d: a fault that belongs to no single request; this rank exits (its "
            "replica is restarted with --dp > 1, else the server stops):\n%s",
            tp.rank,
            traceback.format_exc(),
        )
        raise


def device_index(args: ServerArgs, replica: int, tp_rank: int, visible: int) -> int:
    """The CUDA device of TP rank `tp_rank` of replica `replica` (of `visible` devices; with
    --nnodes, this node's share of the ranks)."""
    return (replica * args.tp_size + tp_rank) % visible


def run_scheduler_process(
    args: ServerArgs,
    tp_rank: int,
    dist_init_method: str,
    ready: Connection,
    faults: FaultsFactory | None = None,
    replica: int = 0,
) -> None:
    """Entry point of TP rank `tp_rank` of data-parallel replica `replica`: load the shard,
    report ready (or why not), then loop. Each replica is a TP group of its own (its own
    `dist_init_method`); on CUDA its ranks take devices replica*tp .. (replica+1)*tp-1, on CPU
    every rank of every replica an equal share of the cores. `faults`: testing only
    (scheduler/input_checks.py)."""
    exit_with_parent()
    prefix = f"TP{tp_rank}" if args.dp_size == 1 else f"DP{replica}-TP{tp_rank}"
    configure_logging(args.log_level, prefix=prefix)
    keep_freed_memory()
    if not args.use_cuda:
        torch.set_num_threads(threads_per_rank(args.ranks_per_node))
    else:
        torch.cuda.set_device(device_index(args, replica, tp_rank, torch.cuda.device_count()))
    channel = None
    try:
        tp = init_tp_group(tp_rank, args.tp_size, dist_init_method, use_cuda=args.use_cuda)
        scheduler = build_scheduler(args, tp, faults=faults)
        channel = SchedulerChannel(args, replica) if tp.is_first else None
        ready.send(
            ReadyReport(
                "ready",
                rank=tp_rank,
                kv_total=scheduler.runner.kv_pool.size,
                context_length=scheduler.cfg.context_length,
            )
        )
    except Exception:
        ready.send(ReadyReport.failed(traceback.format_exc(), rank=tp_rank))
        raise
    freeze_startup_objects()  # the model and the imports: no full collection walks them again
    try:
        with torch.inference_mode():
            serve(scheduler, tp, channel, local_shm_dir(args.nnodes))
    finally:
        if channel is not None:
            channel.close()
        destroy_tp_group()
