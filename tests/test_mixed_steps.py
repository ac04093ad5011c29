"""Mixed steps (--enable-mixed-chunk) in-process on one rank, over a fake model: a step carries
the chunked prefill and the running decodes in one forward, outputs do not change, and
retraction, aborts and request faults leave nothing behind."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fault_injection import FaultInjector

from runtime.distributed import TPGroup
from runtime.forward_batch import ForwardBatch
from runtime.io_struct import AbortReq, TokenizedGenerateReq
from runtime.memory_pool import KVPool, ReqToTokenPool
from runtime.sampler import Sampler
from runtime.sampling_params import SamplingParams
from scheduler.encoder_cache import EncoderCache
from scheduler.input_checks import RequestFaults
from scheduler.model_runner import ModelRunner
from scheduler.radix_cache import RadixCache
from scheduler.scheduler import Scheduler, SchedulerConfig, StepResult

VOCAB = 97


class RecordingModel:
    """Next token = a function of the last token and its position; remembers every batch."""

    def __init__(self) -> None:
        self.batches: list[ForwardBatch] = []
        self.plan_counts: dict[str, int] = {}

    def __call__(self, batch: ForwardBatch, encode: object = None) -> torch.Tensor:
        self.batches.append(batch)
        last = batch.last_token_indices
        nxt = (batch.input_ids[last] * 7 + batch.positions[0, last] + 3) % VOCAB
        return F.one_hot(nxt, VOCAB).float()


class FakeRunner(ModelRunner):
    """The real runner's batching and KV bookkeeping over real pools, with a fake model."""

    def __init__(self, kv_tokens: int, max_running: int = 8) -> None:
        self.model, self.device, self.item_encoder = RecordingModel(), "cpu", None
        self.req_pool = ReqToTokenPool(max_running, 256, "cpu")
        self.kv_pool = KVPool(kv_tokens, 1, 1, 4, torch.float32, "cpu")
        self.macs_per_token = self.macs_per_context = 0  # every decode step counts as small
        self.bidirectional_items = False


def make_scheduler(
    kv_tokens: int, mixed: bool, chunk: int = 8, faults: RequestFaults | None = None, **kw: object
) -> Scheduler:
    runner = FakeRunner(kv_tokens)
    cfg = SchedulerConfig(
        max_running_requests=6,
        max_prefill_tokens=64,
        chunked_prefill_size=chunk,
        context_length=200,
        enable_mixed_chunk=mixed,
        **kw,
    )
    cache = EncoderCache(0)
    radix = RadixCache(runner.kv_pool)
    return Scheduler(cfg, TPGroup(), runner, radix, cache, Sampler(), faults=faults)


def request(rid: str, prompt_len: int, new: int = 12, seed: int = 0) -> TokenizedGenerateReq:
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    ids = [(seed * 31 + j * 13) % (VOCAB - 1) + 1 for j in range(prompt_len)]
    return TokenizedGenerateReq(rid, ids, params)


def drain(sched: Scheduler, first: StepResult, outputs: dict) -> dict[str, list[int]]:
    result = first
    while True:
        for out in result.outputs:
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        if sched.idle:
            return outputs
        result = sched.step([])


def run(sched: Scheduler, msgs: list[TokenizedGenerateReq]) -> dict[str, list[int]]:
    """One short request decodes; then long prompts arrive and prefill in chunks."""
    outputs: dict[str, list[int]] = {}
    result = sched.step(msgs[:1])
    for _ in range(2):
        for out in result.outputs:
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        result = sched.step([])
    for out in result.outputs:
        outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    return drain(sched, sched.step(msgs[1:]), outputs)


def workload() -> list[TokenizedGenerateReq]:
    return [request("short", 5, new=20), request("long", 40, seed=1), request("long2", 30, seed=2)]


def assert_leak_free(sched: Scheduler) -> None:
    kv = sched.runner.kv_pool
    assert kv.available_size + sched.radix.evictable_size == kv.size
    assert sched.radix.protected_size == 0
    assert sched.runner.req_pool.available_size == sched.runner.req_pool.size


def test_the_setting_has_one_default_the_server_args_one() -> None:
    """A scheduler config states the setting (build_scheduler passes the flag): a second
    default here disagreed with ServerArgs' (off here, on in the server)."""
    with pytest.raises(TypeError, match="enable_mixed_chunk"):
        SchedulerConfig(  # type: ignore[call-arg]
            max_running_requests=2, max_prefill_tokens=8, chunked_prefill_size=8, context_length=16
        )


def test_a_step_carries_the_chunked_prefill_and_the_decodes() -> None:
    sched = make_scheduler(1000, mixed=True)
    outputs = run(sched, workload())
    mixed = [b for b in sched.runner.model.batches if b.decode_tail]
    assert mixed, "no step carried prefill and decodes together"
    for batch in mixed:
        assert batch.extend_count >= 1 and max(batch.extend_lens_list[: batch.extend_count]) > 1
        assert batch.extend_lens_list[batch.extend_count :] == [1] * batch.decode_tail
    assert sched.counters.mixed_steps == len(mixed)
    assert {r.rid: r.sampling_params.max_new_tokens for r in workload()} == {
        rid: len(tokens) for rid, tokens in outputs.items()
    }
    plain = make_scheduler(1000, mixed=False)
    run(plain, workload())
    assert plain.counters.mixed_steps == 0
    assert not any(b.decode_tail for b in plain.runner.model.batches)
    assert sched.counters.decode_steps < plain.counters.decode_steps


def test_the_short_request_decodes_while_the_long_one_prefills() -> None:
    sched = make_scheduler(1000, mixed=True)
    sched.step([request("short", 5, new=30)])
    sched.step([])
    result = sched.step([request("long", 40, seed=1)])  # 5 chunks of 8
    tokens = 0
    while sched.chunked is not None or sched.waiting:
        tokens += sum(len(o.new_token_ids) for o in result.outputs if o.rid == "short")
        result = sched.step([])
    assert tokens >= 4  # one token per chunk step; without mixing, none


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "plain"])
def test_while_requests_decode_a_mixed_step_computes_one_chunk_in_all(mixed: bool) -> None:
    """Prompts of 6 tokens, chunks of 8, batches of 64: with nothing running a step takes them
    all; once a request decodes, a mixed step takes one chunk's worth (the rest wait a step),
    so the running request's next token waits for 8 prompt tokens, not 48. Without mixed steps
    the running request waits for the prefill steps anyway: they stay whole batches."""
    sched = make_scheduler(1000, mixed=mixed)
    sched.step([request(f"a{i}", 6, new=30, seed=i) for i in range(3)])
    assert len(sched.runner.model.batches[-1].extend_lens_list) == 3  # 18 tokens, one step
    sched.step([request(f"b{i}", 6, new=30, seed=10 + i) for i in range(3)])
    batch = sched.runner.model.batches[-1]
    prompt_tokens = sum(batch.extend_lens_list[: batch.extend_count])
    if mixed:
        assert prompt_tokens <= 8 and batch.decode_tail == 3
        assert len(sched.waiting) + (sched.chunked is not None) >= 1
    else:
        assert prompt_tokens == 18 and batch.decode_tail == 0
    outputs: dict[str, list[int]] = {}
    drain(sched, sched.step([]), outputs)
    assert_leak_free(sched)


@pytest.mark.parametrize("kv_tokens", [1000, 70], ids=["roomy", "tight"])
def test_outputs_equal_without_mixing(kv_tokens: int) -> None:
    plain = make_scheduler(kv_tokens, mixed=False)
    mixed = make_scheduler(kv_tokens, mixed=True)
    assert run(mixed, workload()) == run(plain, workload())
    assert mixed.counters.mixed_steps > 0
    assert_leak_free(mixed)
    if kv_tokens == 70:
        assert mixed.counters.retractions > 0


def test_abort_mid_mixed_step_frees_everything() -> None:
    sched = make_scheduler(1000, mixed=True)
    sched.step([request("short", 5, new=40)])
    sched.step([request("long", 40, seed=1)])
    assert sched.chunked is not None and sched.running
    result = sched.step([AbortReq("short"), AbortReq("long")])
    finishes = {o.rid: o.finish_reason for o in result.outputs if o.finish_reason}
    assert {k: v.kind.value for k, v in finishes.items()} == {"short": "abort", "long": "abort"}
    assert sched.idle
    assert_leak_free(sched)


def test_request_faults_in_mixed_steps_fail_alone() -> None:
    faults = FaultInjector(0.05, seed=3, raises_here=True)  # one rank: the last one
    sched = make_scheduler(1000, mixed=True, faults=faults)
    msgs = [request(f"r{i}", 10 + 7 * i, new=16, seed=i) for i in range(6)]
    outputs: dict[str, list[int]] = {}
    result = sched.step(msgs[:2])
    result = drain_some(sched, result, outputs, 3)
    final = drain(sched, sched.step(msgs[2:]), outputs)
    assert sched.counters.failed > 0 and sched.counters.mixed_steps > 0
    assert sched.counters.failed < len(msgs)
    assert len(final) == len(msgs)
    assert_leak_free(sched)


def drain_some(sched: Scheduler, result: StepResult, outputs: dict, steps: int) -> StepResult:
    for _ in range(steps):
        for out in result.outputs:
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        result = sched.step([])
    return result


def test_small_mixed_steps_run_on_one_thread_like_small_decodes() -> None:
    """A mixed step of a few new tokens (a short chunk riding with decodes, or jump-forward's
    forced runs) is as small as a decode step and gets its one thread; a long extend keeps
    every thread."""
    threads_seen: list[tuple[int, int]] = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sched = make_scheduler(400, mixed=True, chunk=64)
        sched.runner.macs_per_token = 1 << 20  # 16 new tokens or more: not small
        inner = sched.runner.model

        def recording(batch: ForwardBatch, encode: object = None) -> torch.Tensor:
            threads_seen.append((int(batch.input_ids.numel()), torch.get_num_threads()))
            return inner(batch, encode)

        sched.runner.model = recording
        drain(sched, sched.step([request("long", 40)]), {})
        drain(sched, sched.step([request("a", 3, seed=1)]), {})
        sched.step([request("b", 2, new=4, seed=2)])
        drain(sched, sched.step([request("c", 3, seed=3)]), {})
    finally:
        torch.set_num_threads(before)
    assert (40, 2) in threads_seen  # the long prefill keeps both threads
    small = [t for n, t in threads_seen if n < 16]
    assert small and set(small) == {1}, threads_seen
    assert any(n > 1 for n, _ in threads_seen if n < 16)  # some small step was an extend
