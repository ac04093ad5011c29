"""SamplingParams validation and the Sampler: greedy, filters, seeds, and the softmax law."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.sampler import (
    FAILED_TOKEN,
    Sampler,
    bad_row_mask,
    bad_rows,
    filtered_probs,
    mix_seed,
    sampler_columns,
)
from runtime.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams

VOCAB = 64


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sample(
    logits: torch.Tensor, params: SamplingParams, sampler: Sampler | None = None
) -> torch.Tensor:
    rows = logits.shape[0]
    return (sampler or Sampler()).sample(logits, [params] * rows, list(range(rows)))


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * tokens.numel()
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    return float(((observed - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------- greedy and filters


def test_output_is_int64_per_row() -> None:
    out = sample(random_logits(5), SamplingParams())
    assert out.dtype == torch.int64 and out.shape == (5,)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(top_k=1)])
def test_greedy_rows_are_argmax(params: SamplingParams) -> None:
    logits = random_logits(16)
    assert params.is_greedy
    assert torch.equal(sample(logits, params), logits.argmax(dim=-1))


def test_greedy_on_bfloat16_logits() -> None:
    logits = random_logits(4).bfloat16()
    assert torch.equal(sample(logits, SamplingParams(temperature=0)), logits.argmax(dim=-1))


def test_tiny_top_p_equals_greedy() -> None:
    logits = random_logits(32, seed=1)
    for seed in (None, 5):
        out = sample(logits, SamplingParams(top_p=1e-6, seed=seed))
        assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_only_draws_from_the_best_k() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]]).repeat(2000, 1)
    tokens = sample(logits, SamplingParams(top_k=2))
    assert set(tokens.tolist()) == {1, 3}


def test_top_p_keeps_the_smallest_head_reaching_the_mass() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept, _ = filtered_probs(probs.log(), [SamplingParams(top_p=0.8)])
    assert (kept[0] > 0).tolist() == [True, True, False, False]
    kept, _ = filtered_probs(probs.log(), [SamplingParams(top_p=0.81)])
    assert (kept[0] > 0).tolist() == [True, True, True, False]


def test_min_p_filters_unlikely_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    tokens = sample(logits, SamplingParams(min_p=0.2))  # threshold 0.1 drops token 3
    assert set(tokens.tolist()) == {0, 1, 2}
    tokens = sample(logits, SamplingParams(min_p=0.7))  # threshold 0.35 keeps token 0 only
    assert set(tokens.tolist()) == {0}


def test_filters_are_per_row() -> None:
    logits = random_logits(3, seed=2)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)]
    out = Sampler().sample(logits, params, [0, 0, 0])
    assert torch.equal(out, logits.argmax(dim=-1))


# ---------------------------------------------------------------------- seeds and ranks


def test_seeded_draw_is_reproducible_and_ignores_batch_neighbours() -> None:
    target = random_logits(1, seed=3)
    params = SamplingParams(temperature=1.5, seed=1234)
    alone = [Sampler(seed=0).sample(target, [params], [step]).item() for step in range(8)]
    for neighbours_seed, row in ((4, 0), (5, 3), (6, 6)):
        logits = random_logits(7, seed=neighbours_seed)
        logits[row] = target[0]
        batch = [SamplingParams(top_k=5) for _ in range(7)]
        batch[row] = params
        sampler = Sampler(seed=neighbours_seed)  # a different sampler-level seed too
        drawn = [sampler.sample(logits, batch, [step] * 7)[row].item() for step in range(8)]
        assert drawn == alone
    assert len(set(alone)) > 1  # the step changes the draw


def test_identically_seeded_samplers_agree_like_tp_ranks() -> None:
    logits = random_logits(64, seed=7)
    params = [SamplingParams(temperature=0.8, top_p=0.9) for _ in range(64)]
    rank0, rank1 = Sampler(seed=42), Sampler(seed=42)
    for step in range(5):
        steps = [step] * 64
        assert torch.equal(rank0.sample(logits, params, steps), rank1.sample(logits, params, steps))
    other = Sampler(seed=43).sample(logits, params, [0] * 64)
    assert not torch.equal(Sampler(seed=42).sample(logits, params, [0] * 64), other)


def test_mix_seed_is_a_63_bit_spread() -> None:
    values = {mix_seed(seed, step) for seed in (-1, 0, 1, 2**40) for step in range(50)}
    assert len(values) == 200 and all(0 <= v < 2**63 for v in values)


# ---------------------------------------------------------------------- the softmax law


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_frequencies_follow_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    tokens = sample(logits.repeat(20000, 1), SamplingParams(temperature=temperature))
    probs = (logits / temperature).softmax(dim=-1)
    # Seeded, so deterministic; df = 3 and 30 is far in the tail (p ~ 1e-6) of a fair sampler.
    assert chi_square(tokens, probs) < 30
    # a frequency over 20000 draws has a standard error of at most 0.0035: 0.02 is 5.7 of them
    assert torch.allclose(frequencies(tokens, 4), probs.double(), atol=0.02)


def test_seeded_requests_follow_softmax_across_seeds() -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    sampler = Sampler()
    tokens = torch.tensor(
        [sampler.sample(logits, [SamplingParams(seed=s)], [0]).item() for s in range(4000)]
    )
    assert chi_square(tokens, logits[0].softmax(dim=-1)) < 30


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, r"temperature must be in \[0, 2\]"),
        ("temperature", 2.5, r"temperature must be in \[0, 2\]"),
        ("temperature", math.nan, "temperature must be a finite number"),
        ("top_p", math.inf, "top_p must be a finite number"),
        ("temperature", "hot", "temperature must be a number"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
        ("top_k", 0, "top_k must be -1"),
        ("top_k", -2, "top_k must be -1"),
        ("top_k", 2.5, "top_k must be an integer"),
        ("min_p", -0.1, r"min_p must be in \[0, 1\]"),
        ("min_p", 1.01, r"min_p must be in \[0, 1\]"),
        ("max_new_tokens", -1, "max_new_tokens must be >= 1"),
        ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
        ("seed", 2**64, "seed must fit in 64 bits"),
        ("stop", ["x"] * (MAX_STOP_STRINGS + 1), "stop takes at most"),
        ("stop", ["x" * (MAX_STOP_CHARS + 1)], "stop takes at most"),
        ("stop_token_ids", list(range(65)), "stop_token_ids takes at most"),
        ("ignore_eos", "yes", "ignore_eos must be true or false"),
        ("seed", "x", "seed must be an integer"),
        ("stop", [1], "stop must be a string or a list of strings"),
        ("repetition_penalty", 0.0, r"repetition_penalty must be in \(0, 2\]"),
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
        ("frequency_penalty", -2.1, r"frequency_penalty must be in \[-2, 2\]"),
        ("min_tokens", 200, "min_tokens must be in"),
        ("min_tokens", -1, "min_tokens must be in"),
        ("logit_bias", {"5": 101}, "logit_bias takes at most"),
        ("logit_bias", {"five": 1}, "logit_bias must be an integer"),
        ("logit_bias", [1, 2], "logit_bias must be an object"),
        ("allowed_token_ids", [], "allowed_token_ids must not be empty"),
        ("allowed_token_ids", 5, "allowed_token_ids must be a list"),
        ("bad_words", [""], "bad_words takes at most"),
        ("bad_words", [3], "bad_words must be a string or a list"),
        ("logprobs", 21, r"logprobs must be in \[0, 20\]"),
        ("logprobs", -1, r"logprobs must be in \[0, 20\]"),
        ("n", 0, "n must be in"),
        ("include_stop_str_in_output", 1, "include_stop_str_in_output must be true or false"),
    ],
)
def test_out_of_range_values_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).normalize()


def test_edge_values_are_accepted_and_coerced() -> None:
    params = SamplingParams(temperature=0, top_p=1, min_p=1, max_new_tokens=1, stop="END")
    assert params.normalize() is params
    assert params.stop == ["END"] and isinstance(params.temperature, float) and params.is_greedy
    assert SamplingParams(top_k=3.0, stop_token_ids=(7,)).normalize().top_k == 3


def test_control_fields_are_coerced() -> None:
    params = SamplingParams(logit_bias={"12": 3, 7: -1.5}, allowed_token_ids=(4.0, 5)).normalize()
    assert params.logit_bias == {12: 3.0, 7: -1.5} and params.allowed_token_ids == [4, 5]
    assert params.uses_controls and not SamplingParams().normalize().uses_controls
    assert SamplingParams(logprobs=0).normalize().uses_controls is False  # logprobs read raw


def test_mismatched_batch_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="logit rows"):
        Sampler().sample(random_logits(2), [SamplingParams()], [0, 0])


# ---------------------------------------------------------------------- numerical safety


@pytest.mark.parametrize("seed", [None, 3])
def test_temperature_that_rounds_to_zero_is_greedy(seed: int | None) -> None:
    """Issue 10, seen 2: temperature 1e-39 is 0 in float32; it used to give inf/NaN probs and
    torch.multinomial raised, killing rank 0."""
    logits = random_logits(8, seed=2)
    params = SamplingParams(temperature=1e-39, seed=seed).normalize()
    assert params.is_greedy
    assert torch.equal(sample(logits, params), logits.argmax(dim=-1))
    sampled = SamplingParams(temperature=2e-5, seed=seed).normalize()  # above the floor
    assert torch.equal(sample(logits, sampled), logits.argmax(dim=-1))


@pytest.mark.parametrize("seed", [None, 3])
def test_top_p_that_rounds_to_zero_keeps_the_best_token(seed: int | None) -> None:
    """Issue 10, seen 2: top_p 1e-50 is 0 in float32 and used to mask every token."""
    logits = random_logits(8, seed=4)
    params = SamplingParams(top_p=1e-50, seed=seed).normalize()
    assert torch.equal(sample(logits, params), logits.argmax(dim=-1))


def test_non_finite_rows_fail_alone() -> None:
    logits = random_logits(4, seed=5)
    logits[1, 3] = math.nan
    logits[2, 0] = math.inf
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(), SamplingParams()]
    tokens, errors = Sampler().sample_safe(logits, params, [0, 0, 0, 0])
    assert set(errors) == {1, 2} and "non-finite" in errors[1]
    assert tokens[1] == tokens[2] == FAILED_TOKEN
    assert tokens[0] == int(logits[0].argmax())
    assert 0 <= tokens[3] < VOCAB


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bad_row_mask_reads_each_kind_of_bad_row(dtype: torch.dtype) -> None:
    """NaN anywhere, +inf anywhere, nothing finite: bad; -inf beside finite values: fine."""
    logits = random_logits(7, seed=6).to(dtype)
    logits[1, 3] = math.nan
    logits[2, VOCAB - 1] = math.inf
    logits[3] = -math.inf
    logits[4, : VOCAB // 2] = -math.inf
    logits[5, 0], logits[5, 7] = math.inf, math.nan
    logits[6] = math.nan
    assert bad_row_mask(logits).tolist() == [False, True, True, True, False, True, True]
    assert bad_rows(logits) == [1, 2, 3, 5, 6]


def test_a_row_with_nothing_to_draw_fails_alone() -> None:
    """A row of all -inf has nothing to draw: that request fails, its neighbours sample."""
    logits = random_logits(3, seed=6)
    logits[0] = -math.inf
    tokens, errors = Sampler().sample_safe(logits, [SamplingParams()] * 3, [0, 0, 0])
    assert list(errors) == [0] and tokens[0] == FAILED_TOKEN
    assert all(0 <= t < VOCAB for t in tokens[1:])


# ---------------------------------------------------------------------- controls' bookkeeping


def test_a_batch_without_controls_is_not_touched() -> None:
    from runtime.sampling_controls import apply_controls

    logits = random_logits(4)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, logprobs=3).normalize() for _ in range(4)]
    assert apply_controls(logits, params, [0] * 4, None) is logits
    assert torch.equal(logits, before)


def test_state_kept_token_by_token_equals_a_rebuild() -> None:
    """The counts move with each accepted token; a request rebuilt from its tokens (after a
    recompute) gets the same state."""
    from runtime.sampling_controls import SamplingState

    params = SamplingParams(
        repetition_penalty=1.2, frequency_penalty=0.5, bad_words_ids=[[5, 6, 7]]
    ).normalize()
    prompt = [1, 2, 3, 2, 10**6]  # a pad value outside the vocabulary is not counted
    output = [4, 2, 4, 9, 4, 5, 6]
    state = SamplingState.for_request(params, prompt, len(prompt), VOCAB)
    for token in output:
        state.accept(token)
    rebuilt = SamplingState.for_request(params, prompt + output, len(prompt), VOCAB)
    for s in (state, rebuilt):
        assert s.prompt_seen == [1, 2, 3] and s.output_seen == [4, 9, 5, 6]
        assert s.counts == {4: 3, 2: 1, 9: 1, 5: 1, 6: 1} and s.recent == [5, 6]
        assert s.banned_by_words(params.bad_words_ids) == [7]
    assert SamplingState.for_request(SamplingParams(), prompt, len(prompt), VOCAB) is None


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_batch_without_controls_reads_the_device_once(
    temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU each read of a device value waits for the step: the tokens and the rows that
    failed come back in one read, with no data-dependent op (nonzero) before it, also when a
    row's logits are bad."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads: list[int] = []
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> list:
        reads.append(self.numel())
        return tolist(self)

    class Ops(TorchDispatchMode):
        seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    logits = random_logits(4, seed=7)
    logits[2, 1] = math.nan
    params = [SamplingParams(temperature=temperature).normalize() for _ in range(4)]
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    with Ops() as ops:
        tokens, errors = Sampler().sample_safe(logits, params, [0] * 4)
    assert len(reads) == 1 and reads[0] == 8  # four tokens and four flags
    assert "nonzero" not in ops.seen and "_local_scalar_dense" not in ops.seen
    assert list(errors) == [2] and tokens[2] == FAILED_TOKEN
    assert all(0 <= t < VOCAB for i, t in enumerate(tokens) if i != 2)
    if temperature == 0.0:
        assert tokens[0] == int(logits[0].argmax())


# ---------------------------------------------------------------------- drawing on the device


def on_device(
    logits: torch.Tensor,
    params: list[SamplingParams],
    steps: list[int],
    draw: int = 0,
    sampler: Sampler | None = None,
) -> list:
    columns = sampler_columns(params, logits.shape[-1])
    return (sampler or Sampler()).sample_on_device(logits, params, steps, columns, draw).tolist()


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11),
    SamplingParams(temperature=1.3, top_k=5, seed=-4),
    SamplingParams(temperature=0.6, min_p=0.2, seed=2**63),
    SamplingParams(top_k=1),
    SamplingParams(temperature=1e-7, seed=3),
    SamplingParams(temperature=2.0, top_k=-1, top_p=1e-9, seed=8),
]


def test_device_draws_equal_sample_for_greedy_and_seeded_rows() -> None:
    """Overlapped decode draws with `sample_on_device` (settings from staged columns, no host
    index): every greedy and seeded row gets `sample`'s token, at each step and for rows in
    any order."""
    for seed in range(6):
        logits = random_logits(len(MIXED), seed)
        steps = [seed * 3 + i for i in range(len(MIXED))]
        assert on_device(logits, MIXED, steps) == Sampler().sample(logits, MIXED, steps).tolist()
        flipped = MIXED[::-1]
        got = on_device(logits.flip(0), flipped, steps[::-1])
        assert got == Sampler().sample(logits.flip(0), flipped, steps[::-1]).tolist()


def test_unseeded_device_draws_follow_the_filtered_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0]).repeat(20000, 1)
    params = [SamplingParams(temperature=0.7, top_k=3)] * 20000
    tokens = torch.tensor(on_device(logits, params, [0] * 20000))
    probs = torch.tensor([1.0, 0.5, 0.0]) / 0.7
    probs = torch.cat((probs.softmax(dim=-1), torch.zeros(1)))
    assert tokens.max() < 3  # top_k holds
    assert torch.allclose(frequencies(tokens, 4), probs.double(), atol=0.02)


def test_a_bad_row_draws_from_zeros_and_leaves_the_others_alone() -> None:
    logits = random_logits(3, 5)
    logits[1, 4] = float("nan")
    params = [SamplingParams(temperature=0.9, seed=i) for i in range(3)]
    got = on_device(logits, params, [0, 0, 0])
    good = Sampler().sample(logits[[0, 2]], [params[0], params[2]], [0, 0]).tolist()
    assert [got[0], got[2]] == good and 0 <= got[1] < VOCAB


def test_sampler_columns_are_neutral_for_greedy_rows() -> None:
    columns = sampler_columns([SamplingParams(temperature=0.0), MIXED[2]], VOCAB)
    assert columns.shape == (5, 2) and columns.dtype == torch.float32
    assert columns[:, 0].tolist() == [1.0, VOCAB, 1.0, 0.0, 0.0]
    assert columns[:, 1].tolist() == [pytest.approx(1.3), 5.0, 1.0, 0.0, 1.0]


def test_unseeded_device_draws_agree_across_samplers_like_tp_ranks() -> None:
    """Every rank draws an overlapped step itself: samplers built alike, given the same logits
    and draw count, pick the same tokens whatever each drew before; another draw count, or
    another sampler seed, gives other tokens."""
    logits = random_logits(64, 9)
    params = [SamplingParams(temperature=1.5)] * 64
    rank0, rank1 = Sampler(seed=4), Sampler(seed=4)
    rank0.sample(logits, params, [0] * 64)  # a synchronous step only rank 0 drew
    first = on_device(logits, params, [0] * 64, draw=7, sampler=rank0)
    assert first == on_device(logits, params, [0] * 64, draw=7, sampler=rank1)
    assert first != on_device(logits, params, [0] * 64, draw=8, sampler=rank1)
    assert first != on_device(logits, params, [0] * 64, draw=7, sampler=Sampler(seed=5))
