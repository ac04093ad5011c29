"""The grammar layer on the tiny tokenizer: a noise "model" sampling from the masked distribution
must still produce output that validates, ends, and survives rollback exactly."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from grammar_cases import CHOICES, EBNF, EBNF_PATTERN, REGEXES, SCHEMAS

from runtime.grammar import (
    BatchMask,
    CompileLimits,
    GrammarBackend,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    ReasoningMatcher,
    apply_bitmask,
    fill_batch,
    make_backend,
)
from runtime.grammar.bitmask import allocate_bitmask, unpack_bitmask
from runtime.grammar.llguidance_backend import EngineLimits, LLGuidanceBackend
from runtime.tiny_checkpoint import build_tokenizer

VOCAB = 512  # the tiny checkpoints' logits width (the tokenizer itself has 382 tokens)
MAX_STEPS = 3000


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def stop_ids(tokenizer) -> list[int]:
    return [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]


@pytest.fixture(scope="module")
def backend(tokenizer, stop_ids) -> GrammarBackend:
    return make_backend("llguidance", tokenizer.to_str(), VOCAB, stop_ids)


@pytest.fixture(scope="module")
def compiler(backend):
    compiler = GrammarCompiler(backend)
    yield compiler
    compiler.close()


def sample(matcher: GrammarMatcher, gen: torch.Generator, temperature: float) -> int:
    """One step of a noise model: random logits, the grammar's mask, then greedy or sampling."""
    logits = torch.randn(1, VOCAB, generator=gen) * 3
    mask = fill_batch([matcher], VOCAB)
    apply_bitmask(logits, mask)
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def generate(matcher: GrammarMatcher, seed: int, temperature: float, stops: list[int]) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        if matcher.is_terminated():
            return [t for t in tokens if t not in stops]
        token = sample(matcher, gen, temperature)
        assert matcher.accept_token(token), f"a masked sample was refused: {token}"
        tokens.append(token)
    raise AssertionError(f"no termination in {MAX_STEPS} steps")


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(compiler, tokenizer, stop_ids, index, temperature) -> None:
    spec = GrammarSpec.json_schema(SCHEMAS[index])
    for seed in range(3):
        tokens = generate(compiler.new_matcher(spec), seed, temperature, stop_ids)
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        jsonschema.validate(json.loads(text), SCHEMAS[index])


def test_json_object_is_an_object(compiler, tokenizer, stop_ids) -> None:
    for seed in range(4):
        tokens = generate(compiler.new_matcher(GrammarSpec("json_object", "")), seed, 1.0, stop_ids)
        assert isinstance(json.loads(tokenizer.decode(tokens)), dict)


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_full_match(compiler, tokenizer, stop_ids, pattern) -> None:
    for seed, temperature in [(0, 0.0), (1, 1.0), (2, 1.0), (3, 1.0)]:
        matcher = compiler.new_matcher(GrammarSpec("regex", pattern))
        text = tokenizer.decode(generate(matcher, seed, temperature, stop_ids))
        assert re.fullmatch(pattern, text), (pattern, text)


def test_choice_outputs_are_choices(compiler, tokenizer, stop_ids) -> None:
    outputs = set()
    for seed in range(12):
        matcher = compiler.new_matcher(GrammarSpec.choice(CHOICES))
        outputs.add(tokenizer.decode(generate(matcher, seed, 1.0, stop_ids)))
    assert outputs <= set(CHOICES) and len(outputs) > 1


def test_ebnf_gbnf_and_lark(compiler, tokenizer, stop_ids) -> None:
    grammars = [EBNF, 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/']  # GBNF and Lark
    for grammar in grammars:
        for seed in range(3):
            matcher = compiler.new_matcher(GrammarSpec("ebnf", grammar))
            text = tokenizer.decode(generate(matcher, seed, 1.0, stop_ids))
            assert re.fullmatch(EBNF_PATTERN, text), text


def masks(matcher: GrammarMatcher) -> torch.Tensor:
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def test_mask_agrees_with_accept(compiler) -> None:
    """Every token the mask allows is accepted, every other is refused and changes nothing."""
    matcher = compiler.new_matcher(GrammarSpec.json_schema(SCHEMAS[0]))
    for token in [t for t in matcher.jump_forward().tokens]:
        assert matcher.accept_token(token)
    before = masks(matcher)
    allowed = unpack_bitmask(before.unsqueeze(0), VOCAB)[0]
    assert 0 < int(allowed.sum()) < VOCAB
    for token in range(VOCAB):
        accepted = matcher.accept_token(token)
        assert accepted == bool(allowed[token]), token
        if accepted:
            matcher.rollback(1)
    assert torch.equal(masks(matcher), before)


@pytest.mark.parametrize("index", [0, 3, 7])
def test_rollback_restores_state_exactly(compiler, stop_ids, index) -> None:
    spec = GrammarSpec.json_schema(SCHEMAS[index])
    reference = compiler.new_matcher(spec)
    tokens = generate(reference, 5, 1.0, [])  # stop token kept: roll back over termination too
    matcher = compiler.new_matcher(spec)
    history = []
    for token in tokens:
        history.append(masks(matcher))
        assert matcher.accept_token(token)
    assert matcher.is_terminated()
    for k in (1, 3, len(tokens) // 2, len(tokens)):
        matcher.rollback(k)
        assert matcher.num_accepted == len(tokens) - k
        assert torch.equal(masks(matcher), history[len(tokens) - k])
        assert not matcher.is_terminated()
        for token in tokens[len(tokens) - k :]:
            assert matcher.accept_token(token)
        assert matcher.is_terminated()
    with pytest.raises(ValueError):
        matcher.rollback(len(tokens) + 1)


def test_jump_forward_gives_forced_keys(compiler, tokenizer) -> None:
    matcher = compiler.new_matcher(GrammarSpec.json_schema(SCHEMAS[1]))
    forced = matcher.jump_forward()
    assert forced.text == '{"invoice":{"id":'
    assert tokenizer.decode(forced.tokens) == forced.text[: len(tokenizer.decode(forced.tokens))]
    assert forced.tokens and all(matcher.accept_token(t) for t in forced.tokens)
    choice = compiler.new_matcher(GrammarSpec.choice(["alpha", "beta"]))
    assert choice.jump_forward().tokens == []


def test_batch_mask_touches_only_constrained_rows(compiler) -> None:
    constrained = compiler.new_matcher(GrammarSpec("regex", "[0-9]+"))
    logits = torch.randn(3, VOCAB)
    original = logits.clone()
    mask = fill_batch([None, constrained, None], VOCAB)
    assert mask is not None and mask.rows.tolist() == [1]
    apply_bitmask(logits, mask)
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    allowed = unpack_bitmask(mask.bitmask, VOCAB)[0]
    assert torch.equal(torch.isfinite(logits[1]), allowed)
    assert torch.equal(logits[1][allowed], original[1][allowed])
    assert fill_batch([None, None], VOCAB) is None
    apply_bitmask(logits, None)  # no constrained request: nothing to do


def test_apply_bitmask_widths() -> None:
    """Bits past the logits width are ignored; logits past the mask width are forbidden."""
    bitmask = torch.tensor([[0b101, -1]], dtype=torch.int32)
    narrow = torch.zeros(1, 40)
    apply_bitmask(narrow, BatchMask(bitmask, torch.tensor([0])))
    assert torch.isfinite(narrow[0]).nonzero().flatten().tolist() == [0, 2, *range(32, 40)]
    wide = torch.zeros(1, 70)
    apply_bitmask(wide, BatchMask(bitmask, torch.tensor([0])))
    assert torch.isfinite(wide[0]).nonzero().flatten().tolist() == [0, 2, *range(32, 64)]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (GrammarSpec.json_schema({"type": "foo"}, "response_format"), "foo"),
        (GrammarSpec.json_schema({"type": "string", "format": "nope"}, "guided_json"), "nope"),
        (GrammarSpec("regex", "a(b", "regex"), "regex"),
        (GrammarSpec("ebnf", 'root ::= "a" missing', "grammar"), "missing"),
        (GrammarSpec("ebnf", "start: ((", "grammar"), "ebnf"),
        (GrammarSpec.structural_tag({"structures": []}, "structural_tag"), "structural_tag"),
        (
            GrammarSpec.structural_tag(
                {"structures": [{"begin": "<x>", "schema": {}, "end": ""}], "triggers": ["<f"]},
                "structural_tag",
            ),
            "none of the triggers",
        ),
    ],
)
def test_invalid_constraint_is_a_clean_error(compiler, spec, needle) -> None:
    for _ in range(2):  # the second time from the cache, with the same field named
        with pytest.raises(GrammarError, match=needle) as info:
            compiler.new_matcher(spec)
        assert info.value.param == spec.param


def test_spec_parsing_errors() -> None:
    with pytest.raises(GrammarError) as info:
        GrammarSpec.json_schema("{not json", "guided_json")
    assert info.value.param == "guided_json"
    with pytest.raises(GrammarError):
        GrammarSpec.json_schema("[1, 2]")
    with pytest.raises(GrammarError):
        GrammarSpec.choice([])
    with pytest.raises(GrammarError):
        GrammarSpec.choice(["a", 1])  # type: ignore[list-item]
    assert (
        GrammarSpec.json_schema('{"b": 1, "a": 2}').key
        == GrammarSpec.json_schema({"a": 2, "b": 1}).key
    )


def test_exploding_schema_hits_the_limits(tokenizer, stop_ids) -> None:
    limits = EngineLimits(max_grammar_size=2000)
    backend = LLGuidanceBackend(tokenizer.to_str(), VOCAB, stop_ids, limits)
    item = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}}
    wide = {"type": "object", "properties": {f"p{i}": item for i in range(300)}}
    compiler = GrammarCompiler(backend, CompileLimits(max_spec_bytes=100_000))
    try:
        with pytest.raises(GrammarError, match="too big"):
            compiler.new_matcher(GrammarSpec.json_schema(wide, "response_format"))
        huge = {"enum": ["x" * 1000] * 200}
        with pytest.raises(GrammarError, match="limit is 100000") as info:
            compiler.submit(GrammarSpec.json_schema(huge, "response_format"))
        assert info.value.param == "response_format"
        compiler.new_matcher(GrammarSpec.json_schema(SCHEMAS[0]))  # still serving
    finally:
        compiler.close()


class BlockingBackend(GrammarBackend):
    """Compiles only when released (a compile that takes too long); counts compiles."""

    name = "blocking"
    vocab_size = VOCAB

    def __init__(self, inner: GrammarBackend) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.compiles: list[str] = []

    def compile(self, spec: GrammarSpec) -> object:
        self.compiles.append(spec.text)
        if spec.text.startswith("slow"):
            self.release.wait(timeout=30)
        return self.inner.compile(GrammarSpec("regex", "[a-z]+"))

    def new_matcher(self, compiled: object) -> GrammarMatcher:
        return self.inner.new_matcher(compiled)


def test_slow_compile_times_out_without_blocking_others(backend) -> None:
    blocking = BlockingBackend(backend)
    compiler = GrammarCompiler(blocking, CompileLimits(timeout_s=0.2, workers=2))
    try:
        with pytest.raises(GrammarError, match="did not compile within") as info:
            compiler.compile(GrammarSpec("regex", "slow", "regex"))
        assert info.value.param == "regex"
        assert not blocking.release.is_set()
        matcher = compiler.new_matcher(GrammarSpec("regex", "fast"))  # the other worker serves it
        assert matcher.num_accepted == 0 and not matcher.is_terminated()
        blocking.release.set()
        assert compiler.compile(GrammarSpec("regex", "slow")) is not None  # finished later
    finally:
        blocking.release.set()
        compiler.close()


def test_cache_is_bounded_and_shared(backend) -> None:
    counting = BlockingBackend(backend)
    compiler = GrammarCompiler(counting, CompileLimits(cache_size=3))
    try:
        specs = [GrammarSpec("regex", f"r{i}") for i in range(5)]
        for spec in specs:
            compiler.compile(spec)
        assert compiler.cached() == 3
        compiler.compile(specs[4])
        compiler.compile(GrammarSpec("regex", "r4", "another_field"))
        assert counting.compiles.count("r4") == 1  # equal text: one compile
        compiler.compile(specs[0])  # evicted: compiled again
        assert counting.compiles.count("r0") == 2 and compiler.cached() == 3
    finally:
        compiler.close()


def test_reasoning_matcher_constrains_after_thinking(compiler, tokenizer, stop_ids) -> None:
    think_end = tokenizer.token_to_id("<|vision_end|>")  # the tiny vocabulary has no </think>
    matcher = ReasoningMatcher(compiler.new_matcher(GrammarSpec("regex", "[0-9]+")), think_end)
    free = tokenizer.encode("Let me think.").ids
    assert bool((masks(matcher) == -1).all())
    for token in free:
        assert matcher.accept_token(token)
    assert matcher.thinking and matcher.jump_forward().tokens == []
    assert matcher.accept_token(think_end) and not matcher.thinking
    letters = tokenizer.encode("abc").ids
    assert not matcher.accept_token(letters[0])
    digits = tokenizer.encode("42").ids
    assert all(matcher.accept_token(t) for t in digits)
    assert matcher.accept_token(stop_ids[0]) and matcher.is_terminated()
    matcher.rollback(len(digits) + 2)  # back over the end of thinking
    assert matcher.thinking and matcher.num_accepted == len(free)
    assert matcher.accept_token(letters[0])  # thinking again: anything goes
    matcher.rollback(1)
    assert matcher.accept_token(think_end)
    assert not matcher.accept_token(letters[0])  # and the grammar is back at its start
    assert all(matcher.accept_token(t) for t in digits)


def test_reasoning_matcher_first_token_decides_with_a_start_token(compiler, tokenizer) -> None:
    """The qwen3 rule: at the first position <think> or the grammar; either way, rollback to
    the start gives the choice back."""
    think_start = tokenizer.token_to_id("<|vision_start|>")  # stand-ins for <think> </think>
    think_end = tokenizer.token_to_id("<|vision_end|>")
    inner = compiler.new_matcher(GrammarSpec("regex", "[0-9]+"))
    matcher = ReasoningMatcher(inner, think_end, think_start_id=think_start)
    first = masks(matcher)
    allowed = unpack_bitmask(first[None], VOCAB)[0]
    digit, letter = tokenizer.encode("4").ids[0], tokenizer.encode("a").ids[0]
    assert allowed[think_start] and allowed[digit] and not allowed[letter]
    assert not allowed[think_end]
    assert not matcher.accept_token(letter) and matcher.num_accepted == 0
    assert matcher.accept_token(digit) and not matcher.thinking  # no thinking section
    assert not matcher.accept_token(think_start)
    matcher.rollback(1)
    assert matcher.deciding and matcher.accept_token(think_start) and matcher.thinking
    assert matcher.accept_token(letter) and matcher.accept_token(think_end)
    assert not matcher.accept_token(letter) and matcher.accept_token(digit)
    matcher.rollback(4)
    assert matcher.deciding and bool((masks(matcher) == first).all())


def test_fill_bitmask_refuses_a_wrong_buffer(compiler) -> None:
    matcher = compiler.new_matcher(GrammarSpec("regex", "[0-9]+"))
    with pytest.raises(ValueError):
        matcher.fill_bitmask(torch.zeros(1, 16, dtype=torch.int64), 0)
    with pytest.raises(ValueError):
        matcher.fill_bitmask(allocate_bitmask(2, 2 * VOCAB)[:, ::2], 0)


def test_structural_tag_constrains_only_tagged_segments(compiler, tokenizer, stop_ids) -> None:
    """Free text until a trigger; then `begin`, JSON by the schema and `end` are enforced."""
    schema = SCHEMAS[0]
    tag = {"structures": [{"begin": "<fn=get>", "schema": schema, "end": "</fn>"}]}
    spec = GrammarSpec.structural_tag({**tag, "triggers": ["<fn="]})
    for seed in range(3):
        matcher = compiler.new_matcher(spec)
        prompt = tokenizer.encode("Calling <fn=").ids
        assert all(matcher.accept_token(t) for t in prompt)
        assert matcher.jump_forward().text.startswith("get>{")
        tokens = prompt + generate(matcher, seed, 1.0, stop_ids)
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        found = re.fullmatch(r"Calling <fn=get>(.*?)</fn>(.*)", text, flags=re.DOTALL)
        assert found, text
        jsonschema.validate(json.loads(found.group(1)), schema)


def test_apply_bitmask_every_row_constrained() -> None:
    bitmask = torch.tensor([[0b0110], [0b1001]], dtype=torch.int32)
    logits = torch.zeros(2, 4)
    apply_bitmask(logits, BatchMask(bitmask, torch.tensor([0, 1])))
    expected = [[False, True, True, False], [True, False, False, True]]
    assert torch.isfinite(logits).tolist() == expected
