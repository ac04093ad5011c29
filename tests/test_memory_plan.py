"""The division of a GPU's memory (runtime/memory_plan.py), computed on CPU from given numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.distributed import TPGroup
from runtime.memory_plan import (
    MIB,
    NCCL_ALLOWANCE,
    MemoryNeeds,
    activation_peak_bytes,
    comm_buffer_bytes,
    kv_pool_tokens,
    memory_needs,
    plan_memory,
    size_kv_pool,
)
from runtime.memory_pool import KVLayout
from runtime.model_config import ModelConfig
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint

GIB = 1 << 30
TOTAL = 80 * GIB
WEIGHTS = 16 * GIB
FREE = TOTAL - WEIGHTS - GIB  # the weights and a CUDA context of 1 GiB are in use


def needs(encoder: int = 0, activations: int = 0, comm: int = 0) -> MemoryNeeds:
    return MemoryNeeds(WEIGHTS, encoder, activations, comm)


def test_small_needs_keep_the_static_fraction() -> None:
    """With little to reserve, the KV pool fills the device up to mem_fraction: what is in use
    (weights, context) plus the KV pool is exactly that share, as SGLang sizes it."""
    plan = plan_memory(TOTAL, FREE, needs(), 0.85)
    assert plan.headroom == int(TOTAL * 0.15)
    assert plan.kv == FREE - int(TOTAL * 0.15)  # = 85% of the device less what is in use
    assert plan.kv_tokens(1 << 19) == plan.kv // (1 << 19)


def test_encoder_cache_comes_out_of_the_kv_pool() -> None:
    base = plan_memory(TOTAL, FREE, needs(), 0.85)
    cached = plan_memory(TOTAL, FREE, needs(encoder=256 * MIB), 0.85)
    assert base.kv - cached.kv == 256 * MIB and cached.headroom == base.headroom


def test_a_large_activation_peak_widens_the_headroom() -> None:
    """Activations plus communication past the unreserved share: the headroom grows to them and
    the KV pool shrinks by as much; under that share they change nothing."""
    share = int(TOTAL * 0.15)
    under = plan_memory(TOTAL, FREE, needs(activations=share // 2, comm=share // 4), 0.85)
    assert under.headroom == share
    over = plan_memory(TOTAL, FREE, needs(activations=share, comm=2 * GIB), 0.85)
    assert over.headroom == share + 2 * GIB
    assert under.kv - over.kv == 2 * GIB


def test_plans_that_cannot_work_name_the_flags() -> None:
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        plan_memory(TOTAL, FREE, needs(), 0.15)  # the weights alone pass 15% of the device
    with pytest.raises(ValueError, match="--mm-cache-size-mb"):
        plan_memory(TOTAL, FREE, needs(encoder=60 * GIB), 0.85)
    with pytest.raises(ValueError, match="between 0 and 1"):
        plan_memory(TOTAL, FREE, needs(), 1.0)
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        ServerArgs(device="cpu", mem_fraction_static=0).check()


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return ModelConfig.from_dir(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("ck")))


def test_activation_estimate_scales_with_the_step(config: ModelConfig) -> None:
    """Linear in prefill tokens and in sampled requests, smaller per rank with TP (the decoder
    shards), larger with decode graphs; communication only with more than one rank."""
    one = activation_peak_bytes(config, 1024, 8, 0, 1, 2)
    none = activation_peak_bytes(config, 0, 8, 0, 1, 2)
    assert activation_peak_bytes(config, 2048, 8, 0, 1, 2) - one == one - none > 0
    vocab = config.text.vocab_size
    assert activation_peak_bytes(config, 1024, 9, 0, 1, 2) - one == vocab * 24
    assert activation_peak_bytes(config, 1024, 8, 0, 2, 2) < one
    assert activation_peak_bytes(config, 1024, 8, 16, 1, 2) > one
    assert comm_buffer_bytes(config, 1024, 1, 2) == 0
    assert comm_buffer_bytes(config, 1024, 2, 2) > NCCL_ALLOWANCE


def test_needs_follow_the_flags(config: ModelConfig) -> None:
    cpu = memory_needs(config, 1000, 2, ServerArgs(device="cpu", mm_cache_size_mb=64))
    assert cpu.weights == 1000 and cpu.encoder_cache == 64 * MIB and cpu.comm_buffers == 0
    graphs = memory_needs(config, 1000, 2, ServerArgs(device="cuda", mm_cache_size_mb=64))
    assert graphs.activation_peak > cpu.activation_peak  # the decode graphs' pool
    tp2 = memory_needs(config, 1000, 2, ServerArgs(device="cuda", tp_size=2))
    assert tp2.comm_buffers > NCCL_ALLOWANCE


def test_kv_pool_tokens_follow_the_plan() -> None:
    """On CUDA the pool gets the plan's KV bytes over the bytes per token (the device's numbers
    are given); a fixed --max-total-tokens and CPU do not need the device."""
    layout = KVLayout(28, 4, 128, torch.bfloat16)
    reserve = needs(encoder=256 * MIB, activations=20 * GIB)
    cuda = ServerArgs(device="cuda", mem_fraction_static=0.85)
    tokens, plan = kv_pool_tokens(cuda, reserve, layout.bytes_per_token, (FREE, TOTAL))
    assert plan == plan_memory(TOTAL, FREE, reserve, 0.85)
    assert tokens == plan_memory(TOTAL, FREE, reserve, 0.85).kv // layout.bytes_per_token
    assert tokens == (FREE - 256 * MIB - 20 * GIB) // layout.bytes_per_token
    fixed = dataclasses.replace(cuda, max_total_tokens=4096)
    assert kv_pool_tokens(fixed, reserve, layout.bytes_per_token, None) == (4096, None)
    cpu = ServerArgs(device="cpu", mem_fraction_static=0.85)
    assert kv_pool_tokens(cpu, reserve, layout.bytes_per_token, None) == (16384, None)


def test_size_kv_pool_asks_the_device_only_on_cuda(
    config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a rank calls: its model's weights and the layout's dtype make the needs, the
    device's numbers (stood in here) the plan; on CPU or with --max-total-tokens the device is
    never asked."""
    asked: list[int] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: asked.append(1) or (FREE, TOTAL))
    model = torch.nn.Linear(8, 8)  # 288 bytes of weights
    layout = KVLayout(28, 4, 128, torch.bfloat16)
    model.config = config
    cuda = ServerArgs(device="cuda", mem_fraction_static=0.85)
    expected = plan_memory(TOTAL, FREE, memory_needs(config, 288, 2, cuda), 0.85)
    assert size_kv_pool(cuda, model, layout, TPGroup()) == expected.kv_tokens(
        layout.bytes_per_token
    )
    assert asked == [1]
    fixed = dataclasses.replace(cuda, max_total_tokens=4096)
    assert size_kv_pool(fixed, model, layout, TPGroup()) == 4096
    assert size_kv_pool(ServerArgs(device="cpu"), model, layout, TPGroup()) == 16384
    assert asked == [1]


def test_default_plan_of_a_7b_shape(config: ModelConfig) -> None:
    """The defaults' scale on a Qwen2-VL-7B-shaped model in bf16 on an 80 GiB device: the peak
    estimate (a full 8192-token image prefill, 64 requests sampled, decode graphs) is GiBs, and
    the 15% the default --mem-fraction-static leaves covers it, so the KV pool is what is free
    less that share and the encoder cache."""
    text = dataclasses.replace(
        config.text, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, head_dim=128,
    )
    vision = dataclasses.replace(
        config.vision, embed_dim=1280, intermediate_size=5120, out_hidden_size=3584
    )
    big = dataclasses.replace(config, text=text, vision=vision)
    args = ServerArgs(device="cuda")
    reserve = memory_needs(big, WEIGHTS, 2, args)
    assert 2 * GIB < reserve.activation_peak < int(TOTAL * 0.15)
    plan = plan_memory(TOTAL, FREE, reserve, args.mem_fraction_static)
    assert plan.kv == FREE - 256 * MIB - int(TOTAL * 0.15)
    layout = KVLayout(28, 4, 128, torch.bfloat16)
    assert plan.kv_tokens(layout.bytes_per_token) > 900_000
