"""Tolerances for comparing two float computations of the same values, derived, not tuned.

Two computations that differ only in rounding (another summation order, a fused kernel, a sum
split over TP ranks) each lie within n*u of the exact values, u = eps/2, when the chain of sums
behind a value has lengths adding up to n (Higham's worst-case bound, relative to the magnitude
summed). So they lie within n*eps of each other. The tiny models keep activations of order one
through every layer (fan-in scaled weights, norms), so the magnitude summed is taken as the
compared values' largest |value|, and never below one. The bound does not depend on the random
weights, the inputs, the thread count or the machine, only on the dtype and the shapes.
"""

from __future__ import annotations

import torch

from runtime.model_config import ModelConfig, VisionConfig


def rounding_bound(terms: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """The largest |a - b| between two roundings of values of magnitude `scale` behind which
    sums of `terms` terms in all (see the module docstring)."""
    return terms * torch.finfo(dtype).eps * max(scale, 1.0)


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float((actual.double() - expected.double()).abs().max())


def assert_within_rounding(
    actual: torch.Tensor,
    expected: torch.Tensor,
    terms: int,
    dtype: torch.dtype | None = None,
    scale: float | None = None,
) -> float:
    """Assert max |actual - expected| <= rounding_bound; returns that max difference.
    `scale` defaults to expected's largest |value|, `dtype` to expected's dtype. The bound must
    stay under 1% of the magnitude, so that a real error (a misloaded weight, a wrong position)
    still fails the comparison."""
    if scale is None:
        scale = float(expected.abs().max())
    bound = rounding_bound(terms, scale, dtype or expected.dtype)
    assert bound <= 0.01 * max(scale, 1.0), f"rounding bound {bound:.3g} too loose to check"
    diff = max_abs_diff(actual, expected)
    assert diff <= bound, f"max |diff| {diff:.3g} above the rounding bound {bound:.3g}"
    return diff


def block_terms(width: int, inner: int, context: int, head_dim: int) -> int:
    """Sum lengths through one pre-norm transformer block: the two norms, the q/k/v and output
    projections and the MLP's first projection (width each), q.k (head_dim), the softmax and
    p.v (context each) and the MLP's last projection (inner)."""
    return 5 * width + head_dim + 2 * context + inner


def vision_terms(v: VisionConfig, patches: int) -> int:
    """Sum lengths behind one merged row of a vision tower whose attention spans at most
    `patches` patches: the patch embedding, the blocks, the merger (a norm, then two projections
    over the merged rows)."""
    merged = v.embed_dim * v.spatial_merge_size**2
    blocks = v.depth * block_terms(v.embed_dim, v.intermediate_size, patches, v.head_dim)
    return v.patch_dim + blocks + v.embed_dim + 2 * merged


def model_terms(cfg: ModelConfig, tokens: int) -> int:
    """Sum lengths behind one logit of a VLM over `tokens` tokens (so no item has more than
    merge**2 * tokens patches): the vision tower, the decoder layers, the final norm and the
    LM head."""
    t, patches = cfg.text, tokens * cfg.vision.spatial_merge_size**2
    layers = t.num_hidden_layers * block_terms(t.hidden_size, t.intermediate_size, tokens,
                                               t.head_dim)
    return vision_terms(cfg.vision, patches) + layers + 2 * t.hidden_size


def kernel_bound(dtype: torch.dtype, terms: int, roundings: int) -> float:
    """Norm-wise relative bound between a kernel and its reference, both summing in float32
    from the same `dtype` inputs: float32's eps per summed term (`terms` in all), plus eps/2 for
    each rounding to `dtype` (a stored intermediate, an output) on the two sides together."""
    return terms * torch.finfo(torch.float32).eps + roundings * torch.finfo(dtype).eps / 2
