"""How a GPU's memory is divided, and so how many KV slots the pool gets: the one place the KV
pool is sized. `size_kv_pool` is what a rank calls; it asks the device what is free and the ranks
for their minimum, and leaves the decision to the pure `kv_pool_tokens`.

`plan_memory` is a pure function of what the device reports (total, free after the weights are
loaded) and what this server will need beside the KV pool (`MemoryNeeds`): the weights, the
encoder-output cache, the peak of a step's activations and the communication buffers.
`--mem-fraction-static` is the share of the device that the weights, the encoder cache and the
KV pool may take together (SGLang's meaning); the rest is headroom for activations, CUDA
graphs, NCCL and the allocator's fragmentation, and it is widened when the estimated peak needs
more than that share. docs/gpu.md explains the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.distributed import TPGroup
from runtime.layers.linear import aligned_hidden_size
from runtime.logging_utils import get_logger, log_rank0
from runtime.memory_pool import KVLayout
from runtime.model_config import ModelConfig
from runtime.server_args import ServerArgs

logger = get_logger(__name__)

CPU_DEFAULT_KV_TOKENS = 16384  # KV slots on CPU when --max-total-tokens is not given
MIB = 1 << 20
NCCL_ALLOWANCE = 256 * MIB  # NCCL's own channel buffers and workspace, per rank with tp > 1
LOGIT_BYTES = 24  # per (request, vocab entry) in sampling: bf16/fp32 logits, fp32 probs, sorts


@dataclass(frozen=True)
class MemoryNeeds:
    """Bytes one rank needs beside its KV pool."""

    weights: int
    encoder_cache: int
    activation_peak: int
    comm_buffers: int


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's device memory: the KV pool gets `kv` bytes, `headroom` stays free."""

    total: int
    free: int
    mem_fraction: float
    needs: MemoryNeeds
    headroom: int
    kv: int

    def kv_tokens(self, bytes_per_token: int) -> int:
        return self.kv // bytes_per_token

    def describe(self) -> str:
        gib = 1 << 30
        n = self.needs
        return (
            f"device {self.total / gib:.1f} GiB: weights {n.weights / gib:.2f}, other in use "
            f"{(self.total - self.free - n.weights) / gib:.2f}, encoder cache "
            f"{n.encoder_cache / gib:.2f}, KV {self.kv / gib:.2f}, headroom "
            f"{self.headroom / gib:.2f} (activations {n.activation_peak / gib:.2f}, "
            f"communication {n.comm_buffers / gib:.2f})"
        )


def plan_memory(total: int, free: int, needs: MemoryNeeds, mem_fraction: float) -> MemoryPlan:
    """The KV pool's bytes on a device of `total` bytes with `free` bytes free after loading the
    weights: what is free, less the encoder cache, less a headroom of the larger of the device
    share outside `mem_fraction` and the activation peak plus communication buffers.

    Raises ValueError, naming the flag to change, when the weights alone pass `mem_fraction` of
    the device or nothing is left for the KV pool."""
    if not 0 < mem_fraction < 1:
        raise ValueError(f"--mem-fraction-static {mem_fraction} must be between 0 and 1")
    if needs.weights > total * mem_fraction:
        raise ValueError(
            f"the weights ({needs.weights / MIB:.0f} MiB) pass --mem-fraction-static "
            f"{mem_fraction} of the device ({total / MIB:.0f} MiB): raise it or use more GPUs"
        )
    headroom = max(int(total * (1 - mem_fraction)), needs.activation_peak + needs.comm_buffers)
    kv = free - needs.encoder_cache - headroom
    plan = MemoryPlan(total, free, mem_fraction, needs, headroom, kv)
    if kv <= 0:
        raise ValueError(
            f"no memory left for the KV pool: {plan.describe()}; lower --mm-cache-size-mb, "
            "--max-prefill-tokens or --max-running-requests, or raise --mem-fraction-static"
        )
    return plan


def activation_peak_bytes(
    config: ModelConfig, tokens: int, batch: int, graph_bs: int, tp: int, itemsize: int
) -> int:
    """An upper estimate of the activations one step holds at its peak: the vision tower over
    the patches of `tokens` media tokens (its replica, unsharded), the decoder over `tokens`
    prefill tokens (this rank's heads and MLP shard), the sampler over `batch` requests' logits,
    and the memory pool the decode CUDA graphs of up to `graph_bs` requests keep."""
    text, vision = config.text, config.vision
    patches = tokens * vision.spatial_merge_size**2
    # the tower's MLP as a GPU runs it: padded to aligned rows (vision/vit_common.py)
    vision_hidden = aligned_hidden_size(vision.intermediate_size, itemsize, tp)
    vision_row = 6 * vision.embed_dim + 2 * vision_hidden
    qkv = (text.num_attention_heads + 2 * text.num_key_value_heads) * text.head_dim
    text_row = 4 * text.hidden_size + (qkv + 4 * text.intermediate_size) // tp
    logits = text.vocab_size * LOGIT_BYTES
    step = (patches * vision_row + tokens * text_row) * itemsize + batch * logits
    graphs = graph_bs * (text_row * itemsize + logits)
    return step + graphs


def comm_buffer_bytes(config: ModelConfig, tokens: int, tp: int, itemsize: int) -> int:
    """NCCL's buffers and the collectives' outputs of a step (an all-reduce of the decoder's
    hidden rows, an all-gather of the encoder's rows); none on one rank."""
    if tp == 1:
        return 0
    rows = tokens * (config.text.hidden_size + tp * config.vision.out_hidden_size)
    return NCCL_ALLOWANCE + 2 * rows * itemsize


def memory_needs(config: ModelConfig, weights: int, itemsize: int, args: ServerArgs) -> MemoryNeeds:
    """What a rank of a server with these flags needs beside its KV pool (`weights`: the bytes
    of its loaded shard; `itemsize`: the activations' bytes per value)."""
    tokens, tp = args.max_prefill_tokens, args.tp_size
    return MemoryNeeds(
        weights=weights,
        encoder_cache=args.mm_cache_size_mb * MIB,
        activation_peak=activation_peak_bytes(
            config, tokens, args.max_running_requests, args.decode_graph_bs, tp, itemsize
        ),
        comm_buffers=comm_buffer_bytes(config, tokens, tp, itemsize),
    )


def kv_pool_tokens(
    args: ServerArgs, needs: MemoryNeeds, bytes_per_token: int, device: tuple[int, int] | None
) -> tuple[int, MemoryPlan | None]:
    """This rank's KV slots and the memory plan they come from: --max-total-tokens if given,
    else a CPU default, else what `plan_memory` leaves for KV on a device of `device` = (free,
    total) bytes (None: not asked, as it is not needed). Pure."""
    if args.max_total_tokens:
        return args.max_total_tokens, None
    if not args.use_cuda:
        return CPU_DEFAULT_KV_TOKENS, None
    if device is None:
        raise ValueError("sizing the KV pool from memory needs the device's free and total bytes")
    free, total = device
    plan = plan_memory(total, free, needs, args.mem_fraction_static)
    return plan.kv_tokens(bytes_per_token), plan


def size_kv_pool(args: ServerArgs, model: nn.Module, layout: KVLayout, tp: TPGroup) -> int:
    """The KV pool's slots for this server, the same on every rank (the minimum over ranks, so
    each rank's pool holds the same requests): `kv_pool_tokens` with this rank's needs beside
    the pool (the loaded `model`'s weights, an activation value of `layout`'s dtype) and, on
    CUDA without --max-total-tokens, the device's free and total memory now."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    needs = memory_needs(model.config, weights, layout.dtype.itemsize, args)
    asks_device = args.use_cuda and not args.max_total_tokens
    device = torch.cuda.mem_get_info() if asks_device else None
    tokens, plan = kv_pool_tokens(args, needs, layout.bytes_per_token, device)
    if plan is None:
        return tokens
    log_rank0(logger, tp.rank, "memory plan: %s", plan.describe())
    return int(tp.all_reduce_cpu(torch.tensor([tokens]), op="min").item())
