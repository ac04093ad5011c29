"""Overlapped decode (scheduler/overlap.py) in-process on the tiny checkpoint: the same tokens
and finishes as the synchronous scheduler over the same static decode buffers, with requests
arriving, ending on a stop token while their next step is in flight, aborted, and mixed with
requests that cannot overlap; nothing leaks, and the overlap really ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from device_check import DeviceRules
from dist_utils import run_on_ranks
from fault_injection import FaultInjector
from runner_utils import extend
from torch import nn

import scheduler.overlap
from runtime.distributed import TPGroup
from runtime.forward_batch import ForwardBatch
from runtime.io_struct import AbortReq, TokenizedGenerateReq
from runtime.sampler import Sampler
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from scheduler.encoder_cache import EncoderCache
from scheduler.model_runner import ModelRunner
from scheduler.overlap import OverlapDecoder
from scheduler.radix_cache import RadixCache
from scheduler.req import Req
from scheduler.scheduler import Scheduler, SchedulerConfig
from vision.vlm import build_model

FAULT_SEED = 1  # a seed whose faults hit some requests in their decode, not all
PROMPTS = [[5, 17, 3, 99, 41, 8], [7, 7, 21, 64, 2], [11, 30, 4, 58, 9, 13, 77], [3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> nn.Module:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("overlap") / "ck")
    return build_model(str(folder), TPGroup(), dtype="float32")


def make_scheduler(
    model: nn.Module, overlap: bool, tp: TPGroup | None = None, faults: FaultInjector | None = None
) -> Scheduler:
    device = str(next(model.parameters()).device)  # on CUDA the steps replay captured graphs
    runner = ModelRunner(
        model, max_total_tokens=512, max_running_requests=6, max_context_len=96,
        device=device, cuda_graph_max_bs=8,
    )  # fmt: skip
    cfg = SchedulerConfig(
        max_running_requests=5,
        max_prefill_tokens=256,
        chunked_prefill_size=256,
        context_length=90,
        enable_mixed_chunk=False,
        enable_overlap=overlap,
    )
    radix = RadixCache(runner.kv_pool)
    return Scheduler(
        cfg, tp or TPGroup(), runner, radix, EncoderCache(0), Sampler(), faults=faults
    )


def request(i: int, new: int, **kw: object) -> TokenizedGenerateReq:
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True, **kw)
    return TokenizedGenerateReq(f"r{i}", list(PROMPTS[i]), params)


def run(sched: Scheduler, arrivals: dict[int, list[object]]) -> tuple[dict, dict, int]:
    """Step until idle, sending arrivals[k] at step k; (tokens per rid, finish per rid, steps
    that returned with a decode step in flight)."""
    tokens: dict[str, list[int]] = {}
    finishes: dict[str, str] = {}
    in_flight, k = 0, 0
    while k <= max(arrivals) or not sched.idle:
        for out in sched.step(arrivals.get(k, [])).outputs:
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finishes[out.rid] = out.finish_reason.kind.value
        in_flight += sched.in_flight is not None
        k += 1
        assert k < 500
    assert_leak_free(sched)
    return tokens, finishes, in_flight


def assert_leak_free(sched: Scheduler) -> None:
    kv = sched.runner.kv_pool
    assert kv.available_size + sched.radix.evictable_size == kv.size
    assert sched.radix.protected_size == 0
    assert sched.runner.req_pool.available_size == sched.runner.req_pool.size
    sched.radix.check_integrity()


def both(model: nn.Module, arrivals: dict[int, list[object]]) -> tuple[tuple, tuple]:
    return run(make_scheduler(model, False), arrivals), run(make_scheduler(model, True), arrivals)


def test_overlapped_decode_gives_the_synchronous_tokens(model: nn.Module) -> None:
    """Requests of different lengths, one arriving while the others decode (the step in
    flight is read before its prefill)."""
    arrivals = {0: [request(0, 12), request(1, 5)], 4: [request(2, 9)], 6: [request(3, 1)]}
    (sync, sync_fin, sync_flight), (ours, fin, flight) = both(model, arrivals)
    assert ours == sync and fin == sync_fin
    assert {rid: len(t) for rid, t in ours.items()} == {"r0": 12, "r1": 5, "r2": 9, "r3": 1}
    assert sync_flight == 0 and flight > 5


def test_a_stop_token_read_after_the_next_launch_ends_the_request(model: nn.Module) -> None:
    """r0 stops on its fourth token: its next step was already launched when that token was
    read, so that step's token is dropped and its slot (the last token's K/V) is cached."""
    plain, _, _ = run(make_scheduler(model, False), {0: [request(0, 12), request(1, 10)]})
    stop = plain["r0"][3]
    first = plain["r0"].index(stop)
    arrivals = {0: [request(0, 12, stop_token_ids=[stop]), request(1, 10)]}
    (sync, sync_fin, _), (ours, fin, flight) = both(model, arrivals)
    assert ours == sync and fin == sync_fin
    assert ours["r0"] == plain["r0"][: first + 1] and fin["r0"] == "stop"
    assert ours["r1"] == plain["r1"] and flight > 3
    sched = make_scheduler(model, True)
    run(sched, arrivals)
    # the stopped request's whole sequence, its last token included, is in the prefix cache
    whole = PROMPTS[0] + plain["r0"][: first + 1]
    assert sched.radix.match_prefix(whole).slots.numel() == len(whole)


def test_an_abort_while_a_step_is_in_flight(model: nn.Module) -> None:
    """An abort (any message) reads the step in flight first; the aborted request ends, the
    other keeps its tokens, nothing leaks."""
    arrivals = {0: [request(0, 20), request(1, 15)], 5: [AbortReq("r0")]}
    (sync, sync_fin, _), (ours, fin, _) = both(model, arrivals)
    assert ours == sync and fin == sync_fin
    assert fin["r0"] == "abort" and len(ours["r1"]) == 15


def test_a_request_that_cannot_overlap_runs_the_batch_synchronously(model: nn.Module) -> None:
    """A request asking for logprobs needs the host each step: while it runs, no step is in
    flight; before it arrives and after it ends, steps overlap again."""
    arrivals = {0: [request(0, 30)], 5: [request(1, 6, logprobs=2)]}
    sched = make_scheduler(model, True)
    flights = []
    tokens: dict[str, list[int]] = {}
    k = 0
    while k <= 5 or not sched.idle:
        for out in sched.step(arrivals.get(k, [])).outputs:
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
        flights.append(sched.in_flight is not None)
        k += 1
    assert_leak_free(sched)
    sync, _, _ = run(make_scheduler(model, False), arrivals)
    assert tokens == sync
    assert any(flights[:5]) and any(flights[15:])
    assert not any(flights[7:11])  # r1 decodes here, with logprobs


def sampled(i: int, new: int, rid: str | None = None, **kw: object) -> TokenizedGenerateReq:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, **kw)
    return TokenizedGenerateReq(rid or f"r{i}", list(PROMPTS[i]), params)


def test_sampled_requests_overlap_at_tp_1(model: nn.Module) -> None:
    """Seeded sampled requests draw on the device while the next step is launched: the
    synchronous scheduler's tokens, beside a greedy one; an unseeded one draws its own tokens
    but as many, and the steps overlap throughout."""
    arrivals = {
        0: [sampled(0, 14, temperature=0.9, top_p=0.8, seed=21), request(1, 9)],
        3: [sampled(2, 10, temperature=1.4, top_k=6, min_p=0.05, seed=-5)],
        5: [sampled(3, 7, temperature=0.7)],
    }
    (sync, sync_fin, sync_flight), (ours, fin, flight) = both(model, arrivals)
    assert {rid: ours[rid] for rid in ("r0", "r1", "r2")} == {
        rid: sync[rid] for rid in ("r0", "r1", "r2")
    }
    assert fin == sync_fin and len(ours["r3"]) == 7
    assert sync_flight == 0 and flight > 8
    greedy_r0 = run(make_scheduler(model, False), {0: [request(0, 14)]})[0]["r0"]
    assert ours["r0"] != greedy_r0  # it really sampled


def test_injected_faults_fail_their_requests_while_steps_overlap(model: nn.Module) -> None:
    """The test seam's faults reach overlapped steps too: each step's requests are checked
    before it is launched, a request hit in its decode fails alone (its step in flight is
    dropped), the others keep the synchronous tokens, and nothing leaks."""
    arrivals = {0: [request(i, 16) for i in range(len(PROMPTS))]}
    plain, _, _ = run(make_scheduler(model, False), arrivals)
    faults = FaultInjector(0.05, seed=FAULT_SEED, raises_here=True)
    sched = make_scheduler(model, True, faults=faults)
    tokens, fin, flight = run(sched, arrivals)
    failed = {rid for rid, kind in fin.items() if kind == "error"}
    assert failed and len(failed) < len(PROMPTS), fin
    assert any(len(tokens.get(rid, [])) > 1 for rid in failed), "no fault hit a decode"
    for rid, want in plain.items():
        got = tokens.get(rid, [])
        assert got == (want[: len(got)] if rid in failed else want), rid
    assert sched.counters.failed == len(failed) == sched.counters.faults_injected
    assert flight > 5  # the steps really overlapped


class PoisonedModel(nn.Module):
    """The real model, with NaN logits for any row whose input id is `poison`."""

    def __init__(self, model: nn.Module, poison: int) -> None:
        super().__init__()
        self.inner, self.poison = model, poison

    def __getattr__(self, name: str) -> object:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, batch: ForwardBatch, encode: object = None) -> torch.Tensor:
        logits = self.inner(batch, encode) if encode is not None else self.inner(batch)
        ids = batch.input_ids[batch.last_token_indices][: logits.shape[0]]
        return logits.masked_fill((ids == self.poison)[:, None], float("nan"))


def test_a_row_with_bad_logits_fails_its_request_alone(model: nn.Module) -> None:
    plain, _, _ = run(make_scheduler(model, False), {0: [request(0, 10), request(1, 10)]})
    poisoned = PoisonedModel(model, plain["r0"][4])  # r0's fifth token's logits are NaN
    poisoned.eval()
    results = []
    for overlap in (False, True):
        sched = make_scheduler(poisoned, overlap)
        results.append(run(sched, {0: [request(0, 10), request(1, 10)]}))
        assert sched.counters.failed == 1
    (sync, sync_fin, _), (ours, fin, flight) = results
    assert ours == sync and fin == sync_fin and fin["r0"] == "error"
    assert ours["r1"] == plain["r1"] and flight > 3


def test_overlap_flags(tmp_path: Path) -> None:
    assert ServerArgs(device="cuda").overlap_schedule
    assert not ServerArgs(device="cuda", disable_overlap_schedule=True).overlap_schedule
    assert not ServerArgs(device="cuda", disable_cuda_graph=True).overlap_schedule
    assert not ServerArgs(device="cpu").overlap_schedule
    assert ServerArgs(device="cuda", tp_size=2).overlap_schedule


def _two_rank_overlap(tp: TPGroup, folder: str) -> list[tuple]:
    """On each of two Gloo ranks: the synchronous run (rank 0 samples and broadcasts), then the
    overlapped one (each rank picks its own tokens: the argmax, or a draw), with a stop token,
    an abort, a seeded and an unseeded sampled request."""
    model = build_model(folder, tp, dtype="float32")
    sync = run(make_scheduler(model, False, tp), {0: [request(0, 12), request(1, 8)]})
    stop = sync[0]["r0"][4]
    arrivals = {0: [request(0, 12, stop_token_ids=[stop]), request(1, 8)], 3: [request(2, 9)]}
    arrivals[7] = [AbortReq("r2")]
    arrivals[9] = [sampled(3, 10, temperature=1.2, top_p=0.95)]
    arrivals[10] = [sampled(2, 8, "s2", temperature=0.8, top_k=20, seed=99)]
    return [run(make_scheduler(model, overlap, tp), arrivals) for overlap in (False, True)]


def test_two_ranks_take_the_same_tokens_without_a_broadcast(tmp_path: Path) -> None:
    """Greedy and sampled steps overlap at tp 2: both ranks pick the same tokens with no host
    broadcast (a seeded request's are the synchronous run's; an unseeded one's are its own
    draws, the same on both ranks)."""
    folder = str(make_checkpoint("qwen2_vl", tmp_path / "ck"))
    ranks = run_on_ranks(_two_rank_overlap, 2, folder, timeout=240.0)
    (sync, sync_fin, _), (ours, fin, flight) = ranks[0]
    assert ranks[1] == ranks[0]  # the same tokens, finishes and overlapped steps on both ranks
    assert {k: v for k, v in ours.items() if k != "r3"} == {
        k: v for k, v in sync.items() if k != "r3"
    }
    assert fin == sync_fin and flight > 8 and len(ours["r3"]) == 10
    assert fin["r0"] == "stop" and fin["r2"] == "abort" and len(ours["r1"]) == 8
    assert len(ours["s2"]) == 8


@pytest.mark.gpu
def test_overlapped_decode_on_cuda_graphs(tmp_path: Path) -> None:
    """On a GPU the steps are replayed graphs, their tokens copied back without a wait."""
    folder = make_checkpoint("qwen2_vl", tmp_path / "ck")
    cuda_model = build_model(str(folder), TPGroup(), dtype="float32", device="cuda")
    stop = run(make_scheduler(cuda_model, False), {0: [request(0, 12)]})[0]["r0"][5]
    arrivals = {0: [request(0, 12, stop_token_ids=[stop]), request(1, 5)]}
    arrivals[4] = [sampled(2, 9, temperature=0.9, top_p=0.9, seed=3)]  # drawn on the device
    (sync, sync_fin, _), (ours, fin, flight) = both(cuda_model, arrivals)
    assert ours == sync and fin == sync_fin and flight > 3


def test_a_launch_reads_nothing_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the meta device under DeviceRules: launching a step, fresh or after one in flight
    (its ids gathered on the device), reads no device value on the host and mixes no host
    tensor into a device op; each launch is one staged copy (the copy back is left out: meta
    tensors hold no values to copy)."""
    import vision.vlm

    folder = make_checkpoint("qwen2_vl", tmp_path / "ck")
    monkeypatch.setattr(vision.vlm, "load_checkpoint", lambda *args: None)  # no data on meta
    monkeypatch.setattr(scheduler.overlap, "copy_to_host", lambda values: (values, None))
    meta_model = vision.vlm.build_model(str(folder), TPGroup(), dtype="float32", device="meta")
    runner = ModelRunner(
        meta_model, max_total_tokens=256, max_running_requests=4, max_context_len=64,
        device="meta", cuda_graph_max_bs=4,
    )  # fmt: skip
    reqs = [Req(list(p), None) for p in PROMPTS[:3]]
    for req in reqs:
        runner.admit(req)
    extend(runner, reqs, [len(r.token_ids) for r in reqs])
    for req in reqs:
        req.token_ids.append(3)
    decoder = OverlapDecoder(runner)
    with DeviceRules() as rules:
        first = decoder.launch(reqs, None)
    assert rules.copies == 1 and first.tokens.device.type == "meta"
    with DeviceRules() as rules:
        second = decoder.launch([reqs[2], reqs[0]], first)
    assert rules.copies == 1 and second.tokens.shape == (2,)
    # in flight: each request's kv_len counts the slots its launched steps write
    assert [r.kv_len - len(r.token_ids) for r in reqs] == [1, 0, 1]
