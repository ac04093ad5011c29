"""The test suite's rounding bound (tests/numerics.py): it holds for sums taken in other orders
and still fails a real error."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_within_rounding, rounding_bound


def test_another_summation_order_stays_within_the_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=gen)
    forward = x.sum(dim=1)
    backward = x.flip(1).cumsum(dim=1)[:, -1]  # the same sums, other order and method
    pairwise = x.view(64, 2, 256).sum(dim=2).sum(dim=1)
    assert not torch.equal(forward, backward)  # the orders really round differently
    # each sum's inputs are of order one: scale them by the largest partial sum's magnitude
    scale = float(x.abs().sum(dim=1).max())
    assert_within_rounding(backward, forward, terms=512, scale=scale)
    assert_within_rounding(pairwise, forward, terms=512, scale=scale)


def test_a_real_error_fails() -> None:
    expected = torch.linspace(-8.0, 8.0, 100)
    wrong = expected.clone()
    wrong[17] += 0.01  # far below what a misloaded weight does, far above rounding
    with pytest.raises(AssertionError, match="above the rounding bound"):
        assert_within_rounding(wrong, expected, terms=4000)


def test_a_bound_too_loose_to_check_is_refused() -> None:
    expected = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="too loose"):
        assert_within_rounding(expected, expected, terms=64)


def test_bound_scales_with_dtype_terms_and_magnitude() -> None:
    eps = torch.finfo(torch.float32).eps
    assert rounding_bound(100, 10.0) == pytest.approx(1000 * eps)
    assert rounding_bound(100, 0.01) == pytest.approx(100 * eps)  # never below magnitude one
    assert rounding_bound(1, 1.0, torch.bfloat16) == 2**-7
