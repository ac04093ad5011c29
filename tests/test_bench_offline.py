"""scripts/bench_offline.py on CPU: tessera and HF on the same prompts, floors, ratios, JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import bench_offline
import pytest
import torch

from kernels.attention.varlen import as_segments
from runtime.tiny_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    folder = make_checkpoint("qwen2_vl", tmp / "ck")
    out = tmp / "out.json"
    threads = torch.get_num_threads()
    try:
        return bench_offline.main([
            "--model-path", str(folder), "--device", "cpu", "--batch-sizes", "1,3",
            "--output-len", "8", "--image-size", "56x84", "--json", str(out),
            "--profile-decode", "3", "--profile-dir", str(tmp / "prof"),
        ]) | {"json_path": out, "profile_dir": tmp / "prof"}
    finally:
        torch.set_num_threads(threads)


def test_both_engines_run_every_batch(results: dict) -> None:
    for engine in ("tessera", "hf"):
        assert set(results[engine]) == {1, 3}
        for batch, r in results[engine].items():
            assert r["output_tokens"] == 8 * batch
            assert r["output_tokens_per_s"] > 0
    assert results["tessera"][3]["decode_step_median_s"] > 0
    assert results["prompt_tokens"] > 6  # the image's tokens are in the prompt


def test_greedy_outputs_equal_hf(results: dict) -> None:
    assert results["greedy_tokens_compared"] > 0
    assert results["greedy_match"], results


def test_floors_and_ratios(results: dict) -> None:
    floors = results["floors"]
    assert floors["copy_bandwidth_gb_s"] > 0 and floors["matmul_tflop_s"] > 0
    # the tiny decoder has fewer weights than its tied embedding table alone would be
    assert 0 < floors["decode_weight_bytes"] < 50e6
    assert floors["vision_patches_per_s"] > 0
    ratios = results["ratios"]
    assert {"throughput_vs_hf_b1", "throughput_vs_hf_b3", "decode_step_b1_over_floor"} <= set(
        ratios
    )
    assert all(v > 0 for v in ratios.values())


def test_json_written(results: dict) -> None:
    data = json.loads(Path(results["json_path"]).read_text())
    assert data["tessera"]["3"]["output_tokens"] == 24
    assert "tokens" not in data["hf"]["1"]
    assert data["args"]["batch_sizes"] == [1, 3]


def matmul_varlen_attention(q, k, v, cu_seqlens, scale):
    """Segment attention written as plain matmuls, so FlopCounterMode sees its FLOPs."""
    out = torch.empty_like(q)
    bounds = as_segments(cu_seqlens, q.device).host_bounds.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [heads, len, dim]
        weights = torch.softmax(torch.bmm(qs, ks.transpose(1, 2)) * scale, dim=-1)
        out[start:end] = torch.bmm(weights, vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_flops_match_a_flop_counter(tmp_path: Path, arch: str) -> None:
    """The analytic count equals what torch's FLOP counter measures on the real tower."""
    from torch.utils.flop_counter import FlopCounterMode

    from kernels.ops import TORCH_OPS
    from runtime.distributed import TPGroup
    from runtime.model_config import ModelConfig
    from vision.vlm import vision_tower_class

    config = ModelConfig.from_dir(make_checkpoint(arch, tmp_path / "ck"))
    ops = dataclasses.replace(TORCH_OPS, varlen_attention=matmul_varlen_attention)
    tower = vision_tower_class(config)(config.vision, TPGroup(), ops)
    grids = [(1, 8, 12), (2, 8, 8), (1, 20, 4)]  # images, a two-frame video, edge windows
    patches = sum(t * h * w for t, h, w in grids)
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        tower(torch.randn(patches, config.vision.patch_dim), torch.tensor(grids))
    expected = bench_offline.vision_flops(config, grids)
    assert counter.get_total_flops() == expected["total"]
    assert expected["attention"] > 0


def test_decode_profile(results: dict) -> None:
    """Three batch-1 decode steps under the profiler, after the prefill and one decode; its op
    tables and trace are written (on CPU there is no device time to report)."""
    prof = results["decode_profile"]
    assert prof["steps"] == 3 and prof["tokens_during_profile"] == 5
    assert prof["wall_ms_per_step"] > 0 and prof["device_ms_per_step"] is None
    table = (results["profile_dir"] / "decode_profile.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    trace = json.loads((results["profile_dir"] / "decode_trace.json").read_text())
    assert trace["traceEvents"]


def test_a_sampled_run_measures_tessera_alone(tmp_path: Path) -> None:
    """--temperature: tessera's requests sample (every batch runs, every token generated);
    HF is not run, its greedy tokens being no match for sampled ones."""
    folder = make_checkpoint("qwen2_vl", tmp_path / "ck")
    threads = torch.get_num_threads()
    try:
        out = bench_offline.main([
            "--model-path", str(folder), "--device", "cpu", "--batch-sizes", "1,2",
            "--output-len", "6", "--image-size", "56x56", "--temperature", "0.8",
        ])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert set(out["tessera"]) == {1, 2} and "hf" not in out
    with pytest.raises(SystemExit):
        bench_offline.main(["--temperature", "-1"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_varlen_attention_mode_needs_cuda_and_builds_no_checkpoint(tmp_path: Path) -> None:
    """`--varlen-attention` times the vision towers' segment kernels only: without a GPU it says
    so at once (it would otherwise time nothing), and it writes no report."""
    out = tmp_path / "varlen.json"
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench_offline.main(["--varlen-attention", "--json", str(out)])
    assert not out.exists()


@pytest.mark.gpu
def test_varlen_attention_mode_times_every_tile_against_torch() -> None:
    results = bench_offline.varlen_attention_bench(images=2, repeat=2)
    rows = results["rows"]
    assert {r["segments"] for r in rows} == {"window", "full"}
    expected = {"torch sdpa", *(f"triton {m}x{n}" for m, n in bench_offline.VARLEN_TILES)}
    assert {r["variant"] for r in rows} == expected
    timed = [r for r in rows if "error" not in r]
    assert {r["variant"] for r in timed} >= {"torch sdpa", "triton 64x64"}
    assert all(r["ms"] > 0 and r["max_abs_err"] < 5e-2 for r in timed)  # bfloat16 rounding
