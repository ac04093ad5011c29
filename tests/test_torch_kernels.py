"""The torch kernels' in-place and joint forms compute the reference formulas bit for bit
(HF's RMSNorm, one rotation per tensor, silu(gate) * up) and never write to their inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import activation, norm, rotary


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", ["same", "float32"])
def test_rms_norm_is_hf_bit_for_bit_and_leaves_its_input(
    dtype: torch.dtype, weight_dtype: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 512, generator=gen).to(dtype)
    residual = torch.randn(16, 512, generator=gen).to(dtype)
    weight = torch.randn(512, generator=gen).to(dtype if weight_dtype == "same" else torch.float32)
    x_before, residual_before = x.clone(), residual.clone()
    out = norm.rms_norm(x, weight, 1e-6)
    expected = hf_rms_norm(x, weight, 1e-6)
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    normed, summed = norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, hf_rms_norm(x + residual, weight, 1e-6))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("dim", [64, 512, 1280, 3584])
def test_float32_rms_norm_is_hf_bit_for_bit_at_model_shapes(rows: int, dim: int) -> None:
    """Float32 on a CPU takes torch's own rms_norm; it must keep HF's values exactly at the
    widths tessera's models use (a fused kernel summing in another order would not)."""
    gen = torch.Generator().manual_seed(rows * dim)
    for scale in (1e-3, 1.0, 30.0):
        x = torch.randn(rows, dim, generator=gen) * scale
        weight = torch.randn(dim, generator=gen)
        assert torch.equal(norm.rms_norm(x, weight, 1e-6), hf_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_rotary_of_q_and_k_equals_one_rotation_each(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(16, 8, 64, generator=gen).to(dtype)
    k = torch.randn(16, 2, 64, generator=gen).to(dtype)
    positions = torch.arange(16).expand(3, -1) + 250
    cos, sin = rotary.mrope_cos_sin(positions, 64, 1e6, (16, 24, 24))
    q_before, k_before = q.clone(), k.clone()
    q_rot, k_rot = rotary.apply_rotary_qk(q, k, cos, sin)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    assert torch.equal(q_rot, rotary.apply_rotary(q, cos, sin))
    assert torch.equal(k_rot, rotary.apply_rotary(k, cos, sin))
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_silu_and_mul_is_silu_of_gate_times_up() -> None:
    x = torch.randn(16, 2 * 1024, generator=torch.Generator().manual_seed(2))
    before = x.clone()
    gate, up = before.chunk(2, dim=-1)
    assert torch.equal(activation.silu_and_mul(x), F.silu(gate) * up)
    assert torch.equal(x, before)
