"""Sampling controls and logprobs against transformers on the same tiny checkpoint: greedy
decoding with each control equals HF `generate` with the matching logits processor, token for
token; logprobs equal HF's log-softmax of the same step's logits; a seeded request draws the same
tokens whatever shares its batch, with every control on."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LogitsProcessor
from transformers.generation import logits_process as hf
from vlm_cases import Case, Checkpoint, hf_generate, load_hf, noise_image

from runtime.distributed import TPGroup
from runtime.io_struct import AbortReq, FinishKind, TokenizedGenerateReq
from runtime.sampling_params import SamplingParams, bad_words_token_ids
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from scheduler.process import build_scheduler
from scheduler.scheduler import Scheduler
from vision.vlm import build_model

NEW = 24


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, out, torch.ones_like(out, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """HF and tessera sum float32 in the same order only on the same thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = Path(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("controls") / "ck"))
    ckpt = Checkpoint(folder)
    cases = [
        ckpt.case("text", ["Describe the cat and the dog and the cat again."]),
        ckpt.case("image", [noise_image(), "What is in the picture?"]),
    ]
    return {
        "ckpt": ckpt,
        "cases": cases,
        "hf": load_hf(folder),
        "model": build_model(str(folder), TPGroup(), dtype="float32"),
    }


def scheduler(world: dict[str, Any]) -> Scheduler:
    args = ServerArgs(device="cpu", max_total_tokens=4000, mm_cache_size_mb=16)
    return build_scheduler(args, TPGroup(), world["model"])


def run(world: dict[str, Any], reqs: list[TokenizedGenerateReq]) -> dict[str, dict[str, Any]]:
    sched = scheduler(world)
    results = {r.rid: {"tokens": [], "logprobs": [], "finish": None} for r in reqs}
    outputs = sched.step(reqs).outputs
    while not sched.idle:
        outputs += sched.step([]).outputs
    for out in outputs:
        entry = results[out.rid]
        entry["tokens"] += out.new_token_ids
        entry["logprobs"] += out.logprobs or []
        entry["finish"] = out.finish_reason or entry["finish"]
    return results


def ours(world: dict[str, Any], case: Case, **kw: Any) -> dict[str, Any]:
    values = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True, **kw}
    params = SamplingParams(**values).normalize()
    return run(world, [TokenizedGenerateReq(case.name, list(case.input_ids), params, case.mm)])[
        case.name
    ]


def theirs(
    world: dict[str, Any], case: Case, *processors: LogitsProcessor, **kw: Any
) -> dict[str, Any]:
    out = hf_generate(world["hf"], case, NEW, list(processors), **kw)
    return {"tokens": out.sequences[0, prompt_len(case) :].tolist(), "logits": out.logits}


def prompt_len(case: Case) -> int:
    return case.hf_inputs["input_ids"].shape[1]


@pytest.fixture(scope="module")
def plain(world: dict[str, Any]) -> dict[str, list[int]]:
    """Greedy outputs without controls (each equal to HF's)."""
    out = {}
    for case in world["cases"]:
        out[case.name] = ours(world, case)["tokens"]
        assert out[case.name] == theirs(world, case)["tokens"]
    return out


CASES = ["text", "image"]


def case_named(world: dict[str, Any], name: str) -> Case:
    return next(c for c in world["cases"] if c.name == name)


# ---------------------------------------------------------------------- one test per control


@pytest.mark.parametrize("name", CASES)
def test_repetition_penalty_matches_hf(world, plain, name: str) -> None:
    """Over prompt and output; an image's tokens count as its placeholder id, as in HF."""
    case = case_named(world, name)
    got = ours(world, case, repetition_penalty=1.8)["tokens"]
    want = theirs(world, case, hf.RepetitionPenaltyLogitsProcessor(1.8))["tokens"]
    assert got == want
    assert got != plain[name]


def test_an_image_counts_as_its_placeholder_for_the_repetition_penalty(world) -> None:
    """A biased image placeholder id wins unless the penalty sees the image's tokens in the
    prompt, as HF does (processors in tessera's order: logit_bias, then the penalty)."""
    case = case_named(world, "image")
    image = world["ckpt"].config.image_token_id
    got = ours(world, case, repetition_penalty=1.5, logit_bias={image: 5.0})["tokens"]
    bias = hf.SequenceBiasLogitsProcessor([[[image], 5.0]])
    want = theirs(world, case, bias, hf.RepetitionPenaltyLogitsProcessor(1.5))["tokens"]
    assert got == want
    unpenalised = ours(world, case, logit_bias={image: 5.0})["tokens"]
    assert image in unpenalised and image not in got


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("presence, frequency", [(1.5, 1.0), (-2.0, 0.0), (0.5, -1.5)])
def test_presence_and_frequency_penalties_match_openai_definition(
    world, plain, name: str, presence: float, frequency: float
) -> None:
    case = case_named(world, name)
    got = ours(world, case, presence_penalty=presence, frequency_penalty=frequency)["tokens"]
    want = theirs(world, case, OpenAIPenalties(prompt_len(case), presence, frequency))["tokens"]
    assert got == want
    if presence < 0 or frequency < 0:  # repeats are encouraged: the greedy path changes
        assert got != plain[name]


@pytest.mark.parametrize("name", CASES)
def test_min_tokens_holds_back_the_stop_token(world, plain, name: str) -> None:
    case = case_named(world, name)
    stop = plain[name][2]
    first = plain[name].index(stop)
    early = ours(world, case, stop_token_ids=[stop])
    assert len(early["tokens"]) == first + 1 and early["finish"].kind == FinishKind.STOP
    got = ours(world, case, stop_token_ids=[stop], min_tokens=first + 3)
    proc = hf.MinNewTokensLengthLogitsProcessor(prompt_len(case), first + 3, [stop])
    want = theirs(world, case, proc, eos_token_id=[stop], pad_token_id=0)
    assert got["tokens"] == want["tokens"][: len(got["tokens"])]
    assert len(got["tokens"]) > first + 3 and stop not in got["tokens"][: first + 3]


@pytest.mark.parametrize("name", CASES)
def test_logit_bias_matches_hf_sequence_bias(world, plain, name: str) -> None:
    case = case_named(world, name)
    unseen = next(t for t in range(3, 300) if t not in plain[name])
    bias = {plain[name][0]: -100.0, unseen: 4.0}
    got = ours(world, case, logit_bias={str(k): v for k, v in bias.items()})["tokens"]
    proc = hf.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    assert got == theirs(world, case, proc)["tokens"]
    assert got[0] != plain[name][0]


@pytest.mark.parametrize("name", CASES)
def test_allowed_token_ids_match_hf_prefix_constraint(world, plain, name: str) -> None:
    case = case_named(world, name)
    allowed = sorted(set(range(40, 90)) | {plain[name][3]})
    got = ours(world, case, allowed_token_ids=allowed)["tokens"]
    proc = hf.PrefixConstrainedLogitsProcessor(lambda _b, _ids: allowed, num_beams=1)
    assert got == theirs(world, case, proc)["tokens"]
    assert set(got) <= set(allowed)


@pytest.mark.parametrize("name", CASES)
def test_bad_words_match_hf_no_bad_words(world, plain, name: str) -> None:
    case = case_named(world, name)
    tok = world["ckpt"].tokenizer
    out = plain[name]
    words = [tok.decode(out[1:2]), tok.decode(out[4:6])]
    ids = bad_words_token_ids(tok, words)
    assert any(out[i : i + len(w)] == w for w in ids for i in range(len(out)))
    got = ours(world, case, bad_words=words, bad_words_ids=ids)["tokens"]
    assert got == theirs(world, case, hf.NoBadWordsLogitsProcessor(ids))["tokens"]
    assert got != out


# ---------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("name", CASES)
def test_logprobs_match_hf_log_softmax(world, plain, name: str) -> None:
    """Raw model logprobs (before controls): also with a penalty steering the tokens."""
    case = case_named(world, name)
    got = ours(world, case, logprobs=5, frequency_penalty=1.0)
    want = theirs(world, case, OpenAIPenalties(prompt_len(case), 0.0, 1.0))
    assert got["tokens"] == want["tokens"]
    assert len(got["logprobs"]) == NEW
    for step, (entry, logits) in enumerate(zip(got["logprobs"], want["logits"])):
        raw = logits[0].float().log_softmax(-1)
        assert entry.token_id == got["tokens"][step]
        assert abs(entry.logprob - raw[entry.token_id].item()) < 2e-3
        values, ids = raw.topk(5)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert max(abs(lp - v) for (_, lp), v in zip(entry.top, values.tolist())) < 2e-3


def test_logprobs_off_sends_none_and_zero_sends_only_the_token(world) -> None:
    case = case_named(world, "text")
    assert ours(world, case)["logprobs"] == []
    entries = ours(world, case, logprobs=0)["logprobs"]
    assert len(entries) == NEW and all(e.top == [] for e in entries)


# ---------------------------------------------------------------------- batches and seeds

EVERY_CONTROL = {
    "temperature": 1.0,
    "top_k": 50,
    "repetition_penalty": 1.3,
    "presence_penalty": 0.4,
    "frequency_penalty": 0.3,
    "min_tokens": 4,
    "logit_bias": {7: 2.0, 9: -3.0},
    "allowed_token_ids": list(range(1, 400)),
    "bad_words_ids": [[11], [12, 13]],
    "logprobs": 2,
}


def seeded(case: Case, rid: str, seed: int, **kw: Any) -> TokenizedGenerateReq:
    values = {**EVERY_CONTROL, "seed": seed, "max_new_tokens": NEW, "ignore_eos": True, **kw}
    params = SamplingParams(**values).normalize()
    return TokenizedGenerateReq(rid, list(case.input_ids), params, case.mm)


def test_seeded_request_ignores_its_batch_with_every_control(world) -> None:
    text, image = world["cases"]
    alone = run(world, [seeded(text, "me", 7)])["me"]
    crowd = [
        seeded(image, "a", 1),
        TokenizedGenerateReq("b", list(text.input_ids), SamplingParams(max_new_tokens=NEW)),
        seeded(text, "me", 7),
        seeded(text, "c", 3, repetition_penalty=1.0, logit_bias=None),
    ]
    together = run(world, crowd)
    assert together["me"]["tokens"] == alone["tokens"]
    assert together["c"]["tokens"] != alone["tokens"]
    assert [e.logprob for e in together["me"]["logprobs"]] == pytest.approx(
        [e.logprob for e in alone["logprobs"]], abs=1e-5
    )


def test_a_retracted_request_keeps_its_penalty_counts(world) -> None:
    """Retraction recomputes KV only: the penalised tokens come out as without retraction.
    Each prompt starts with a token of its own, so they share no prefix (prompts that do would
    share their KV and need no retraction)."""
    text = case_named(world, "text")
    reqs = [
        TokenizedGenerateReq(
            f"r{i}",
            [i + 1, *text.input_ids],
            SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True, **kw).normalize(),
        )
        for i, kw in enumerate([{"frequency_penalty": 1.0}, {"repetition_penalty": 1.5}, {}])
    ]
    roomy = run(world, reqs)
    args = ServerArgs(device="cpu", max_total_tokens=(len(text.input_ids) + 1) * 2 + 60)
    sched = build_scheduler(args, TPGroup(), world["model"])
    outputs = sched.step([dataclasses.replace(r) for r in reqs]).outputs
    while not sched.idle:
        outputs += sched.step([]).outputs
    assert sched.counters.retractions > 0
    for rid, entry in roomy.items():
        assert [t for o in outputs if o.rid == rid for t in o.new_token_ids] == entry["tokens"]


def test_token_ids_outside_the_vocabulary_are_refused(world) -> None:
    text = case_named(world, "text")
    for field, value in (("logit_bias", {10**6: 1.0}), ("allowed_token_ids", [1, 10**6])):
        params = SamplingParams(max_new_tokens=2, **{field: value}).normalize()
        out = run(world, [TokenizedGenerateReq("x", list(text.input_ids), params)])["x"]
        assert out["finish"].kind == FinishKind.ERROR and out["finish"].status == 400
        assert field in out["finish"].detail


# ---------------------------------------------------------------------- n choices


def choices_of(outputs: list[Any], rid: str) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for out in outputs:
        if out.rid == rid:
            got.setdefault(out.index, []).extend(out.new_token_ids)
    return got


def run_outputs(sched: Scheduler, reqs: list[TokenizedGenerateReq]) -> list[Any]:
    outputs = sched.step(reqs).outputs
    while not sched.idle:
        outputs += sched.step([]).outputs
    return outputs


def test_n_choices_prefill_and_encode_the_prompt_once(world, plain) -> None:
    case = case_named(world, "image")
    params = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, n=3).normalize()
    sched = scheduler(world)
    outputs = run_outputs(sched, [TokenizedGenerateReq("x", list(case.input_ids), params, case.mm)])
    assert choices_of(outputs, "x") == {i: plain["image"] for i in range(3)}
    assert sched.encoder_cache.counters.items_encoded == 1
    assert sched.counters.prompt_tokens_computed == len(case.input_ids) + 2
    finals = [o for o in outputs if o.finish_reason is not None]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert sorted(o.cached_tokens for o in finals) == [0, *[len(case.input_ids) - 1] * 2]


def test_seeded_choice_i_draws_like_seed_plus_i(world) -> None:
    text = case_named(world, "text")
    reqs = [seeded(text, "all", 100, n=3)]
    reqs += [seeded(text, f"one{i}", 100 + i) for i in range(3)]
    outputs = run_outputs(scheduler(world), reqs)
    together = choices_of(outputs, "all")
    assert [together[i] for i in range(3)] == [choices_of(outputs, f"one{i}")[0] for i in range(3)]
    assert together[0] != together[1]


def test_aborting_one_choice_leaves_the_others(world, plain) -> None:
    text = case_named(world, "text")
    params = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, n=3).normalize()
    sched = scheduler(world)
    outputs = sched.step([TokenizedGenerateReq("x", list(text.input_ids), params)]).outputs
    outputs += sched.step([AbortReq("x", 1)]).outputs
    outputs += run_outputs(sched, [])
    finish = {o.index: o.finish_reason.kind for o in outputs if o.finish_reason is not None}
    assert finish == {0: FinishKind.LENGTH, 1: FinishKind.ABORT, 2: FinishKind.LENGTH}
    assert choices_of(outputs, "x")[2] == plain["text"]
    outputs = sched.step([TokenizedGenerateReq("y", list(text.input_ids), params)]).outputs
    outputs += run_outputs(sched, [AbortReq("y")])
    assert {o.finish_reason.kind for o in outputs if o.finish_reason} == {FinishKind.ABORT}
    assert len([o for o in outputs if o.finish_reason]) == 3


def test_two_ranks_agree_with_one_on_choices_controls_and_logprobs(world) -> None:
    """At tp 2 (spawned ranks over the real channels) the forks, the controls' state and the
    entry rank's logprobs give what one in-process rank gives."""
    from scheduler_harness import SchedulerHarness

    from runtime.io_struct import BatchTokenOut

    text = case_named(world, "text")
    reqs = [seeded(text, "s", 21, n=2), seeded(text, "g", 0, temperature=0.0, n=2)]
    want = run_outputs(scheduler(world), [dataclasses.replace(r) for r in reqs])
    got: list[Any] = []
    args = ServerArgs(model_path=str(world["ckpt"].folder), tp_size=2, max_total_tokens=4000)
    with SchedulerHarness(args) as harness:
        for req in reqs:
            harness.send(req)
        while sum(o.finish_reason is not None for o in got) < 4:
            msg = harness.recv(120)
            got += msg.outputs if isinstance(msg, BatchTokenOut) else []
    for rid in ("s", "g"):
        assert choices_of(got, rid) == choices_of(want, rid)
        assert len(choices_of(got, rid)) == 2
    assert [e.logprob for o in got for e in o.logprobs or []] == pytest.approx(
        [e.logprob for o in want for e in o.logprobs or []], abs=1e-4
    )
