"""The static decode path (CUDA graphs' inputs, run eagerly on CPU) against the dynamic one.

Two runners over one model take the same requests through the same steps; one decodes over
static, padded buffers. Their logits and every real KV slot must agree, and the padded rows may
write nowhere but the padding slot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fake_cuda_graph  # noqa: E402
from device_check import DeviceRules  # noqa: E402
from numerics import assert_within_rounding, model_terms  # noqa: E402
from runner_utils import extend  # noqa: E402
from torch import nn  # noqa: E402

from runtime.decode_graphs import pad_step, padded_batch_sizes, padded_size  # noqa: E402
from runtime.distributed import TPGroup  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402
from runtime.tiny_checkpoint import make_checkpoint  # noqa: E402
from scheduler.model_runner import ModelRunner  # noqa: E402
from scheduler.req import Req  # noqa: E402
from vision.vlm import build_model  # noqa: E402

PROMPTS = [list(range(10, 17)), list(range(30, 33)), list(range(50, 61))]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_padded_sizes() -> None:
    assert padded_batch_sizes(1) == (1,)
    assert padded_batch_sizes(6) == (1, 2, 4, 6)
    assert padded_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = padded_batch_sizes(32)
    assert sizes == (1, 2, 4, 8, 16, 24, 32)
    assert [padded_size(b, sizes) for b in (1, 3, 5, 17, 32, 33)] == [1, 4, 8, 24, 32, None]
    with pytest.raises(ValueError):
        padded_batch_sizes(0)


def test_pad_step_points_padding_at_the_padding_slot() -> None:
    ids, slots, rows, cols = (torch.tensor(x) for x in ([7, 8], [40, 41], [2, 0], [5, 9]))
    positions = torch.tensor([[5, 12], [5, 12], [5, 12]])
    out = pad_step(ids, positions, slots, rows, cols, 4, padding_row=6)
    assert [t.tolist() for t in out] == [
        [7, 8, 0, 0],
        [[5, 12, 0, 0]] * 3,
        [40, 41, 0, 0],
        [2, 0, 6, 6],
        [6, 10, 1, 1],  # lengths: the new token's column + 1; padded rows see one slot
    ]


def test_graph_flags() -> None:
    cpu = ServerArgs(device="cpu")
    assert cpu.decode_graph_bs == 0  # off on CPU
    cuda = ServerArgs(device="cuda", max_running_requests=48)
    assert cuda.decode_graph_bs == 48
    assert ServerArgs(device="cuda", cuda_graph_max_bs=8).decode_graph_bs == 8
    assert ServerArgs(device="cuda", disable_cuda_graph=True).decode_graph_bs == 0
    with pytest.raises(ValueError, match="--cuda-graph-max-bs"):
        ServerArgs(device="cpu", cuda_graph_max_bs=0).check()
    parsed = ServerArgs.from_cli(["--device", "cpu", "--cuda-graph-max-bs", "16"])
    assert parsed.cuda_graph_max_bs == 16 and not parsed.disable_cuda_graph


def new_runner(model: nn.Module, max_bs: int, device: str = DEVICE) -> ModelRunner:
    return ModelRunner(
        model, max_total_tokens=256, max_running_requests=4, max_context_len=48,
        device=device, cuda_graph_max_bs=max_bs,
    )


def decode_run(runner: ModelRunner, steps: int) -> list[torch.Tensor]:
    """Prefill PROMPTS, then `steps` greedy decode steps of all three (one leaves after the
    first, so later steps pad a batch of two); the logits of every decode step."""
    reqs = [Req(list(p), None) for p in PROMPTS]
    for req in reqs:
        runner.admit(req)
    logits = extend(runner, reqs, [len(p) for p in PROMPTS])
    out = []
    for step in range(steps):
        for req, row in zip(reqs, logits):
            req.token_ids.append(int(row.argmax()))
        logits = runner.decode(reqs)
        out.append(logits)
        if step == 0:
            reqs = reqs[1:]
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> nn.Module:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("ck"))
    return build_model(str(folder), TPGroup(), dtype="float32", device=DEVICE)


@pytest.mark.parametrize("max_bs", [4, 8])
def test_static_decode_equals_dynamic(model: nn.Module, max_bs: int) -> None:
    """Batches of 3 and 2 padded to 4 (or 8): the same logits as the dynamic path, the same K/V
    in every real slot, and the padded rows wrote only into the padding slot 0."""
    dynamic, static = new_runner(model, 0), new_runner(model, max_bs)
    assert static.graphs is not None and dynamic.graphs is None
    expected, got = decode_run(dynamic, 4), decode_run(static, 4)
    # a padded batch only changes how the matrix products block their sums: rounding apart
    terms = model_terms(model.config, 48)
    for a, b in zip(expected, got):
        assert_within_rounding(b, a, terms)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for bufs in ("k_buffers", "v_buffers"):
        for a, b in zip(getattr(dynamic.kv_pool, bufs), getattr(static.kv_pool, bufs)):
            assert_within_rounding(b[1:], a[1:], terms)
            assert not a[0].any() and b[0].any()  # only the static run padded
    pad = static.req_pool.padding_row
    assert not static.req_pool.req_to_token[pad].any()
    live = static.req_pool.req_to_token[: static.req_pool.size]
    assert torch.equal(live, dynamic.req_pool.req_to_token[: dynamic.req_pool.size])


def test_static_decode_over_its_size_runs_dynamically(model: nn.Module) -> None:
    """A batch larger than the largest captured size takes the dynamic path."""
    dynamic, static = new_runner(model, 0), new_runner(model, 2)
    assert static.graphs is not None and not static.graphs.fits(3)
    first_dynamic, first_static = decode_run(dynamic, 1)[0], decode_run(static, 1)[0]
    assert torch.equal(first_static, first_dynamic)  # the very same path: bit-equal


def test_captured_decode_replays_each_steps_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Captured once and replayed over later steps (CPU graphs that replay recorded ops and no
    Python, as CUDA's do): the dynamic path's logits at every step. A capture that reused the
    warm-up's per-forward metadata replayed the captured step's lengths and rows (the first
    GPU run: logits off by 7.7). The torch backend only: the Triton interpreter's launches are
    no aten ops, so the fake graphs cannot record them; the Triton backend builds its
    metadata by the same per-batch rule."""
    folder = make_checkpoint("qwen2_vl", tmp_path / "ck")
    model = build_model(
        str(folder), TPGroup(), attention_backend="torch", dtype="float32", device="cpu"
    )
    graphs = fake_cuda_graph.install(monkeypatch)  # after the imports that read torch.cuda
    dynamic, captured = new_runner(model, 0, "cpu"), new_runner(model, 4, "cpu")
    assert captured.graphs is not None
    captured.graphs.capture = True
    expected, got = decode_run(dynamic, 4), decode_run(captured, 4)
    assert sorted(captured.graphs._graphs) == [2, 4] and len(graphs) == 2
    assert [g.replays for g in graphs] == [1, 3]  # size 4 captured at step 1, size 2 after
    for a, b in zip(expected, got):
        assert_within_rounding(b, a, model_terms(model.config, 48))
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_static_decode_keeps_devices_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the meta device under DeviceRules: the static decode reads no device value on the
    host (what a CUDA graph could not capture) and mixes no host tensor into a device op."""
    import vision.vlm

    folder = make_checkpoint("qwen2_vl", tmp_path / "ck")
    monkeypatch.setattr(vision.vlm, "load_checkpoint", lambda *args: None)  # no data on meta
    meta_model = vision.vlm.build_model(str(folder), TPGroup(), dtype="float32", device="meta")
    runner = new_runner(meta_model, 4, "meta")
    reqs = [Req(list(p), None) for p in PROMPTS]
    for req in reqs:
        runner.admit(req)
    extend(runner, reqs, [len(p) for p in PROMPTS])
    for req in reqs:
        req.token_ids.append(3)
    with DeviceRules() as rules:
        logits = runner.decode(reqs)
    assert logits.shape[0] == 3 and logits.device.type == "meta"
    assert rules.copies == 1  # the step's one staged copy
    assert runner.graphs is not None
    with DeviceRules() as rules, torch.inference_mode():
        runner.graphs.static_forward(4)  # what a graph captures: table writes and the forward
    assert rules.copies == 0  # a captured host-to-device copy would replay stale values


def test_static_decode_on_triton_kernels(tmp_path: Path) -> None:
    """The Triton decode kernel reads the static tables (lengths, rows) on the device."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("triton was configured without the interpreter in this process")
    folder = make_checkpoint("qwen2_vl", tmp_path / "ck")
    model = build_model(
        str(folder), TPGroup(), attention_backend="triton", dtype="float32", device=DEVICE
    )
    expected, got = decode_run(new_runner(model, 0), 2), decode_run(new_runner(model, 4), 2)
    for a, b in zip(expected, got):
        assert_within_rounding(b, a, model_terms(model.config, 48))
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.gpu
def test_decode_graphs_capture_and_replay_on_cuda(model: nn.Module) -> None:
    """On CUDA each padded size is captured once, on first use, and replayed after: batches of
    3 then 2 use the graphs of 4 and 2, and give the dynamic path's tokens."""
    dynamic, static = new_runner(model, 0), new_runner(model, 8)
    assert static.graphs is not None and static.graphs.capture
    expected, got = decode_run(dynamic, 4), decode_run(static, 4)
    assert sorted(static.graphs._graphs) == [2, 4]
    for a, b in zip(expected, got):
        assert_within_rounding(b, a, model_terms(model.config, 48))
        assert torch.equal(a.argmax(-1), b.argmax(-1))
