"""Structured outputs in the scheduler, in-process on one rank, on a tiny random checkpoint whose
output is noise: only the grammar mask makes it valid. Each test also checks that every grammar
state and every KV slot is given back once the scheduler is idle."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from grammar_cases import CHOICES, REGEXES, SCHEMAS
from hostile_inputs import AMBIGUOUS
from scheduler_harness import SchedulerHarness
from think_tokens import add_think_tokens
from transformers import AutoTokenizer

from runtime.distributed import TPGroup
from runtime.grammar import GrammarSpec, ThinkSection
from runtime.io_struct import AbortReq, FinishKind, ReqOutput, TokenizedGenerateReq
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from runtime.tiny_checkpoint import make_checkpoint
from scheduler.process import build_scheduler
from scheduler.scheduler import Scheduler
from vision.vlm import build_model

MAX_NEW = 400
# Grammars compile on worker threads and processes: on a loaded machine a compile can outlast
# thousands of empty scheduler steps, so a run is bounded by time, not by a count of steps.
IDLE_DEADLINE_S = 120.0
# Schemas with a number of unbounded precision: greedy noise repeats its likeliest digit for ever
# (a correct "length" finish), so they run sampled only.
UNBOUNDED_NUMBERS = {4, 7}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("structured") / "ck")


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """The same checkpoint (same weights), its vocabulary with <think> and </think> added."""
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("thinking") / "ck")
    return folder, add_think_tokens(folder)


@pytest.fixture(scope="module")
def model(folder: Path):
    return build_model(str(folder), TPGroup(), dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(folder: Path):
    return AutoTokenizer.from_pretrained(str(folder))


def make_scheduler(
    folder: Path,
    model,
    kv_tokens: int = 8000,
    jump_forward: bool = True,
    mixed: bool = False,
    grammar_ms_per_token: float = 10.0,
) -> Scheduler:
    args = ServerArgs(
        disable_jump_forward=not jump_forward,
        grammar_ms_per_token=grammar_ms_per_token,
        enable_mixed_chunk=mixed,
        model_path=str(folder),
        device="cpu",
        max_total_tokens=kv_tokens,
        max_running_requests=32,
        max_prefill_tokens=1024,
        chunked_prefill_size=16,
        context_length=1024,
    )
    return build_scheduler(args, TPGroup(), model)


def request(
    rid: str, spec: GrammarSpec | None, prompt_len: int = 24, **params: object
) -> TokenizedGenerateReq:
    key = sum(ord(c) * 31**k for k, c in enumerate(rid))
    prompt = [(key + j * 7) % 300 + 20 for j in range(prompt_len)]
    values = {"temperature": 0.0, "max_new_tokens": MAX_NEW, **params}
    return TokenizedGenerateReq(rid, prompt, SamplingParams(grammar=spec, **values))


def steps_until_idle(scheduler: Scheduler, reqs: list[TokenizedGenerateReq]) -> Iterator:
    """Each step's result, from the one that takes `reqs` until the scheduler is idle (or the
    deadline passes); a step with nothing running (compiles pending) yields the CPU a moment."""
    deadline = time.monotonic() + IDLE_DEADLINE_S
    result = scheduler.step(reqs)
    while True:
        yield result
        if scheduler.idle or time.monotonic() > deadline:
            return
        if not scheduler.running and scheduler.chunked is None:
            time.sleep(0.001)
        result = scheduler.step([])


def run(scheduler: Scheduler, reqs: list[TokenizedGenerateReq]) -> dict[tuple[str, int], list]:
    """(rid, choice) -> [tokens, finish], once the scheduler is idle."""
    outputs: dict[tuple[str, int], list] = {}
    for result in steps_until_idle(scheduler, reqs):
        collect(outputs, result.outputs)
    assert scheduler.idle
    assert scheduler.grammar.held() == 0
    kv = scheduler.runner.kv_pool
    assert kv.available_size + scheduler.radix.evictable_size == kv.size
    return outputs


def collect(outputs: dict[tuple[str, int], list], new: list[ReqOutput]) -> None:
    for out in new:
        entry = outputs.setdefault((out.rid, out.index), [[], None])
        entry[0].extend(out.new_token_ids)
        entry[1] = out.finish_reason or entry[1]


def text_of(tokenizer, tokens: list[int], eos: tuple[int, ...]) -> str:
    return tokenizer.decode([t for t in tokens if t not in eos])


def test_schemas_validate_and_stop_at_both_temperatures(folder, model, tokenizer) -> None:
    scheduler = make_scheduler(folder, model)
    reqs = []
    for i, schema in enumerate(SCHEMAS):
        spec = GrammarSpec.json_schema(schema, "response_format")
        if i not in UNBOUNDED_NUMBERS:
            reqs.append(request(f"s{i}-greedy", spec))
        reqs += [request(f"s{i}-t1-{seed}", spec, temperature=1.0, seed=seed) for seed in (1, 2)]
    outputs = run(scheduler, reqs)
    eos = scheduler.cfg.eos_token_ids
    for req in reqs:
        tokens, finish = outputs[(req.rid, 0)]
        assert finish.kind == FinishKind.STOP, (req.rid, finish)
        schema = SCHEMAS[int(req.rid[1:].split("-")[0])]
        jsonschema.validate(json.loads(text_of(tokenizer, tokens, eos)), schema)


def test_regex_choice_and_n_choices_each_follow_the_grammar(folder, model, tokenizer) -> None:
    scheduler = make_scheduler(folder, model)
    reqs = [
        request(f"re{i}", GrammarSpec("regex", p), temperature=1.0, seed=i, n=2)
        for i, p in enumerate(REGEXES)
    ]
    reqs.append(request("choice", GrammarSpec.choice(CHOICES), temperature=1.0, seed=5, n=6))
    outputs = run(scheduler, reqs)
    eos = scheduler.cfg.eos_token_ids
    for i, pattern in enumerate(REGEXES):
        for index in range(2):
            tokens, finish = outputs[(f"re{i}", index)]
            assert finish.kind == FinishKind.STOP
            assert re.fullmatch(pattern, text_of(tokenizer, tokens, eos))
    picked = {text_of(tokenizer, outputs[("choice", k)][0], eos) for k in range(6)}
    assert picked <= set(CHOICES)


def test_max_tokens_first_is_length_and_unconstrained_rows_are_untouched(folder, model) -> None:
    scheduler = make_scheduler(folder, model)
    free = request("free", None, ignore_eos=True, max_new_tokens=30)
    alone = run(scheduler, [free])[("free", 0)][0]
    spec = GrammarSpec.json_schema(SCHEMAS[1])
    outputs = run(scheduler, [request("cut", spec, max_new_tokens=3), free])
    assert outputs[("cut", 0)][1].kind == FinishKind.LENGTH
    assert len(outputs[("cut", 0)][0]) == 3
    assert outputs[("free", 0)][0] == alone  # a constrained neighbour changes nothing


DIGITS = {  # about 60 tokens long: three such requests outgrow the small pool
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 30,
    "maxItems": 30,
}


def test_retraction_keeps_constrained_outputs_valid_and_leaks_nothing(
    folder, model, tokenizer
) -> None:
    roomy = make_scheduler(folder, model, jump_forward=False)  # and stepwise
    # two are admitted (8 prompt tokens and half of 100 outputs reserved each), then outgrow it
    tight = make_scheduler(folder, model, kv_tokens=120)
    spec = GrammarSpec.json_schema(DIGITS)
    reqs = [
        request(f"d{i}", spec, 8, temperature=1.0, seed=i, max_new_tokens=100) for i in range(3)
    ]
    expected = run(roomy, reqs)
    outputs = run(tight, reqs)
    assert tight.counters.retractions > 0
    assert outputs == expected  # a retracted request's matcher resumes exactly where it was
    assert tight.counters.forced_tokens > 0
    for req in reqs:
        tokens, finish = outputs[(req.rid, 0)]
        assert finish.kind == FinishKind.STOP
        jsonschema.validate(json.loads(text_of(tokenizer, tokens, tight.cfg.eos_token_ids)), DIGITS)


def test_abort_and_invalid_grammar_free_their_state(folder, model) -> None:
    scheduler = make_scheduler(folder, model)
    spec = GrammarSpec.json_schema(SCHEMAS[0])
    result = scheduler.step([request("a", spec, temperature=1.0, seed=1)])
    for _ in range(3):
        result = scheduler.step([])
    assert scheduler.grammar.held() == 1
    outputs: dict[tuple[str, int], list] = {}
    collect(outputs, result.outputs)
    collect(outputs, scheduler.step([AbortReq("a")]).outputs)
    assert outputs[("a", 0)][1].kind == FinishKind.ABORT
    bad = request("bad", GrammarSpec("regex", "(unclosed", "regex"))
    finish = run(scheduler, [bad])[("bad", 0)][1]
    assert finish.kind == FinishKind.ERROR and finish.status == 400
    assert "regex" in finish.detail


# Every split of a run of a's and b's is a parse: the engine's rows grow with each token until
# a per-step limit is hit (issue 57); an unconstrained neighbour must not notice.


def test_an_ambiguous_grammar_ends_at_the_engines_limit_as_a_400(folder, model) -> None:
    scheduler = make_scheduler(folder, model)
    free = request("free", None, ignore_eos=True, max_new_tokens=40)
    alone = run(scheduler, [free])[("free", 0)][0]
    spec = GrammarSpec("ebnf", AMBIGUOUS, "guided_grammar")
    greedy = request("amb", spec, min_tokens=300, max_new_tokens=300)
    sampled = request("amb-t1", spec, temperature=1.0, seed=3, min_tokens=300, max_new_tokens=300)
    outputs = run(scheduler, [greedy, sampled, free])
    for rid in ("amb", "amb-t1"):
        tokens, finish = outputs[(rid, 0)]
        assert finish.kind == FinishKind.ERROR and finish.status == 400, finish
        assert finish.param == "guided_grammar"
        assert f"per-step limit after {len(tokens)} tokens" in finish.detail
        assert 0 < len(tokens) < 100  # at the step the engine gave up, not after 300
    assert outputs[("free", 0)][0] == alone
    assert outputs[("free", 0)][1].kind == FinishKind.LENGTH


def test_a_grammar_over_its_time_budget_ends_alone_as_a_400(folder, model) -> None:
    scheduler = make_scheduler(folder, model, grammar_ms_per_token=1e-6)
    free = request("free", None, ignore_eos=True, max_new_tokens=20)
    spec = GrammarSpec.json_schema(SCHEMAS[0], "response_format")
    outputs = run(scheduler, [request("costly", spec), free])
    tokens, finish = outputs[("costly", 0)]
    assert finish.kind == FinishKind.ERROR and finish.status == 400, finish
    assert finish.param == "response_format" and "budget" in finish.detail
    assert tokens == []  # its first mask is already over a budget this small
    assert len(outputs[("free", 0)][0]) == 20


def test_two_ranks_take_rank_zeros_grammar_decisions(folder, tokenizer) -> None:
    """Only rank 0 holds matchers: the other rank admits, stops and fails as it says (its
    tokens, the compiles it reports, the grammars that ended), and both end idle and clean."""
    args = ServerArgs(
        model_path=str(folder),
        tp_size=2,
        max_total_tokens=4000,
        chunked_prefill_size=16,
        context_length=1024,
    )
    reqs = [
        request(f"t{i}", GrammarSpec.json_schema(SCHEMAS[i]), temperature=1.0, seed=i)
        for i in (0, 3, 6)
    ]
    reqs.append(request("tbad", GrammarSpec("regex", "(unclosed", "regex")))
    reqs.append(request("tfree", None, max_new_tokens=20, ignore_eos=True))
    ambiguous = GrammarSpec("ebnf", AMBIGUOUS, "guided_grammar")
    reqs.append(request("tamb", ambiguous, min_tokens=300, max_new_tokens=300))
    with SchedulerHarness(args) as harness:
        results = harness.generate(reqs)
        info = harness.info()
    for i in (0, 3, 6):
        out = results[f"t{i}"]
        assert out["finish"]["type"] == "stop", out
        text = tokenizer.decode([t for t in out["tokens"] if t not in (tokenizer.eos_token_id,)])
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    assert results["tbad"]["finish"]["status"] == 400
    amb = results["tamb"]["finish"]  # failed on rank 0's word, on both ranks alike
    assert amb["status"] == 400 and amb["param"] == "guided_grammar", amb
    assert len(results["tamb"]["tokens"]) < 100
    assert len(results["tfree"]["tokens"]) == 20
    assert info.kv_free + info.kv_evictable == info.kv_total


def split_thought(tokens: list[int], think: ThinkSection) -> tuple[list[int], list[int]]:
    """(the thinking section with its tags, the reply after it)."""
    assert think.end_id in tokens, tokens
    end = tokens.index(think.end_id) + 1
    if think.start_id is not None:
        assert tokens[0] == think.start_id
    return tokens[:end], tokens[end:]


def test_a_reasoning_model_thinks_freely_then_follows_the_schema(
    thinking, model, tokenizer
) -> None:
    """The thinking section is free (noise that would never validate), the reply after
    </think> follows the schema, with each rule (deepseek_r1: it thinks from the start; qwen3:
    only if it opens with <think>), n > 1 choices each with its own state, and retraction."""
    folder, ids = thinking
    rules = {
        "r1": ThinkSection(ids["</think>"]),
        "q3": ThinkSection(ids["</think>"], ids["<think>"]),
    }
    bias = {ids["</think>"]: 6.0, ids["<think>"]: 6.0}
    room = {"max_new_tokens": 100}
    roomy = make_scheduler(folder, model, jump_forward=False)
    tight = make_scheduler(folder, model, kv_tokens=210)  # 8 + 2 x 100 fits; all 8 choices do not
    reqs = []
    for name, think in rules.items():
        spec = GrammarSpec("json_schema", GrammarSpec.json_schema(DIGITS).text, think=think)
        reqs += [
            request(f"{name}-{s}", spec, 8, temperature=1.0, seed=s, n=2, **room, logit_bias=bias)
            for s in (1, 2)
        ]
    expected = run(roomy, reqs)
    outputs = run(tight, reqs)
    assert tight.counters.retractions > 0
    assert outputs == expected  # each choice's matcher resumes where it was, jumps or not
    eos = tight.cfg.eos_token_ids
    thoughts = []
    for (rid, _), (tokens, finish) in outputs.items():
        assert finish.kind == FinishKind.STOP, (rid, finish)
        thought, reply = split_thought(tokens, rules[rid[:2]])
        thoughts.append(thought)
        jsonschema.validate(json.loads(text_of(tokenizer, reply, eos)), DIGITS)
    assert len(outputs) == 8 and any(len(t) > 2 for t in thoughts)


def test_qwen3_rule_constrains_from_the_start_without_a_think_token(
    thinking, model, tokenizer
) -> None:
    folder, ids = thinking
    think = ThinkSection(ids["</think>"], ids["<think>"])
    spec = GrammarSpec("json_schema", GrammarSpec.json_schema(SCHEMAS[1]).text, think=think)
    scheduler = make_scheduler(folder, model)
    tokens, finish = run(scheduler, [request("plain", spec)])[("plain", 0)]
    assert finish.kind == FinishKind.STOP and ids["<think>"] not in tokens
    text = text_of(tokenizer, tokens, scheduler.cfg.eos_token_ids)
    jsonschema.validate(json.loads(text), SCHEMAS[1])


FIXED_KEYS = (0, 1, 3, 6, 9)  # objects with required keys: the grammar forces them


@pytest.mark.parametrize("mixed", [False, True])
def test_jump_forward_equals_step_by_step_decoding_in_fewer_steps(
    folder, model, tokenizer, mixed
) -> None:
    """A forced token is the only one the mask allows, so step-by-step decoding picks it too
    (greedy, or sampled: a seeded request draws from a generator keyed by its seed and the
    token's position, so skipping the forced positions' draws changes no other draw). The
    run's KV and positions, written by one extend, are those the decode steps would write, so
    every token after it is the same too; only the step count differs."""
    reqs = [
        request(f"g{i}", GrammarSpec.json_schema(SCHEMAS[i]), max_new_tokens=200)
        for i in FIXED_KEYS
    ]
    reqs += [
        request(f"t{i}", GrammarSpec.json_schema(SCHEMAS[i]), temperature=1.0, seed=i, n=2)
        for i in FIXED_KEYS
    ]
    reqs.append(request("free", None, ignore_eos=True, max_new_tokens=40))
    stepwise = make_scheduler(folder, model, jump_forward=False, mixed=mixed)
    jumping = make_scheduler(folder, model, mixed=mixed)
    expected = run(stepwise, reqs)
    outputs = run(jumping, reqs)
    assert stepwise.counters.forced_tokens == 0 < jumping.counters.forced_tokens
    assert outputs == expected
    steps = [s.counters.decode_steps + s.counters.prefill_steps for s in (stepwise, jumping)]
    assert steps[1] < steps[0]
    eos = jumping.cfg.eos_token_ids
    for (rid, _), (tokens, finish) in outputs.items():
        if rid != "free":
            assert finish.kind == FinishKind.STOP, rid
            jsonschema.validate(json.loads(text_of(tokenizer, tokens, eos)), SCHEMAS[int(rid[1:])])


def deltas(scheduler: Scheduler, req: TokenizedGenerateReq) -> list[ReqOutput]:
    """The request's outputs step by step (each a delivered delta), once the scheduler idles."""
    outputs = []
    for result in steps_until_idle(scheduler, [req]):
        outputs += [o for o in result.outputs if o.new_token_ids]
    assert scheduler.idle, "the scheduler did not finish"
    return outputs


def test_forced_runs_keep_max_tokens_min_tokens_and_logprobs(folder, model) -> None:
    """A run stops at max_tokens ("length" at exactly that many tokens); while a request is
    under min_tokens no delivered delta reaches past it (the detokenizer arms stop strings per
    delta); a request that asked for logprobs gets one real logprob per token (its forced
    tokens decode one step each)."""
    spec = GrammarSpec.json_schema(SCHEMAS[1])
    scheduler = make_scheduler(folder, model)
    for cap in (2, 5, 9):
        tokens, finish = run(scheduler, [request(f"cap{cap}", spec, max_new_tokens=cap)])[
            (f"cap{cap}", 0)
        ]
        assert finish.kind == FinishKind.LENGTH and len(tokens) == cap
    assert max(len(o.new_token_ids) for o in deltas(scheduler, request("m0", spec))) > 1
    least = 6
    for out in deltas(scheduler, request("m6", spec, min_tokens=least)):
        first = out.completion_tokens - len(out.new_token_ids) + 1
        assert first >= least or out.completion_tokens < least, out
    before = scheduler.counters.forced_tokens
    outputs = deltas(scheduler, request("lp", spec, logprobs=0))
    assert scheduler.counters.forced_tokens == before
    assert all(len(o.new_token_ids) == len(o.logprobs) == 1 for o in outputs)
