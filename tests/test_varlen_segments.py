"""Vision segments (cu_seqlens) prepared once per tower call and shared by its blocks.

`Segments` holds what every block's segment attention needs (host bounds, device bounds, the
longest segment, the torch path's token index per segment length); the towers build it once per
call, next to their rotary tables, instead of each block rebuilding it from the tensor. The
results are the same as from the tensor, exactly."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from kernels.attention.varlen import Segments, varlen_attention
from kernels.ops import TORCH_OPS, triton_ops_with_varlen
from runtime.distributed import TPGroup
from runtime.model_config import ModelConfig
from runtime.tiny_checkpoint import make_checkpoint
from vision.vlm import vision_tower_class

CASES = [[16, 16, 16], [16, 40, 7], [16, 16, 0, 4, 16, 9], [33]]


def qkv(lengths: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, sum(lengths), 2, 16, generator=gen).unbind(0)


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("lengths", CASES)
def test_segments_give_what_the_tensor_gives(lengths: list[int]) -> None:
    q, k, v = qkv(lengths, sum(lengths))
    segments = Segments.build(cu_of(lengths), q.device)
    assert segments.count == len(lengths) and segments.tokens == sum(lengths)
    assert segments.max_len == max(lengths)
    assert segments.uniform == (lengths[0] if len(set(lengths)) == 1 else 0)
    assert [n for n, _ in segments.groups] == sorted({n for n in lengths if n})
    expected = varlen_attention(q, k, v, cu_of(lengths), 0.25)
    assert torch.equal(varlen_attention(q, k, v, segments, 0.25), expected)
    assert torch.equal(varlen_attention(q, k, v, segments, 0.25), expected)  # reused: same


@pytest.mark.parametrize("lengths", CASES[1:3])
def test_triton_segments_give_what_the_tensor_gives(lengths: list[int]) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("triton was configured without the interpreter in this process")
    triton_varlen = triton_ops_with_varlen().varlen_attention
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels read device memory
    q, k, v = (x.to(device) for x in qkv(lengths, 7))
    segments = Segments.build(cu_of(lengths), q.device)
    expected = triton_varlen(q, k, v, cu_of(lengths), 0.25)
    assert torch.equal(triton_varlen(q, k, v, segments, 0.25), expected)


def recording_ops(seen: list[object], rebuild: dict[str, bool]) -> object:
    """The torch kernel set whose segment attention records what each block passes; with
    rebuild["on"], it drops the prepared segments and works from the bounds tensor."""

    def varlen(q, k, v, segments, scale):  # noqa: ANN001, ANN202 - the VarlenAttention type
        seen.append(segments)
        given = segments.host_bounds.clone() if rebuild["on"] else segments
        return varlen_attention(q, k, v, given, scale)

    return dataclasses.replace(TORCH_OPS, varlen_attention=varlen)


@pytest.mark.parametrize(
    ("arch", "distinct"), [("qwen2_vl", 1), ("qwen2_5_vl", 2), ("qwen3_vl", 1)]
)
def test_towers_build_segments_once_per_call(tmp_path: Path, arch: str, distinct: int) -> None:
    """Every block of one call gets the same prepared Segments (frames; Qwen2.5-VL also
    windows), and the output equals a run where each block rebuilds them from the tensor."""
    model_config = ModelConfig.from_dir(make_checkpoint(arch, tmp_path / "ck"))
    config = model_config.vision
    grids = torch.tensor([(1, 8, 12), (2, 8, 8), (1, 20, 4)])  # images, a video, edge windows
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(int(grids.prod(-1).sum()), config.patch_dim, generator=gen)
    seen: list[object] = []
    rebuild = {"on": False}
    tower = vision_tower_class(model_config)(config, TPGroup(), recording_ops(seen, rebuild))
    with torch.inference_mode():
        for p in tower.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        shared = tower(pixels, grids)
        assert len(seen) == config.depth and all(isinstance(s, Segments) for s in seen)
        assert len({id(s) for s in seen}) == distinct
        rebuild["on"] = True
        assert torch.equal(tower(pixels, grids), shared)
