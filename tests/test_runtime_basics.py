"""Distributed helpers, TP layer slicing rules, config parsing and checkpoint-loading errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import run_on_ranks
from safetensors.torch import load_file, save_file

from runtime.cpus import rank_cpus, threads_per_rank, usable_cpus
from runtime.distributed import TPGroup
from runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.linear import QKVParallelLinear, RowParallelLinear, dense_weight
from runtime.model_config import ModelConfig, ModelConfigError
from runtime.model_loader import CheckpointError
from runtime.tiny_checkpoint import make_checkpoint
from vision.vlm import build_model

ROOT = Path(__file__).resolve().parents[1]


def collectives_worker(tp: TPGroup) -> dict:
    payload = {"ids": list(range(1000)), "text": "é" * 10} if tp.rank == 0 else None
    got = tp.broadcast_pyobj(payload)
    empty = tp.broadcast_pyobj([] if tp.rank == 0 else "ignored")
    summed = tp.all_reduce(torch.full((3,), float(tp.rank + 1)))
    gathered = tp.all_gather(torch.full((2, 1), float(tp.rank)), dim=-1)
    return {"got": got, "empty": empty, "sum": summed, "gathered": gathered}


@pytest.mark.parametrize("world_size", [2, 4])
def test_broadcast_pyobj_and_collectives(world_size: int) -> None:
    results = run_on_ranks(collectives_worker, world_size, timeout=120)
    total = world_size * (world_size + 1) / 2
    for r in results:
        assert r["got"] == {"ids": list(range(1000)), "text": "é" * 10}
        assert r["empty"] == []
        assert r["sum"].tolist() == [total] * 3
        assert r["gathered"].tolist() == [list(map(float, range(world_size)))] * 2


def test_qkv_heads_must_divide() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        QKVParallelLinear(64, 16, 4, 2, TPGroup(rank=0, size=3))


def test_kv_heads_replicated_when_fewer_than_ranks() -> None:
    full = torch.randn(64 + 32 + 32, 64)
    for rank in range(4):
        layer = QKVParallelLinear(64, 16, 4, 2, TPGroup(rank=rank, size=4), bias=False)
        layer.weight_loader(layer.weight, full)
        kv_head = rank // 2
        k_rows = full[64 + 16 * kv_head : 64 + 16 * (kv_head + 1)]
        assert torch.equal(layer.weight[16:32], k_rows)
        assert torch.equal(layer.weight[:16], full[16 * rank : 16 * (rank + 1)])


def test_row_parallel_slices_input_columns() -> None:
    full = torch.randn(8, 12)
    layer = RowParallelLinear(12, 8, TPGroup(rank=2, size=3), bias=False)
    layer.weight.weight_loader(layer.weight, full)
    assert torch.equal(layer.weight, full[:, 8:12])


def test_vocab_padding_rows_are_zero_and_cut_from_logits() -> None:
    full = torch.randn(10, 4)
    emb = VocabParallelEmbedding(10, 4, TPGroup(rank=2, size=3))  # rows 8..11, two real
    emb.weight_loader(emb.weight, full)
    assert torch.equal(emb.weight[:2], full[8:]) and not emb.weight[2:].any()
    head = ParallelLMHead(10, 4, TPGroup())
    head.weight_loader(head.weight, full)
    assert head(torch.randn(3, 4)).shape == (3, 10)


def test_config_accepts_flat_and_nested_layouts(tmp_path: Path) -> None:
    folder = make_checkpoint("qwen2_vl", tmp_path / "ck")
    flat = json.loads((folder / "config.json").read_text())
    text_keys = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "rms_norm_eps",
        "max_position_embeddings",
    ]
    nested = {k: v for k, v in flat.items() if k not in text_keys + ["rope_scaling", "rope_theta"]}
    nested["text_config"] = {k: flat[k] for k in text_keys}
    nested["text_config"]["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": flat["rope_theta"],
        "mrope_section": flat["rope_scaling"]["mrope_section"],
    }
    assert ModelConfig.from_dict(nested).text == ModelConfig.from_dict(flat).text


def test_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    folder = make_checkpoint("qwen2_vl", tmp_path / "ck")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.1.mlp.gate_up_proj"):
        build_model(str(folder), TPGroup())


def test_sharded_checkpoint_with_index_loads_the_same(tmp_path: Path) -> None:
    folder = make_checkpoint("qwen2_5_vl", tmp_path / "ck")
    sharded = tmp_path / "sharded"
    shutil.copytree(folder, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file)
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = dict(build_model(str(folder), TPGroup()).named_parameters())
    b = dict(build_model(str(sharded), TPGroup()).named_parameters())
    # linear weights come back packed for oneDNN on CPU: compare their plain values
    same = all(torch.equal(dense_weight(a[k]), dense_weight(b[k])) for k in a)
    assert a.keys() == b.keys() and same


def test_vit_benchmark_prints_every_mode(tmp_path: Path) -> None:
    out, png = tmp_path / "vit.json", tmp_path / "vit.png"
    cmd = [
        sys.executable,
        str(ROOT / "scripts/bench_vit_dp_vs_tp.py"),
        "--tp",
        "2",
        "--random-images",
        "3",
        "--max-size",
        "224",
        "--warmup",
        "0",
        "--repeat",
        "2",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DP speed-up over TP" in proc.stdout and "auto vs TP" in proc.stdout
    assert "paired per round" in proc.stdout
    data = json.loads(out.read_text())
    assert data["calibration"]["dp_patch_s"] + data["calibration"]["dp_pair_s"] > 0
    results = data["results"]
    assert [(r["workload"], r["mode"]) for r in results] == [
        ("random", "tp"),
        ("random", "dp"),
        ("random", "auto"),
    ]
    tp, dp, auto = results
    assert sum(dp["patches_per_rank"]) == tp["patches_per_rank"][0]
    assert tp["collective_bytes_per_rank"] > 0 and dp["collective_bytes_per_rank"] > 0
    assert sum(auto["plans"].values()) == 2  # one plan per timed batch
    assert len(auto["round_ms"]) == 2 and min(auto["round_ms"]) > 0  # each timed round
    history, rounds = data["auto_history"], auto["plans_per_round"]
    assert len(history) == len(rounds) == 2  # one auto call per round, warm-up rounds included
    for h, counts in zip(history, rounds):
        assert h["workload"] == "random" and set(h["ratios"]) == {"dp", "tp", "hybrid"}
        assert counts[h["kind"]] == 1 and sum(counts.values()) == 1 + h["explored"]
    assert png.stat().st_size > 0


def test_vit_benchmark_stops_at_once_when_a_rank_fails(tmp_path: Path) -> None:
    """A rank that raises ends the run within seconds with its own error (not the parent's
    half-hour wait on the result queue), and every rank is gone when it returns."""
    import multiprocessing

    import bench_vit_dp_vs_tp as bench

    missing = tmp_path / "no-such-costs.json"
    args = bench.parse_args(["--tp", "2", "--random-images", "1", "--max-size", "112",
                             "--warmup", "0", "--repeat", "1", "--encoder-costs", str(missing),
                             "--device", "cpu", "--attention-backend", "torch"])  # fmt: skip
    args.videos = True
    start = time.monotonic()
    with pytest.raises(bench.RankError, match="no-such-costs.json") as info:
        bench.spawn(args, str(make_checkpoint("qwen2_vl", tmp_path / "tiny")))
    assert time.monotonic() - start < 120
    assert "failed" in str(info.value) and "FileNotFoundError" in str(info.value)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(("arch", "max_tiles"), [("internvl", None), ("gemma3", 5),
                                                 ("glm4v", None)])  # fmt: skip
def test_vit_benchmark_items_are_what_the_processor_makes(
    arch: str, max_tiles: int | None, tmp_path: Path
) -> None:
    """The benchmark's image of each workload size has the grid the media worker (the family's
    HF image processor) gives an image of that size: InternVL's tiles and thumbnail, Gemma 3's
    fixed size with pan-and-scan crops, GLM-4.1V's resize. A family without videos runs no
    video workload, and `mixed` without its video batch."""
    import io

    import bench_vit_dp_vs_tp as bench
    from PIL import Image

    from tokenizer_manager.media.limits import MediaLimits
    from tokenizer_manager.media.worker import process_image_bytes

    folder = str(make_checkpoint(arch, tmp_path / arch))
    spec = bench.bench_spec(folder, max_tiles)
    grids = []
    for height, width in [(896, 896), (224, 224), (256, 600)]:
        png = io.BytesIO()
        Image.new("RGB", (width, height), (90, 30, 200)).save(png, format="PNG")
        grids.append(list(process_image_bytes(png.getvalue(), spec, MediaLimits()).grid_thw))
        assert bench.item_grid(spec, 1, height, width) == grids[-1]
    tiles = {"internvl": [10, 10, 11], "gemma3": [1, 1, 3], "glm4v": [1, 1, 1]}[arch]
    assert [grid[0] for grid in grids] == tiles  # 56 px tiles: 3 x 3 and a thumbnail; 2 crops
    args = bench.parse_args(["--workload", "all"])
    workloads = bench.checkpoint_workloads(args, folder)
    videos = arch == "glm4v"
    assert ("video" in workloads) is videos
    mixed = bench.workload_batches("mixed", args)
    assert any(frames > 1 for batch in mixed for frames, _, _ in batch) is videos


def test_vit_benchmark_dp_mode_spreads_tiles_and_frames_as_the_server_does() -> None:
    """Static DP balances frame units (tiles, video frames), as the server's DP mode does: one
    ten-tile image or one four-frame video spreads over both ranks instead of loading one."""
    from types import SimpleNamespace

    import bench_vit_dp_vs_tp as bench

    runner = SimpleNamespace(base=SimpleNamespace(size=2))
    assert bench.mode_loads("dp", runner, [[[10, 16, 16]]]) == [5 * 256, 5 * 256]
    assert bench.mode_loads("dp", runner, [[[4, 8, 8], [1, 8, 8]]]) == [3 * 64, 2 * 64]
    assert bench.mode_loads("tp", runner, [[[10, 16, 16]]]) == [2560, 2560]


def test_ranks_share_the_usable_cpus() -> None:
    cpus = [4, 5, 6, 7, 8]  # e.g. `taskset -c 4-8` on a larger machine
    assert [rank_cpus(r, 2, cpus) for r in range(2)] == [[4, 5], [6, 7]]
    assert threads_per_rank(2, cpus) == 2 and threads_per_rank(8, cpus) == 1
    assert rank_cpus(0, 8, cpus) is None  # fewer CPUs than ranks: no pinning
    assert usable_cpus() == sorted(os.sched_getaffinity(0))


def test_a_rank_counts_the_cpus_it_may_use_not_the_machine() -> None:
    """Under `taskset -c 0` a process sees one CPU, whatever the machine has."""
    code = "from runtime.cpus import threads_per_rank; print(threads_per_rank(1))"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "1"
