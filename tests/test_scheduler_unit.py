"""Scheduler decisions in-process on one rank (no ZMQ): retraction order and its outputs, a
small request's admission while big ones fill the KV pool, and encoder-cache pins held across
the chunks of an image."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from vlm_cases import Checkpoint, gradient_image

from runtime.distributed import TPGroup
from runtime.io_struct import (
    AbortReq,
    BatchStrOut,
    ItemEmbeddings,
    TokenizedGenerateReq,
    UnknownMessage,
)
from runtime.multimodal import Modality, MultimodalDataItem, MultimodalInputs
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from scheduler import model_runner
from scheduler.process import build_scheduler
from scheduler.req import Req
from scheduler.schedule_policy import MAX_RETRACTIONS, PREEMPT_AFTER_STEPS
from scheduler.scheduler import Scheduler
from vision.vlm import build_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("unit") / "ck")


@pytest.fixture(scope="module")
def model(folder: Path):
    return build_model(str(folder), TPGroup(), dtype="float32")


def make_scheduler(
    model,
    kv_tokens: int,
    chunk: int = 512,
    encoder_cache_mb: int = 0,
    radix: bool = True,
    decode_threads: int = 0,
    encoder_patches: int = 0,
    mixed: bool = False,
    context: int = 200,
    max_running: int = 8,
) -> Scheduler:
    args = ServerArgs(
        device="cpu",
        cpu_decode_threads=decode_threads,
        max_encoder_patches_per_step=encoder_patches,
        enable_mixed_chunk=mixed,
        max_total_tokens=kv_tokens,
        max_running_requests=max_running,
        max_prefill_tokens=512,
        chunked_prefill_size=chunk,
        context_length=context,
        mm_cache_size_mb=encoder_cache_mb,
        disable_radix_cache=not radix,
    )
    return build_scheduler(args, TPGroup(), model)


def prompts(lengths: tuple[int, ...] = (20, 20, 20)) -> list[TokenizedGenerateReq]:
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    return [
        TokenizedGenerateReq(f"r{i}", [(i * 37 + j * 11) % 360 + 1 for j in range(n)], params)
        for i, n in enumerate(lengths)
    ]


def run(
    scheduler: Scheduler, lengths: tuple[int, ...] = (20, 20, 20)
) -> tuple[dict[str, list[int]], list[str]]:
    outputs: dict[str, list[int]] = {}
    retracted: list[str] = []
    result = scheduler.step(prompts(lengths))
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


def test_the_factory_takes_the_mixed_steps_setting_from_server_args(model) -> None:
    default = ServerArgs(device="cpu", max_total_tokens=500, context_length=200)
    assert build_scheduler(default, TPGroup(), model).cfg.enable_mixed_chunk is True
    assert make_scheduler(model, 500, mixed=False).cfg.enable_mixed_chunk is False


def test_retracts_the_largest_holder_first_and_outputs_do_not_change(model) -> None:
    lengths = (40, 20, 20)
    roomy, _ = run(make_scheduler(model, 1000), lengths)
    tight = make_scheduler(model, 150)  # 40 + 20 + 20 prompt + 3 x 40 output does not fit
    outputs, retracted = run(tight, lengths)
    assert tight.counters.retractions > 0
    assert retracted[0] == "r0"  # the one holding the most goes first, not the latest arrival
    assert outputs == roomy
    assert_idle_and_clean(tight)


def assert_idle_and_clean(scheduler: Scheduler) -> None:
    kv = scheduler.runner.kv_pool
    assert kv.available_size + scheduler.radix.evictable_size == kv.size
    assert scheduler.radix.protected_size == 0


def generate_req(
    rid: str, prompt_len: int, new: int, n: int = 1, seed: int = 0
) -> TokenizedGenerateReq:
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True, n=n)
    ids = [(seed * 37 + j * 11) % 360 + 1 for j in range(prompt_len)]
    return TokenizedGenerateReq(rid, ids, params)


@dataclass
class Trace:
    """What a scheduler did with its requests, step by step."""

    tokens: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)  # rid -> step of its first token
    sent_at: dict[str, int] = field(default_factory=dict)
    finishes: dict[tuple[str, int], dict] = field(default_factory=dict)
    reqs: dict[int, Req] = field(default_factory=dict)  # every Req seen, by id (identity)


def drive(scheduler: Scheduler, first: list, later=None, max_steps: int = 5000) -> Trace:
    """Step until idle; `later(step, scheduler)` returns the requests to send at that step."""
    trace, step, msgs = Trace(), 0, first
    while step == 0 or not scheduler.idle:
        assert step < max_steps, "the scheduler did not finish"
        for msg in msgs:
            trace.sent_at[msg.rid] = step
        result = scheduler.step(msgs)
        for out in result.outputs:
            key = (out.rid, out.index)
            trace.tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.new_token_ids:
                trace.first_step.setdefault(out.rid, step)
            if out.finish_reason:
                trace.finishes[key] = out.finish_reason.to_json()
        for req in [*scheduler.running, *scheduler.waiting]:
            trace.reqs[id(req)] = req
        step += 1
        msgs = later(step, scheduler) if later else []
    return trace


def test_a_small_request_is_admitted_within_bounded_steps_while_big_ones_fill_the_pool(
    model,
) -> None:
    """Four requests of 40 + 400 tokens in a 1,000-token pool; once it is full (the first
    retraction), a 20 + 8 one arrives. It waits PREEMPT_AFTER_STEPS steps for free KV, then
    takes KV from the largest holder (before: it waited for a big one to end, about 270 steps,
    and the newest request was the first to go). Outputs are those of a roomy pool."""
    bigs = [generate_req(f"big{i}", 40, 400, seed=i) for i in range(4)]
    small = generate_req("small", 20, 8, seed=99)
    sent: list[int] = []

    def once_full(step: int, scheduler: Scheduler) -> list:
        if sent or scheduler.counters.retractions == 0:
            return []
        sent.append(step)
        return [small]

    tight = make_scheduler(model, 1000, context=1000, max_running=16)
    trace = drive(tight, bigs, once_full)
    waited = trace.first_step["small"] - trace.sent_at["small"]
    assert waited <= PREEMPT_AFTER_STEPS + 2, waited
    assert tight.counters.admission_preemptions >= 1
    roomy = drive(make_scheduler(model, 4000, context=1000, max_running=16), [*bigs, small])
    assert trace.tokens == roomy.tokens
    assert max(r.retractions for r in trace.reqs.values()) <= MAX_RETRACTIONS
    assert_idle_and_clean(tight)


def test_retractions_and_recomputed_tokens_stay_bounded(model) -> None:
    """Two long requests and four choices of a third in a 1,000-token pool: no request is
    retracted more than MAX_RETRACTIONS times, and what is computed again stays under that
    many times the largest request (before: one was retracted three times, and 2,800 tokens
    were computed again, 2,400 more than in a roomy pool)."""
    msgs = [
        generate_req("r0", 96, 63, n=4, seed=1),
        generate_req("r1", 175, 446, seed=2),
        generate_req("r2", 187, 383, seed=3),
    ]
    roomy_scheduler = make_scheduler(model, 8000, context=1000, max_running=16)
    roomy = drive(roomy_scheduler, msgs)
    tight = make_scheduler(model, 1000, context=1000, max_running=16)
    trace = drive(tight, msgs)
    assert tight.counters.retractions > 0
    assert max(r.retractions for r in trace.reqs.values()) <= MAX_RETRACTIONS
    again = tight.counters.prompt_tokens_computed - roomy_scheduler.counters.prompt_tokens_computed
    assert again <= MAX_RETRACTIONS * (187 + 383), again
    assert trace.tokens == roomy.tokens
    assert_idle_and_clean(tight)


def test_choices_that_cannot_fit_the_pool_together_are_refused(model) -> None:
    """n x max_tokens beyond the KV pool (the choices share the prompt): every choice is
    refused at once, naming n, and nothing runs; choices that fit together run."""
    tight = make_scheduler(model, 1000, context=1000, max_running=16)
    trace = drive(tight, [generate_req("many", 20, 150, n=8)])  # 20 + 8 x 150 > 1000
    assert len(trace.finishes) == 8
    for finish in trace.finishes.values():
        assert finish["type"] == "error" and finish["status"] == 400
        assert "n=8" in finish["detail"]
    assert tight.counters.prompt_tokens_computed == 0
    fits = drive(tight, [generate_req("fits", 20, 150, n=6)])  # 20 + 6 x 150 <= 1000
    assert {f["type"] for f in fits.finishes.values()} == {"length"}
    assert_idle_and_clean(tight)


def test_an_image_cut_by_chunks_stays_pinned_until_its_last_row(model, folder: Path) -> None:
    case = Checkpoint(folder).case("image", [gradient_image((112, 112)), "What is it?"])
    (item,) = case.mm.items
    start, end = item.offsets[0]
    assert end - start >= 16  # the image spans several 6-token chunks
    scheduler = make_scheduler(model, 1000, chunk=6, encoder_cache_mb=1)
    cache = scheduler.encoder_cache
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    scheduler.step([TokenizedGenerateReq("img", case.input_ids, params, case.mm)])
    pinned_steps = 0
    while scheduler.chunked is not None or scheduler.waiting:
        req = scheduler.chunked
        inside = req is not None and start < req.kv_len < end
        assert (cache.stats().pins == 1) == inside, (req and req.kv_len, start, end)
        if inside:
            pinned_steps += 1
            # a pinned entry survives a store that needs all of the capacity
            assert not cache.put(-1, torch.zeros(1 << 18))  # 1 MiB of float32
            assert item.hash in cache
        scheduler.step([])
    assert pinned_steps >= 2
    assert cache.counters.items_encoded == 1  # every chunk after the first read the cache
    while not scheduler.idle:
        scheduler.step([])
    assert cache.stats().pins == 0


def test_first_output_carries_the_scheduler_stage_times(model, folder: Path) -> None:
    """Queue wait, encoder and prefill seconds leave the scheduler once, with the first token;
    a request that waits behind a chunked prefill shows its wait, a text one no encoder time."""
    case = Checkpoint(folder).case("image", [gradient_image((112, 112)), "What is it?"])
    sched = make_scheduler(model, 1000, chunk=16, encoder_cache_mb=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    image = TokenizedGenerateReq("img", case.input_ids, params, case.mm)
    outputs = sched.step([image, TokenizedGenerateReq("txt", [5, 6, 7, 8], params)]).outputs
    while not sched.idle:
        outputs += sched.step([]).outputs
    timed = [o for o in outputs if o.stages is not None]
    assert sorted(o.rid for o in timed) == ["img", "txt"]
    assert all(o.new_token_ids and o.completion_tokens == 1 for o in timed)
    stages = {o.rid: o.stages for o in timed}
    assert 0 <= stages["img"].queue < stages["txt"].queue  # txt waited for img's chunks
    assert 0 < stages["img"].encoder <= stages["img"].prefill
    assert stages["txt"].encoder == 0 < stages["txt"].prefill


def test_requests_compare_by_identity_not_by_fields() -> None:
    """Two requests with equal fields (tensors included) are still two requests: membership,
    removal and equality never touch the fields (which would raise on the tensors)."""
    a = Req(token_ids=[1, 2, 3], mm=torch.ones(2, 2), rid="x")
    b = Req(token_ids=[1, 2, 3], mm=torch.ones(2, 2), rid="x")
    assert a != b and a == a
    assert b not in [a] and a in [b, a]
    assert [b, a].index(a) == 1


def test_request_constants_go_to_the_detokenizer_once(model) -> None:
    """Stop strings and detokenization options leave the scheduler at admission only."""
    sched = make_scheduler(model, kv_tokens=256)
    params = SamplingParams(temperature=0, max_new_tokens=3, stop=["x" * 200], ignore_eos=True)
    first = sched.step([TokenizedGenerateReq("s", [1, 2, 3, 4], params)])
    assert [(s.rid, s.stop) for s in first.started] == [("s", ("x" * 200,))]
    later = [sched.step([]) for _ in range(4)]
    assert all(not r.started for r in later)
    assert sum(len(o.new_token_ids) for r in [first, *later] for o in r.outputs) == 3


def record_step_threads(
    scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, int]]:
    """(mode, intra-op threads) of every forward the scheduler's runner runs from now on."""
    seen: list[tuple[str, int]] = []
    forward = scheduler.runner._run

    def recording_run(mode, *args, **kwargs):
        seen.append((mode.name, torch.get_num_threads()))
        return forward(mode, *args, **kwargs)

    monkeypatch.setattr(scheduler.runner, "_run", recording_run)
    return seen


@pytest.mark.parametrize("small", [True, False], ids=["small-step", "large-step"])
def test_small_cpu_decode_steps_run_on_one_thread(
    model, monkeypatch: pytest.MonkeyPatch, small: bool
) -> None:
    """A step under SMALL_STEP_MACS (the tiny model's decodes and short prefills alike) runs on
    one intra-op thread and gives the threads back afterwards; a larger one (here: the limits
    set to 1) keeps them. Outputs are the same."""
    if not small:
        monkeypatch.setattr(model_runner, "SMALL_STEP_MACS", 1)
        monkeypatch.setattr(model_runner, "DECODE_ONE_THREAD_MACS", 1)
    scheduler = make_scheduler(model, kv_tokens=1024)
    seen = record_step_threads(scheduler, monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outputs, _ = run(scheduler)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert {mode for mode, _ in seen} == {"DECODE", "EXTEND"}
    assert {n for _, n in seen} == ({1} if small else {2})
    assert outputs == run(make_scheduler(model, kv_tokens=1024))[0]


def test_cpu_decode_step_threads_follow_its_size_and_the_override() -> None:
    """A decode step (prompt part under SMALL_STEP_MACS) runs on one thread below
    DECODE_ONE_THREAD_MACS whatever the rank's threads, on all of them above; a prefill keeps
    every thread; --cpu-decode-threads sets a decode step's threads, capped at the rank's."""
    small, decode_limit = model_runner.SMALL_STEP_MACS, model_runner.DECODE_ONE_THREAD_MACS
    rule = model_runner.step_threads
    hd64_16_requests = 16 * 12 * 2**20  # a 12 M-weight decoder, 16 decode tokens
    assert rule(2, 0, hd64_16_requests) == 1
    assert rule(8, small - 1, decode_limit - 1) == 1  # a short chunk riding with decodes
    assert rule(2, 0, decode_limit) == 2 and rule(8, 0, 7 * 10**9) == 8
    assert rule(4, small, small) == 4  # a prefill: every thread
    assert rule(4, 0, hd64_16_requests, decode_threads=2) == 2
    assert rule(2, 0, hd64_16_requests, decode_threads=3) == 2
    assert rule(4, small, small, decode_threads=1) == 4  # the override is for decode steps


def test_cpu_decode_threads_flag_sets_a_decode_steps_threads(
    model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--cpu-decode-threads 2 runs the tiny model's decode steps on two of the rank's three
    threads (the rule alone would give one); its prefills keep all three. A negative count is
    refused."""
    assert ServerArgs.from_cli(["--cpu-decode-threads", "2"]).cpu_decode_threads == 2
    with pytest.raises(ValueError, match="--cpu-decode-threads"):
        ServerArgs(cpu_decode_threads=-1).check()
    monkeypatch.setattr(model_runner, "SMALL_STEP_MACS", 1)  # every prefill is large
    scheduler = make_scheduler(model, kv_tokens=1024, decode_threads=2)
    seen = record_step_threads(scheduler, monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        run(scheduler)
    finally:
        torch.set_num_threads(threads)
    assert set(seen) == {("DECODE", 2), ("EXTEND", 3)}


@pytest.mark.parametrize("device, threads", [("cuda", 2), ("cpu", 1)])
def test_thread_rule_skips_the_step_size_where_it_cannot_matter(
    model, monkeypatch: pytest.MonkeyPatch, device: str, threads: int
) -> None:
    """A GPU step, or a CPU process already on one thread, never sums the step's work."""
    runner = make_scheduler(model, kv_tokens=256).runner
    runner.device = device

    def no_sum(*args: object) -> int:
        raise AssertionError("the step's MACs were summed")

    monkeypatch.setattr(runner, "_step_macs", no_sum)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with runner._threads_for([], [], 0):
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_a_message_outside_the_channels_union_is_a_loud_error(model) -> None:
    sched = make_scheduler(model, 400)
    with pytest.raises(UnknownMessage, match="tokenizer -> scheduler: unknown message BatchStrOut"):
        sched.step([BatchStrOut([])])


def test_a_wave_on_one_image_prefills_the_image_once(model, folder: Path) -> None:
    """Chats that start alike (the same image) and arrive together: the first computes the
    shared start, the others wait one step and compute only their own tails; outputs are those
    of a scheduler without the prefix cache, which computes every prompt whole."""
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    image = gradient_image((112, 112))
    cases = [Checkpoint(folder).case("image", [image, f"word {i}"]) for i in range(4)]

    def wave() -> list[TokenizedGenerateReq]:
        return [
            TokenizedGenerateReq(f"c{i}", case.input_ids, params, case.mm)
            for i, case in enumerate(cases)
        ]

    def serve(scheduler: Scheduler) -> dict[str, list[int]]:
        outputs: dict[str, list[int]] = {}
        result = scheduler.step(wave())
        while True:
            for out in result.outputs:
                outputs.setdefault(out.rid, []).extend(out.new_token_ids)
            if scheduler.idle:
                return outputs
            result = scheduler.step([])

    shared = make_scheduler(model, 2000, encoder_cache_mb=1)
    outputs = serve(shared)
    plain = make_scheduler(model, 2000, encoder_cache_mb=1, radix=False)
    assert outputs == serve(plain)
    whole = sum(len(c.input_ids) for c in cases)
    assert plain.counters.prompt_tokens_computed == whole
    start = next(i for i, ids in enumerate(zip(*(c.input_ids for c in cases))) if len(set(ids)) > 1)
    assert start > 16  # the image and the template before it
    assert shared.counters.prompt_tokens_computed <= whole - 3 * (start - 1)
    assert shared.counters.deferred_to_share == 3
    assert shared.encoder_cache.counters.items_encoded == 1


@pytest.mark.parametrize("mixed", [False, True])
def test_a_burst_of_images_is_encoded_over_steps_within_the_budget(
    model, folder: Path, mixed: bool
) -> None:
    """Three image chats (64, 80 and 80 patches) and a text chat arrive in one step. With a
    budget of 100 patches a step, each step encodes one image: the first image's request and
    the text one (which passes the images put off) prefill at once, the other two in the next
    steps, and their outputs are those of a scheduler without the budget, which encodes all
    three in the first step. With mixed steps, the running requests decode in those steps."""
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    sizes = [(112, 112), (112, 140), (140, 112)]
    cases = [
        Checkpoint(folder).case("image", [gradient_image(size), f"word {i}"])
        for i, size in enumerate(sizes)
    ]
    assert [c.mm.items[0].grid_thw for c in cases] == [(1, 8, 8), (1, 8, 10), (1, 10, 8)]

    def burst() -> list[TokenizedGenerateReq]:
        text = [(j * 13) % 360 + 1 for j in range(24)]
        chats = [
            TokenizedGenerateReq(f"i{i}", case.input_ids, params, case.mm)
            for i, case in enumerate(cases)
        ]
        return [*chats, TokenizedGenerateReq("text", text, params)]

    def serve(scheduler: Scheduler) -> tuple[dict[str, list[int]], list[int], list[set[str]]]:
        outputs: dict[str, list[int]] = {}
        encoded, firsts, incoming = [], [], burst()
        while incoming or not scheduler.idle:
            result = scheduler.step(incoming)
            incoming = []
            encoded.append(scheduler.encoder_cache.counters.items_encoded)
            firsts.append({o.rid for o in result.outputs if o.rid not in outputs})
            for out in result.outputs:
                outputs.setdefault(out.rid, []).extend(out.new_token_ids)
        return outputs, encoded, firsts

    # no prefix cache: its own deferral (a batch-mate with the same template start) is not
    # what this test is about
    bounded = make_scheduler(
        model, 2000, encoder_cache_mb=1, radix=False, encoder_patches=100, mixed=mixed
    )
    outputs, encoded, firsts = serve(bounded)
    plain = make_scheduler(model, 2000, encoder_cache_mb=1, radix=False, mixed=mixed)
    plain_outputs, plain_encoded, plain_firsts = serve(plain)
    assert outputs == plain_outputs and all(len(t) == 3 for t in outputs.values())
    assert plain_encoded[0] == 3 and plain_firsts[0] == {"i0", "i1", "i2", "text"}
    assert encoded[:3] == [1, 2, 3]
    assert firsts[:3] == [{"i0", "text"}, {"i1"}, {"i2"}]
    assert bounded.counters.encoder_deferred == 3  # i1 and i2 in step 1, i2 in step 2
    assert plain.counters.encoder_deferred == 0
    assert (bounded.counters.mixed_steps == 2) == mixed  # steps 2 and 3 carried i0 and text
    kv = bounded.runner.kv_pool
    assert kv.available_size + bounded.radix.evictable_size == kv.size


def test_a_chunk_gives_the_encoder_the_items_it_enters() -> None:
    """An item is encoded whole by the chunk that enters its placeholder run; the chunks
    after it read the stored embedding."""
    item = MultimodalDataItem(Modality.IMAGE, offsets=[(10, 26)], grid_thw=(1, 8, 8))
    video = MultimodalDataItem(Modality.VIDEO, offsets=[(30, 40), (42, 52)], grid_thw=(2, 4, 4))
    req = Req(list(range(60)), mm=MultimodalInputs([item, video], torch.zeros(3, 60)))
    assert req.patches_entered(0, 10) == 0
    assert req.patches_entered(0, 11) == 64
    assert req.patches_entered(11, 30) == 0  # inside the image: already entered
    assert req.patches_entered(11, 31) == 32
    assert req.patches_entered(0, 60) == 96
    assert Req(list(range(5))).patches_entered(0, 5) == 0


def test_the_encoder_budget_flag_refuses_a_negative_value() -> None:
    with pytest.raises(ValueError, match="max-encoder-patches-per-step"):
        ServerArgs(max_encoder_patches_per_step=-1).check()


def test_a_prompt_that_ends_does_not_wait_for_the_next_ones_first_chunk(model) -> None:
    """Two 150-token prompts at once, chunks of 64: the first one's last chunk (22 tokens) runs
    alone, so its first token comes after 150 prompt tokens of work, not after 150 plus the
    second one's first chunk (before: steps of 64, 22 + 64, 64, 22: 214 tokens for the first)."""
    scheduler = make_scheduler(model, kv_tokens=2048, chunk=64)
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    msgs = [
        TokenizedGenerateReq(f"long{i}", [(i * 53 + j * 7) % 360 + 1 for j in range(150)], params)
        for i in range(2)
    ]
    computed, firsts, incoming = [], {}, msgs
    while len(firsts) < 2:
        before = scheduler.counters.prompt_tokens_computed
        result = scheduler.step(incoming)
        incoming = []
        computed.append(scheduler.counters.prompt_tokens_computed - before)
        for out in result.outputs:
            firsts.setdefault(out.rid, sum(computed))
    assert firsts == {"long0": 150, "long1": 300}, (firsts, computed)
    assert computed[:3] == [64, 64, 22]  # then the second prompt's chunks
    while not scheduler.idle:
        scheduler.step([])
    kv = scheduler.runner.kv_pool
    assert kv.available_size + scheduler.radix.evictable_size == kv.size


def test_server_info_does_not_walk_the_frozen_objects(model, monkeypatch) -> None:
    """/server_info and every /metrics scrape ask the rank for its info between two steps:
    counting the frozen generation there walked 173k objects (about 2 ms) each time."""
    import gc

    def walk() -> int:
        raise AssertionError("gc.get_freeze_count() walks the whole permanent generation")

    scheduler = make_scheduler(model, kv_tokens=512)
    monkeypatch.setattr(gc, "get_freeze_count", walk)
    info = scheduler.server_info()
    assert info.gc_frozen == 0  # this test process never froze its start-up objects


def awaited_case(folder: Path, rid: str, params: SamplingParams, first: int = 0) -> tuple:
    """A chat with text before its image (words from `first` on), as `--encoder-urls` sends it
    first: the image `awaiting` (no feature); returns the request, the item (with its pixels)
    and its pixels."""
    words = " ".join(f"word{i}" for i in range(first, first + 12))
    case = Checkpoint(folder).case("image", [words, gradient_image((56, 56)), "What is it?"])
    (item,) = case.mm.items
    rows = item.feature
    late = dataclasses.replace(item, feature=None, awaiting=True)
    mm = dataclasses.replace(case.mm, items=[late])
    return TokenizedGenerateReq(rid, case.input_ids, params, mm), item, rows


def test_an_awaited_image_lets_its_text_prefill_and_others_decode_until_it_comes(
    model, folder: Path
) -> None:
    """The request's leading text prefills in chunks up to the image; the image's chunk waits,
    parked with its KV, for the `ItemEmbeddings`, while another request decodes; with nothing
    else to run the scheduler is blocked (no spin); once the rows come it finishes with the
    tokens of a request sent whole (pixels)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    msg, item, pixels = awaited_case(folder, "img", params)
    whole = dataclasses.replace(msg, mm_inputs=dataclasses.replace(msg.mm_inputs, items=[item]))
    embedding = model.encode_items([item])[item.hash]
    start = item.span[0]
    assert start > 40  # the text before the image spans several 16-token chunks
    sched = make_scheduler(model, 1000, chunk=16, encoder_cache_mb=1, mixed=True, context=400)
    talk = TokenizedGenerateReq("txt", [5, 6, 7, 8], dataclasses.replace(params, max_new_tokens=12))
    out = sched.step([talk])
    assert sched.running and not sched.blocked
    outputs = out.outputs + sched.step([msg]).outputs
    steps = 0
    while not sched.parked:
        assert not sched.blocked
        outputs += sched.step([]).outputs
        steps += 1
        assert steps < 20
    (req,) = sched.parked
    assert req.kv_len == start and req.ready_len == 0  # its text computed, the image not
    assert sched.encoder_cache.counters.items_encoded == 0
    decoded = sum(len(o.new_token_ids) for o in outputs if o.rid == "txt")
    assert decoded >= 2  # txt decoded beside img's text chunks
    while sched.running:
        assert not sched.blocked
        outputs += sched.step([]).outputs
    assert sched.blocked and not sched.idle  # img waits for its rows, nothing spins
    assert sched.step([]).outputs == [] and req.kv_len == start
    late = ItemEmbeddings("img", {item.hash: embedding})
    outputs += sched.step([late]).outputs
    while not sched.idle:
        outputs += sched.step([]).outputs
    got = [t for o in outputs if o.rid == "img" for t in o.new_token_ids]
    assert sched.counters.parked == 1
    ref = make_scheduler(model, 1000, chunk=16, encoder_cache_mb=1, mixed=True, context=400)
    ref_out = ref.step([whole]).outputs
    while not ref.idle:
        ref_out += ref.step([]).outputs
    assert got == [t for o in ref_out for t in o.new_token_ids] and len(got) == 6
    assert pixels is not None and req.mm.items[0].embedded  # the rows, not the tower, fused
    sched.check_idle_accounting()


@pytest.mark.parametrize("where", ["waiting", "parked"])
def test_an_aborted_request_frees_what_it_held_and_its_late_rows_are_dropped(
    model, folder: Path, where: str
) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    msg, item, _ = awaited_case(folder, "img", params)
    sched = make_scheduler(model, 1000, chunk=16, encoder_cache_mb=1, max_running=1, context=400)
    blocker = TokenizedGenerateReq("txt", [5, 6, 7], params)
    sched.step([blocker, msg] if where == "waiting" else [msg])
    while where == "parked" and not sched.parked:
        sched.step([])
    assert (sched.waiting if where == "waiting" else sched.parked)[0].rid == "img"
    out = sched.step([AbortReq("img")]).outputs
    assert [o.finish_reason.kind.value for o in out if o.rid == "img"] == ["abort"]
    while not sched.idle:
        sched.step([])
    sched.check_idle_accounting()  # no KV, slot, lock or pin left by img
    rows = torch.zeros(item.num_tokens, model.config.vision.embed_row_dim)
    assert sched.step([ItemEmbeddings("img", {item.hash: rows})]).outputs == []
    assert sched.idle and msg.mm_inputs.items[0].awaiting  # nothing took the late rows
    sched.check_idle_accounting()


def test_rows_of_the_wrong_shape_fail_the_request_alone(model, folder: Path) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    msg, item, _ = awaited_case(folder, "img", params)
    sched = make_scheduler(model, 1000, chunk=16, encoder_cache_mb=1, context=400)
    sched.step([msg])
    while not sched.parked:
        sched.step([])
    bad = ItemEmbeddings("img", {item.hash: torch.zeros(3, model.config.vision.embed_row_dim)})
    out = sched.step([bad]).outputs
    (finish,) = [o.finish_reason for o in out if o.rid == "img"]
    assert finish.is_error and "rows" in finish.detail
    assert sched.idle
    sched.check_idle_accounting()


def test_parked_requests_give_their_kv_back_to_the_one_that_can_run(model, folder: Path) -> None:
    """Two requests park with their texts' KV, which fills the pool; when their images come,
    the first cannot finish its prompt in what is left and nothing decodes: the latest parked
    one gives its KV back to the tree and waits again, and both complete as sent whole."""
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    (a, item_a, _), (b, item_b, _) = (
        awaited_case(folder, rid, params, first) for rid, first in (("a", 0), ("b", 50))
    )
    shared = next(i for i, (x, y) in enumerate(zip(a.input_ids, b.input_ids)) if x != y)
    kv = item_a.span[0] + item_b.span[0] - shared + 6  # the template's start is shared
    sched = make_scheduler(model, kv, chunk=16, encoder_cache_mb=1, context=400)
    outputs = sched.step([a, b]).outputs
    while len(sched.parked) < 2:
        outputs += sched.step([]).outputs
    assert sched.cache.kv_pool.available_size <= 6
    late = [ItemEmbeddings(m.rid, model.encode_items([i])) for m, i in ((a, item_a), (b, item_b))]
    outputs += sched.step(late).outputs
    for _ in range(200):
        if sched.idle:
            break
        outputs += sched.step([]).outputs
    assert sched.idle and sched.counters.unparked >= 1
    got = {r: [t for o in outputs if o.rid == r for t in o.new_token_ids] for r in "ab"}
    for msg, item in ((a, item_a), (b, item_b)):
        ref = make_scheduler(model, 1000, chunk=16, encoder_cache_mb=1, context=400)
        whole = dataclasses.replace(msg.mm_inputs, items=[item])
        ref_out = ref.step([dataclasses.replace(msg, mm_inputs=whole)]).outputs
        while not ref.idle:
            ref_out += ref.step([]).outputs
        assert got[msg.rid] == [t for o in ref_out for t in o.new_token_ids]
    sched.check_idle_accounting()
