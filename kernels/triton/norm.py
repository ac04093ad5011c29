"""Triton RMSNorm and fused residual-add + RMSNorm, one program per row, float32 math.

Rounding follows the torch references in kernels/norm.py: the residual sum is rounded to the
input dtype before it is normalised, and the normalised row is rounded to the input dtype before
the weight is applied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(res_out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(res_out_ptr + row * stride_ro + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty_like(x2)
    r2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        )
    new_residual = res_out.view(x.shape) if residual is not None else None
    return out.view(x.shape), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; returns the input dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual) in one pass over the rows."""
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual
