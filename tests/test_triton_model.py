"""The whole tiny model on the Triton kernels (interpreter on CPU) against the torch ones.

With `attention_backend="triton"` the decoder's attention, RMSNorm and rotary and the vision
tower's rotary and RMSNorm run as Triton kernels; the tower's segment attention stays on torch's
SDPA (faster on a GPU), and the Triton segment kernel is put in its place here too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from numerics import assert_within_rounding, model_terms  # noqa: E402
from runner_utils import extend_all_logits, greedy_generate, release  # noqa: E402
from vlm_cases import Checkpoint, noise_image  # noqa: E402

from kernels.ops import KernelOps, triton_ops_with_varlen  # noqa: E402
from runtime.distributed import TPGroup  # noqa: E402
from runtime.tiny_checkpoint import make_checkpoint  # noqa: E402
from scheduler.model_runner import ModelRunner  # noqa: E402
from scheduler.req import Req  # noqa: E402
from vision.vlm import build_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # native kernels need device tensors


def run(folder: str, backend: str, ids: list[int], mm) -> tuple[torch.Tensor, list[int]]:
    model = build_model(
        folder, TPGroup(), attention_backend=backend, dtype="float32", device=DEVICE
    )
    # the decoder's norms and rotary and the vision tower follow the backend too
    assert model.visual.blocks[0].attn.ops.name == backend
    assert model.language_model.model.norm.ops.name == backend
    if backend == "triton":  # the Triton segment kernel in the tower as well
        with_varlen = triton_ops_with_varlen()
        for module in model.visual.modules():
            if isinstance(getattr(module, "ops", None), KernelOps):
                module.ops = with_varlen
    runner = ModelRunner(
        model, max_total_tokens=512, max_running_requests=2, max_context_len=256, device=DEVICE
    )
    seq = Req(list(ids), mm)
    runner.admit(seq)
    logits = torch.cat(
        [extend_all_logits(runner, seq, 20), extend_all_logits(runner, seq, len(ids) - 20)]
    )
    release(runner, seq)
    return logits, greedy_generate(runner, Req(list(ids), mm), 6)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_triton_backend_matches_torch_backend(tmp_path: Path, arch: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("triton was configured without the interpreter in this process")
    folder = str(make_checkpoint(arch, tmp_path / "ck"))
    ckpt = Checkpoint(Path(folder))
    case = ckpt.case("image", [noise_image(), "What is it?"])
    ref_logits, ref_tokens = run(folder, "torch", case.input_ids, case.mm)
    logits, tokens = run(folder, "triton", case.input_ids, case.mm)
    # Both backends round the same chains of sums in other orders: n*eps of the largest logit
    assert_within_rounding(logits, ref_logits, model_terms(ckpt.config, len(case.input_ids)))
    # fixed checkpoint seed and image: the same greedy tokens on every run
    assert tokens == ref_tokens
