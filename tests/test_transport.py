"""runtime/transport/: messages with tensors travel as frames, tensors out of band, and the
entry rank's frames reach every rank unchanged."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from dist_utils import run_on_ranks

from runtime.io_struct import AbortReq, TokenizedGenerateReq
from runtime.multimodal import Modality, MultimodalDataItem, MultimodalInputs
from runtime.sampling_params import SamplingParams
from runtime.transport import shm
from runtime.transport.broadcast import broadcast_frames, release_loaded
from runtime.transport.frames import from_frames, to_frames
from runtime.transport.shm import (
    MEDIA_PREFIX,
    MapBudget,
    SharedTensor,
    new_media_path,
    sweep_media_files,
)


def request(rid: str, pixels: torch.Tensor) -> TokenizedGenerateReq:
    item = MultimodalDataItem(
        Modality.IMAGE, pixels, hash=7, offsets=[(1, 3)], grid_thw=(1, 2, 4)
    )  # fmt: skip
    mm = MultimodalInputs([item], torch.zeros(3, 3, dtype=torch.long))
    return TokenizedGenerateReq(rid, [1, 2, 3], SamplingParams(max_new_tokens=4), mm)


def test_tensors_go_out_of_band_and_come_back_equal() -> None:
    pixels = torch.randn(64, 1176)
    frames = to_frames(request("a", pixels))
    assert len(frames) == 3  # the pickle, the pixels, the positions (the grid is plain ints)
    assert memoryview(frames[0]).nbytes < 4096  # the pixels are not inside the pickle
    assert memoryview(frames[1]).nbytes == pixels.numel() * 4
    pixels[0, 0] = 123.0  # frames are views of the tensor's memory: no copy was made
    back = from_frames([bytes(f) for f in frames])
    got = back.mm_inputs.items[0]
    assert got.feature[0, 0] == 123.0 and torch.equal(got.feature, pixels)
    assert got.grid_thw == (1, 2, 4) and back.rid == "a"


def test_an_item_answers_to_hf_names_from_its_one_grid() -> None:
    """The design's `model_specific_data` and attribute access (`item.image_grid_thw`) read the
    grid stored once in `grid_thw`, before and after the trip; the view adds no frame."""
    sent = request("a", torch.randn(8, 4))
    frames = to_frames(sent)
    assert len(frames) == 3  # the pickle, the pixels, the positions
    received = from_frames([bytes(f) for f in frames])
    for item in (sent.mm_inputs.items[0], received.mm_inputs.items[0]):
        assert item.image_grid_thw.tolist() == [[1, 2, 4]]
        assert list(item.model_specific_data) == ["image_grid_thw"]
        with pytest.raises(AttributeError, match="video_grid_thw"):
            item.video_grid_thw  # noqa: B018 - an image has no video grid
    video = MultimodalDataItem(Modality.VIDEO, grid_thw=(2, 4, 6), second_per_grid_t=0.5)
    data = video.model_specific_data
    assert data["video_grid_thw"].tolist() == [[2, 4, 6]] and data["second_per_grid_t"] == 0.5
    assert video.video_grid_thw.tolist() == [[2, 4, 6]]


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


# ------------------------------------------------------------------ pixels in shared files


def test_a_shared_tensor_travels_by_name_and_its_file_has_one_owner(tmp_path) -> None:  # noqa: ANN001
    pixels = np.arange(600, dtype=np.float32).reshape(20, 30)
    path = new_media_path(str(tmp_path))
    assert os.path.basename(path).startswith(f"{MEDIA_PREFIX}{os.getpid()}-")
    written = SharedTensor.write(pixels, path)  # the producer's handle owns nothing
    assert not written.owned and written.nbytes == pixels.nbytes
    del written
    gc.collect()
    assert os.path.exists(path)
    handle = pickle_round_trip(SharedTensor(path, (20, 30), "float32", owned=False))
    assert handle.owned  # a received handle owns the file
    shared: list[SharedTensor] = []
    frames = to_frames(request("a", handle), shared)
    assert shared == [handle] and len(frames) == 2  # the pickle and the positions: no pixel frame
    handle.hand_off()  # sent: dropping the sender's handle removes nothing
    del handle
    gc.collect()
    assert os.path.exists(path)
    back = from_frames([bytes(f) for f in frames])  # a lone receiver reads, then removes
    assert not os.path.exists(path)
    assert torch.equal(back.mm_inputs.items[0].feature, torch.from_numpy(pixels))


def pickle_round_trip(obj: object) -> object:
    import pickle

    return pickle.loads(pickle.dumps(obj))


def test_an_unsent_handle_removes_its_file_and_a_failed_write_leaves_nothing(tmp_path) -> None:  # noqa: ANN001
    path = new_media_path(str(tmp_path))
    handle = pickle_round_trip(SharedTensor.write(np.ones((4, 4), np.float32), path))
    del handle  # a request that failed before it was sent
    gc.collect()
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        SharedTensor.write(np.ones(3, np.float32), str(tmp_path / "missing" / "x"))
    empty = pickle_round_trip(SharedTensor.write(np.zeros((0, 7), np.float32), path))
    assert from_frames(to_frames({"e": empty}))["e"].shape == (0, 7)
    assert os.listdir(tmp_path) == []


def test_sweep_removes_files_of_gone_processes_only(tmp_path) -> None:  # noqa: ANN001
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    mine = new_media_path(str(tmp_path))
    stale = str(tmp_path / f"{MEDIA_PREFIX}{gone.stdout.strip()}-00ff")
    other = str(tmp_path / "unrelated")
    for path in (mine, stale, other):
        open(path, "wb").close()
    assert sweep_media_files(str(tmp_path)) == 1  # the dead process's file
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(mine), "unrelated"])
    assert sweep_media_files(str(tmp_path), os.getpid()) == 1  # a stopping server's own
    assert os.listdir(tmp_path) == ["unrelated"]
    assert sweep_media_files(None) == 0


def shared_pixels_worker(tp, folder: str) -> tuple:  # noqa: ANN001
    """Rank 0 receives a request whose pixels are a shared file and forwards the frames; every
    rank reads the file, rank 0 removes it once all have."""
    sent = None
    if tp.rank == 0:
        path = new_media_path(folder)
        pixels = np.arange(12, dtype=np.float32).reshape(3, 4)
        handle = pickle_round_trip(SharedTensor.write(pixels, path))
        sent = [to_frames(request("r", handle))]
        handle.hand_off()
    frames = broadcast_frames(sent, tp.rank, tp.cpu_group, tp.size, folder)
    loaded: list[str] = []
    msgs = [from_frames(f, loaded) for f in frames]
    present = sorted(os.listdir(folder))
    release_loaded(loaded, tp.rank, tp.cpu_group, tp.size)
    tp.all_reduce_cpu(torch.zeros(1))  # rank 0 has removed it
    return msgs[0].mm_inputs.items[0].feature, len(loaded), len(present), os.listdir(folder)


def test_every_rank_reads_the_shared_pixels_then_rank_0_removes_them(tmp_path) -> None:  # noqa: ANN001
    for feature, loaded, present, left in run_on_ranks(
        shared_pixels_worker, 2, str(tmp_path), timeout=120
    ):
        assert torch.equal(feature, torch.arange(12.0).view(3, 4))
        assert (loaded, present, left) == (1, 1, [])


def test_a_mapped_input_outlives_its_file_and_gives_its_budget_back(tmp_path) -> None:  # noqa: ANN001
    pixels = np.arange(4096, dtype=np.float32).reshape(64, 64)
    path = new_media_path(str(tmp_path))
    SharedTensor.write(pixels, path)
    before = shm.MAPPED.mapped
    tensor = SharedTensor(path, (64, 64), "float32", owned=False).load()
    assert shm.MAPPED.mapped == before + pixels.nbytes  # mapped, not read
    os.remove(path)  # what rank 0 does once every rank has it
    assert torch.equal(tensor, torch.from_numpy(pixels))
    del tensor
    gc.collect()
    assert shm.MAPPED.mapped == before


def test_past_the_mapping_budget_inputs_are_read(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    budget = MapBudget()
    budget.take(str(tmp_path / "x"), 0)  # sizes the budget from the file system
    budget._limit = 3 * 1024  # room for one 2 kB input, not two
    monkeypatch.setattr(shm, "MAPPED", budget)
    arrays = [np.full((16, 32), i, np.float32) for i in range(2)]
    paths = [new_media_path(str(tmp_path)) for _ in arrays]
    for array, path in zip(arrays, paths):
        SharedTensor.write(array, path)
    first, second = (SharedTensor(p, (16, 32), "float32", owned=False).load() for p in paths)
    assert budget.mapped == 2048  # the first mapped, the second read
    for path in paths:
        os.remove(path)
    assert torch.equal(first, torch.zeros(16, 32)) and torch.equal(second, torch.ones(16, 32))
    del first, second
    gc.collect()
    assert budget.mapped == 0


def test_a_short_file_is_an_error_and_takes_no_budget(tmp_path) -> None:  # noqa: ANN001
    path = new_media_path(str(tmp_path))
    SharedTensor.write(np.ones(8, np.float32), path)
    before = shm.MAPPED.mapped
    with pytest.raises(OSError, match="shorter"):
        SharedTensor(path, (16,), "float32", owned=False).load()  # claims 64 of 32 bytes
    assert shm.MAPPED.mapped == before


def test_pickling_a_long_prompt_calls_no_python_hook_per_id(monkeypatch) -> None:  # noqa: ANN001
    """The pickler's Python hooks run for tensors and other objects, never once per prompt id
    (a hook per object cost 0.3 ms for a 650-token request in the front end)."""
    import runtime.transport.frames as frames_module

    calls = []
    pickler = frames_module._Pickler
    for hook in ("reducer_override", "persistent_id"):
        original = pickler.__dict__.get(hook)  # a hook the pickler itself defines
        if original is None:
            continue

        def counted(self, obj, _original=original):  # noqa: ANN001, ANN202
            calls.append(type(obj).__name__)
            return _original(self, obj)

        monkeypatch.setattr(pickler, hook, counted)
    msg = TokenizedGenerateReq("r", list(range(20_000)), SamplingParams())
    back = from_frames(to_frames(msg))
    assert back.input_ids == msg.input_ids and back.sampling_params == msg.sampling_params
    assert len(calls) < 20, calls[:30]
