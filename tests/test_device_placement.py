"""Host bookkeeping meets device tensors only through explicit copies.

The "device" here is torch's meta device under `DeviceRules` (tests/device_check.py): an op that
CUDA would refuse for mixing host and device tensors raises, and so does reading a device value
on the host (a synchronisation) where the code should have used what the host already knows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from device_check import DeviceMixError, DeviceRules
from runner_utils import extend
from vlm_cases import ARCHS, Checkpoint, noise_image

from kernels.attention.torch_backend import TorchAttentionBackend
from runtime.distributed import TPGroup
from runtime.forward_batch import ForwardBatch, ForwardMode, HostStager
from runtime.memory_pool import KVPool, ReqToTokenPool
from runtime.sampler import Sampler, filtered_probs
from runtime.sampling_params import SamplingParams
from runtime.tiny_checkpoint import make_checkpoint
from scheduler.encoder_cache import EncoderCache
from scheduler.model_runner import ModelRunner
from scheduler.req import Req

META = torch.device("meta")


def test_rules_refuse_host_values_in_a_device_op() -> None:
    """The checker refuses what CUDA refuses and lets through what CUDA allows."""
    table = torch.zeros(4, 8, dtype=torch.int64, device=META)
    rows, cols = torch.tensor([0, 1]), torch.tensor([2, 3])
    with DeviceRules():
        table[rows, cols] = torch.ones(2, dtype=torch.int64, device=META)  # host indices: fine
        table[0, :2] = torch.tensor([5, 6])  # a copy between devices: fine
        table.add_(torch.tensor(1))  # a 0-dim host scalar: fine
        with pytest.raises(DeviceMixError, match="index_put_"):
            table[rows, cols] = torch.tensor([7, 8])
        with pytest.raises(DeviceMixError, match="index_select"):
            table.index_select(0, rows)


def test_pools_take_host_slots() -> None:
    """Slots come from the host free list; every pool method that writes them into (or reads
    with them from) a device tensor moves them there."""
    req_pool = ReqToTokenPool(3, 16, META)
    kv_pool = KVPool(32, 2, 2, 8, torch.float32, META)
    with DeviceRules():
        row = req_pool.alloc()
        assert row is not None
        prompt, step = kv_pool.alloc(5), kv_pool.alloc(1)
        assert prompt is not None and step is not None and prompt.device.type == "cpu"
        req_pool.write(row, 0, prompt)
        req_pool.write_each([row], [5], step)  # a decode step: one slot per request
        kv = torch.zeros(5, 2, 8, device=META)
        kv_pool.set_kv(1, prompt, kv, kv)
        k, v = kv_pool.get_kv(1, prompt)
        assert k.shape == v.shape == (5, 2, 8)
    assert k.device == kv_pool.device == req_pool.device == META


def test_torch_decode_reads_no_device_value() -> None:
    """The batched decode gathers over the longest request known on the host."""
    req_pool = ReqToTokenPool(3, 16, META)
    kv_pool = KVPool(32, 1, 2, 8, torch.float32, META)
    rows = [req_pool.alloc(), req_pool.alloc()]
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(2, dtype=torch.int64, device=META),
        positions=torch.zeros(3, 2, dtype=torch.int64, device=META),
        out_cache_loc=torch.zeros(2, dtype=torch.int64, device=META),
        req_pool_indices_list=rows,  # type: ignore[arg-type]
        prefix_lens_list=[3, 9],
        extend_lens_list=[1, 1],
        req_pool=req_pool,
        kv_pool=kv_pool,
    )
    with DeviceRules():
        slots, valid = TorchAttentionBackend().decode_index(batch)
    assert slots.shape == (2, 10) and valid.shape == (2, 1, 1, 10)


@pytest.mark.parametrize("arch", ARCHS)
def test_model_runner_steps_keep_devices_apart(
    tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunked image prefill (through the encoder cache), a decode and a mixed step of the
    tiny model with its weights, KV and tables on the device: no op mixes host and device."""
    import vision.vlm

    folder = make_checkpoint(arch, tmp_path / "ck")
    case = Checkpoint(folder).case("image", [noise_image(), "What is it?"])
    monkeypatch.setattr(vision.vlm, "load_checkpoint", lambda *args: None)  # no data on meta
    model = vision.vlm.build_model(str(folder), TPGroup(), dtype="float32", device="meta")
    cache = EncoderCache(1 << 24)
    runner = ModelRunner(
        model, max_total_tokens=256, max_running_requests=3, max_context_len=128,
        device="meta", item_encoder=cache.wrap(model.encode_items, TPGroup()),
    )
    first, second = Req(list(case.input_ids), case.mm), Req(list(case.input_ids[:7]), None)
    runner.admit(first)
    runner.admit(second)
    half = len(first.token_ids) // 2
    with DeviceRules():
        extend(runner, [first], [half])
        logits = extend(runner, [first], [len(first.token_ids) - half])
        assert logits.device == META
        first.token_ids.append(5)
        runner.decode([first])
        first.token_ids.append(6)
        runner.mixed([second], [7], [first])
    assert len(cache) == 1 and first.kv_len == len(first.token_ids)


def test_sampler_filters_on_the_device() -> None:
    """Temperature, top-k, top-p and min-p work on the logits' device with host-side settings
    (copied to the device as one block of columns); a greedy batch stays on the device until
    its tokens are read.
    (The draw itself needs a device generator, which the meta device has not.)"""
    logits = torch.zeros(3, 50, device=META)
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=1.3, top_k=-1),
    ]
    with DeviceRules():
        probs, order = filtered_probs(logits, params)
        tokens = Sampler(0).sample(logits, [SamplingParams(temperature=0.0)] * 3, [0, 1, 2])
    assert probs.device == order.device == tokens.device == META
    assert probs.shape == order.shape == (3, 50)


def copies_per_step(runner: ModelRunner, step: Callable[[list[Req]], object], n: int) -> int:
    """Host-to-device copies of one step over n text requests of 6 tokens."""
    reqs = [Req(list(range(10, 16)), None) for _ in range(n)]
    for req in reqs:
        runner.admit(req)
    with DeviceRules() as rules:
        step(reqs)
    for req in reqs:  # the request rows back (KV slots stay taken: the pool is large enough)
        runner.req_pool.free(req.req_pool_index)
    return rules.copies


def test_step_inputs_reach_the_device_in_one_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token ids, positions, KV slots and the request-table entries of a step go to the device
    as one staged copy: a step's copies do not grow with its number of requests."""
    import vision.vlm

    folder = make_checkpoint("qwen2_vl", tmp_path / "ck")
    monkeypatch.setattr(vision.vlm, "load_checkpoint", lambda *args: None)  # no data on meta
    model = vision.vlm.build_model(str(folder), TPGroup(), dtype="float32", device="meta")
    runner = ModelRunner(
        model, max_total_tokens=256, max_running_requests=4, max_context_len=64, device="meta"
    )

    def prefill(reqs: list[Req]) -> None:
        extend(runner, reqs, [6] * len(reqs))

    def decode(reqs: list[Req]) -> None:
        extend(runner, reqs, [5] * len(reqs))
        runner.decode(reqs)

    one, three = copies_per_step(runner, prefill, 1), copies_per_step(runner, prefill, 3)
    assert one == three
    assert copies_per_step(runner, decode, 1) == copies_per_step(runner, decode, 3)
    staged = HostStager(META).stage([torch.arange(4), torch.ones(3, 2, dtype=torch.int32)])
    assert [tuple(t.shape) for t in staged] == [(4,), (3, 2)]
    assert all(t.device == META and t.dtype == torch.int64 for t in staged)


def check_stager(device: str) -> None:
    stager = HostStager(device)
    for n in (3, 5000, 7):  # the middle step outgrows a pinned buffer on CUDA
        parts = [torch.arange(n), torch.arange(3 * n, dtype=torch.int32).view(3, n) - 5]
        staged = stager.stage(parts)
        for got, part in zip(staged, parts):
            assert got.device.type == torch.device(device).type and got.shape == part.shape
            assert torch.equal(got.cpu(), part.long())
    out = torch.full((4 * 5000 + 1,), -7, dtype=torch.long, device=device)
    for n in (5000, 3, 7):  # into one buffer that a replayed graph reads
        parts = [torch.arange(n) + n, torch.arange(3 * n, dtype=torch.int32).view(3, n) - 5]
        stager.stage_into(parts, out)
        assert torch.equal(out[: 4 * n].cpu(), torch.cat([parts[0], parts[1].reshape(-1)]))
    assert int(out[-1]) == -7  # nothing past the step's values


def test_stager_values_on_cpu() -> None:
    check_stager("cpu")


@pytest.mark.gpu
def test_stager_values_on_cuda() -> None:
    """Page-locked, reused buffer: each step's values arrive intact, also across a regrowth."""
    check_stager("cuda")
