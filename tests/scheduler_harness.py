"""Start real scheduler ranks (spawned, Gloo, ipc:// sockets) and talk to them like the
TokenizerManager does; always tears every child down."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import tempfile
import time
from typing import Any

import zmq
from dist_utils import free_port

from runtime.io_struct import (
    BatchTokenOut,
    GetServerInfoReq,
    ItemPixels,
    PixelsWanted,
    ServerInfo,
    ShutdownReq,
    TokenizedGenerateReq,
)
from runtime.server_args import ServerArgs
from runtime.transport.frames import to_frames
from scheduler.input_checks import FaultsFactory
from scheduler.process import run_scheduler_process


class SchedulerHarness:
    def __init__(
        self, args: ServerArgs, ready_timeout: float = 180.0, faults: FaultsFactory | None = None
    ):
        """`faults`: each rank's injected faults (scheduler/input_checks.py), picklable."""
        self.faults = faults
        self._tmp = tempfile.TemporaryDirectory(prefix="tessera-test-")
        self.args = dataclasses.replace(
            args, ipc_dir=self._tmp.name, device="cpu", attention_backend="torch"
        )
        self.ctx = zmq.Context()
        self.out = self.ctx.socket(zmq.PULL)
        self.out.bind(self.args.detokenizer_ipc)
        self.inp = self.ctx.socket(zmq.PUSH)
        self.inp.connect(self.args.scheduler_input_ipc)
        self.procs: list[Any] = []
        self.pending: list[object] = []
        try:
            self._start(ready_timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout: float) -> None:
        spawn = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{free_port()}"
        pipes = []
        for rank in range(self.args.tp_size):
            reader, writer = spawn.Pipe(duplex=False)
            proc = spawn.Process(
                target=run_scheduler_process,
                args=(self.args, rank, init, writer),
                kwargs={"faults": self.faults},
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)
            pipes.append(reader)
        for reader in pipes:
            if not reader.poll(timeout):
                raise TimeoutError("a scheduler rank did not report ready")
            msg = reader.recv()
            if not msg.ready:
                raise RuntimeError(f"rank {msg.rank} failed:\n{msg.error}")

    def send(self, msg: object) -> None:
        self.inp.send_multipart(to_frames(msg))

    def recv(self, timeout: float) -> object:
        if not self.out.poll(int(timeout * 1000)):
            dead = [p.exitcode for p in self.procs if not p.is_alive()]
            raise TimeoutError(f"no scheduler output in {timeout}s (dead ranks: {dead})")
        return self.out.recv_pyobj()

    def generate(
        self,
        reqs: list[TokenizedGenerateReq],
        timeout: float = 300.0,
        pixels: dict[int, Any] | None = None,
    ) -> dict:
        """Send all requests at once; returns rid -> {"tokens", "cached", "finish"}. A
        `PixelsWanted` is answered from `pixels` (item hash -> feature) as the front end does,
        and kept in `pending` too."""
        results = {r.rid: {"tokens": [], "cached": None, "finish": None} for r in reqs}
        for r in reqs:
            self.send(r)
        deadline = time.monotonic() + timeout
        while any(v["finish"] is None for v in results.values()):
            msg = self.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(msg, PixelsWanted) and pixels is not None:
                self.send(ItemPixels(msg.rid, {h: pixels[h] for h in msg.hashes}))
            if not isinstance(msg, BatchTokenOut):
                self.pending.append(msg)
                continue
            for out in msg.outputs:
                entry = results[out.rid]
                entry["tokens"].extend(out.new_token_ids)
                entry["cached"] = out.cached_tokens
                entry["finish"] = out.finish_reason and out.finish_reason.to_json()
        return results

    def request(self, msg: object, kind: type, timeout: float = 60.0) -> Any:
        self.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            reply = self.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(reply, kind):
                return reply

    def info(self) -> ServerInfo:
        return self.request(GetServerInfoReq(), ServerInfo)

    def close(self) -> None:
        try:
            if self.procs and all(p.is_alive() for p in self.procs):
                self.send(ShutdownReq())
            for p in self.procs:
                p.join(timeout=15)
        finally:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            self.ctx.destroy(linger=0)
            self._tmp.cleanup()

    def __enter__(self) -> SchedulerHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
