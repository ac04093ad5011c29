"""Scheduler decisions in-process on one rank (no ZMQ): retraction order and its outputs."""

from __future__ import annotations

import pytest
from make_tiny_checkpoint import make_checkpoint

from runtime.distributed import TPGroup
from runtime.io_struct import TokenizedGenerateReq
from runtime.sampler import Sampler, SamplingParams
from scheduler.encoder_cache import EncoderCache
from scheduler.model_runner import ModelRunner
from scheduler.radix_cache import RadixCache
from scheduler.scheduler import Scheduler, SchedulerConfig
from vision.qwen2_vl import build_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("unit") / "ck")
    return build_model(str(folder), TPGroup(), dtype="float32")


def make_scheduler(model, kv_tokens: int) -> Scheduler:
    runner = ModelRunner(
        model, max_total_tokens=kv_tokens, max_running_requests=8, max_context_len=256
    )
    cfg = SchedulerConfig(
        max_running_requests=8, max_prefill_tokens=512, chunked_prefill_size=512, context_length=200
    )
    return Scheduler(cfg, TPGroup(), runner, RadixCache(runner.kv_pool), EncoderCache(0), Sampler())


def prompts() -> list[TokenizedGenerateReq]:
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    return [
        TokenizedGenerateReq(f"r{i}", [(i * 37 + j * 11) % 360 + 1 for j in range(20)], params)
        for i in range(3)
    ]


def run(scheduler: Scheduler) -> tuple[dict[str, list[int]], list[str]]:
    outputs: dict[str, list[int]] = {}
    retracted: list[str] = []
    result = scheduler.step(prompts())
    while True:
        for out in result.outputs:
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        if scheduler.idle:
            return outputs, retracted
        before = {r.rid for r in scheduler.running}
        result = scheduler.step([])
        gone = (
            before
            - {r.rid for r in scheduler.running}
            - {o.rid for o in result.outputs if o.finish_reason}
        )
        retracted += sorted(gone)


def test_retracts_newest_first_and_outputs_do_not_change(model) -> None:
    roomy, _ = run(make_scheduler(model, 1000))
    tight = make_scheduler(model, 130)  # 3 x (20 prompt + 40 output) does not fit
    outputs, retracted = run(tight)
    assert tight.counters.retractions > 0
    assert retracted[0] == "r2"  # the latest arrival goes first
    assert outputs == roomy
    kv = tight.runner.kv_pool
    assert kv.available_size + tight.radix.evictable_size == kv.size
