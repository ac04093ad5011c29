"""runtime/transport.py: messages with tensors travel as frames, tensors out of band, and the
entry rank's frames reach every rank unchanged."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_on_ranks

from runtime.io_struct import AbortReq, TokenizedGenerateReq
from runtime.multimodal import Modality, MultimodalDataItem, MultimodalInputs
from runtime.sampler import SamplingParams
from runtime.transport import broadcast_frames, from_frames, to_frames


def request(rid: str, pixels: torch.Tensor) -> TokenizedGenerateReq:
    item = MultimodalDataItem(
        Modality.IMAGE, pixels, hash=7, offsets=[(1, 3)],
        model_specific_data={"image_grid_thw": torch.tensor([1, 2, 4])},
    )  # fmt: skip
    mm = MultimodalInputs([item], torch.zeros(3, 3, dtype=torch.long))
    return TokenizedGenerateReq(rid, [1, 2, 3], SamplingParams(max_new_tokens=4), mm)


def test_tensors_go_out_of_band_and_come_back_equal() -> None:
    pixels = torch.randn(64, 1176)
    frames = to_frames(request("a", pixels))
    assert len(frames) == 4  # the pickle, the pixels, the grid, the positions
    assert memoryview(frames[0]).nbytes < 4096  # the pixels are not inside the pickle
    assert memoryview(frames[1]).nbytes == pixels.numel() * 4
    pixels[0, 0] = 123.0  # frames are views of the tensor's memory: no copy was made
    back = from_frames([bytes(f) for f in frames])
    got = back.mm_inputs.items[0]
    assert got.feature[0, 0] == 123.0 and torch.equal(got.feature, pixels)
    assert got.image_grid_thw.tolist() == [1, 2, 4] and back.rid == "a"


def test_non_contiguous_bfloat16_and_plain_messages() -> None:
    wide = torch.arange(24.0).view(4, 6)[:, ::2]
    half = torch.ones(3, dtype=torch.bfloat16)
    back = from_frames(to_frames({"wide": wide, "half": half, "abort": AbortReq("x")}))
    assert torch.equal(back["wide"], wide) and back["half"].dtype == torch.bfloat16
    assert back["abort"] == AbortReq("x")
    assert from_frames(to_frames([])) == [] and len(to_frames([])) == 1


def broadcast_worker(tp) -> list:  # noqa: ANN001
    """Two rounds on every rank: three messages (one with an empty tensor), then none."""
    sent = None
    if tp.rank == 0:
        sent = [to_frames(request("r0", torch.full((5, 3), 2.0))), to_frames(AbortReq("r1"))]
        sent.append(to_frames(request("r2", torch.zeros(0, 3))))
    rounds = []
    for batch in (sent, [] if tp.rank == 0 else None):
        got = [from_frames(f) for f in broadcast_frames(batch, tp.rank, tp.cpu_group, tp.size)]
        rounds.append(
            [(m.rid, None if m.mm_inputs is None else m.mm_inputs.items[0].feature)
             if isinstance(m, TokenizedGenerateReq) else m for m in got]
        )  # fmt: skip
    return rounds


@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_frames_reaches_every_rank(world_size: int) -> None:
    for first, second in run_on_ranks(broadcast_worker, world_size, timeout=120):
        assert second == []
        (rid0, pixels0), abort, (rid2, pixels2) = first
        assert (rid0, rid2, abort) == ("r0", "r2", AbortReq("r1"))
        assert torch.equal(pixels0, torch.full((5, 3), 2.0)) and pixels2.shape == (0, 3)


def shm_worker(tp, shm_dir: str, listed: str) -> tuple:  # noqa: ANN001
    """One broadcast whose large pixels go through a shared-memory file in shm_dir; returns what
    backs the received frames, the features, the abort and what is left in `listed`."""
    sent = None
    if tp.rank == 0:
        big = torch.arange(40_000, dtype=torch.float32).view(400, 100)  # 160 kB: shared
        sent = [to_frames(request("big", big)), to_frames(AbortReq("x"))]
        sent.append(to_frames(request("small", torch.ones(2, 3))))  # 24 bytes: inline
    frames = broadcast_frames(sent, tp.rank, tp.cpu_group, tp.size, shm_dir)
    msgs = [from_frames(f) for f in frames]
    tp.all_reduce_cpu(torch.zeros(1))  # every rank has returned, so rank 0 has unlinked
    backing = [type(memoryview(f).obj).__name__ for f in (frames[0][1], frames[2][1])]
    features = [msgs[0].mm_inputs.items[0].feature, msgs[2].mm_inputs.items[0].feature]
    features[0].add_(0)  # a mapped feature takes an in-place write without faulting
    return backing, [f.clone() for f in features], msgs[1], os.listdir(listed)


@pytest.mark.parametrize("world_size", [2, 3])
def test_large_frames_cross_ranks_through_shared_memory(world_size: int, tmp_path) -> None:  # noqa: ANN001
    results = run_on_ranks(shm_worker, world_size, str(tmp_path), str(tmp_path), timeout=120)
    for rank, (backing, (big, small), abort, left) in enumerate(results):
        assert torch.equal(big, torch.arange(40_000.0).view(400, 100))
        assert torch.equal(small, torch.ones(2, 3)) and abort == AbortReq("x")
        assert left == []  # unlinked once every rank had mapped it; the mapping still reads
        if rank:
            assert backing == ["mmap", "ndarray"]  # the big pixels mapped, the small ones sent


def test_shared_memory_that_cannot_be_written_falls_back_to_the_group(tmp_path) -> None:  # noqa: ANN001
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    results = run_on_ranks(shm_worker, 2, str(not_a_folder), str(tmp_path), timeout=120)
    backing, (big, _), _, left = results[1]
    assert backing == ["ndarray", "ndarray"] and left == ["file"]
    assert torch.equal(big, torch.arange(40_000.0).view(400, 100))
