"""Rank 0's request frames to the other TP ranks: through the CPU group or through shared memory.

    python scripts/bench_frame_broadcast.py --tp 2 --images 4 --rounds 20

Spawns --tp Gloo ranks on loopback (one thread each). Rank 0 turns one request carrying
--images images of 624 x 1,176 float32 patches (2.9 MB each; 4 of them are the 11.7 MB request of
issue 12) into frames, as the TokenizerManager does, and each round every rank calls
`broadcast_frames` and rebuilds the message, once without a shared-memory folder (everything
crosses the group) and once with /dev/shm (only the layout and the pickle do).
Prints the median milliseconds per round on rank 0 and on the slowest other rank, and the bytes
that crossed the group.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from dist_utils import free_port  # noqa: E402

from runtime.distributed import TPGroup, destroy_tp_group, init_tp_group  # noqa: E402
from runtime.io_struct import TokenizedGenerateReq  # noqa: E402
from runtime.multimodal import Modality, MultimodalDataItem, MultimodalInputs  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.transport.broadcast import FrameLayout, broadcast_frames  # noqa: E402
from runtime.transport.frames import Frame, from_frames, to_frames  # noqa: E402

PATCHES, PATCH_DIM = 624, 1176  # one image: a 1 x 24 x 26 patch grid, 2.9 MB of float32
SHM_DIR = "/dev/shm"


def request(images: int, patches: int) -> TokenizedGenerateReq:
    items = [
        MultimodalDataItem(
            Modality.IMAGE,
            torch.randn(patches, PATCH_DIM),
            hash=i + 1,
            offsets=[(i * 10, i * 10 + 5)],
            grid_thw=(1, 24, patches // 24),
        )
        for i in range(images)
    ]
    mm = MultimodalInputs(items, torch.zeros(3, images * 10, dtype=torch.long))
    return TokenizedGenerateReq("bench", list(range(images * 10)), SamplingParams(), mm)


def one_round(tp: TPGroup, frames: list[list[Frame]] | None, shm_dir: str | None) -> float:
    tp.all_reduce_cpu(torch.zeros(1))  # start together
    start = time.perf_counter()
    got = broadcast_frames(frames, tp.rank, tp.cpu_group, tp.size, shm_dir)
    msg = from_frames(got[0])
    assert msg.mm_inputs is not None
    return time.perf_counter() - start


def rank_main(rank: int, args: argparse.Namespace, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    tp = init_tp_group(rank, args.tp, f"tcp://127.0.0.1:{port}", use_cuda=False)
    try:
        frames = [to_frames(request(args.images, args.patches))] if rank == 0 else None
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for mode, shm_dir in (("group", None), ("shm", SHM_DIR)):
                times.setdefault(mode, []).append(one_round(tp, frames, shm_dir))
        out.put((rank, {m: statistics.median(t) * 1000 for m, t in times.items()}))
    finally:
        destroy_tp_group()


def group_bytes(images: int, patches: int, shm_dir: str | None) -> int:
    layout = FrameLayout.plan([to_frames(request(images, patches))], shm_dir)
    header = 8 * (2 + len(layout.encode()))
    return header + layout.nbytes(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--patches", type=int, default=PATCHES, help="per image")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    ctx, port = mp.get_context("spawn"), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, out)) for r in range(args.tp)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    mb = args.images * args.patches * PATCH_DIM * 4 / 1e6
    print(f"tp {args.tp}, one request with {args.images} images ({mb:.1f} MB of pixels)")
    print(f"{'path':<8}{'group bytes':>14}{'rank 0 ms':>12}{'other ranks ms':>16}")
    for mode, shm_dir in (("group", None), ("shm", SHM_DIR)):
        others = max(results[r][mode] for r in range(1, args.tp))
        sent = group_bytes(args.images, args.patches, shm_dir)
        print(f"{mode:<8}{sent:>14,}{results[0][mode]:>12.2f}{others:>16.2f}")


if __name__ == "__main__":
    main()
