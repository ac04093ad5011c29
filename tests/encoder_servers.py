"""Encoder servers for tests: `launch.py --encoder-only` in its own session."""

from __future__ import annotations

from pathlib import Path

from stress import LaunchedServer
from waits import wait_until


class EncoderProc(LaunchedServer):
    """launch.py --encoder-only; `url` is its job address."""

    def __init__(self, folder: str, log: Path, *extra: str, port: int | None = None):
        flags = ["--encoder-only", "--model-path", folder, "--device", "cpu", *extra]
        super().__init__([*flags, *(["--port", str(port)] if port else [])], log)
        self.port = port or self.port  # the last --port given is the one served
        self.job_url = f"tcp://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 240) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            return "encoder server ready" in self.log.read_text()

        assert wait_until(ready, timeout), self.log.read_text()[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except Exception:  # noqa: BLE001 - then kill
            self.proc.kill()
            self.proc.wait()


def start_encoder(folder: str, log: Path, *extra: str, port: int | None = None) -> EncoderProc:
    proc = EncoderProc(folder, log, *extra, port=port)
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    return proc


class FakeEncoder:
    """An encoder server's socket in a thread, for the front end's pool: `mode` "answer"
    (embeddings of zeros, a row per merged patch, `row_dim` wide), "silent" (a hung server:
    reads, never answers), "refuse" (each job an error). Health probes are answered unless
    silent. `jobs` counts the encode jobs read."""

    def __init__(self, port: int, mode: str = "answer", row_dim: int = 8, delay_s: float = 0):
        import threading

        import zmq

        from runtime.transport.encoder_wire import Channel

        self.url, self.mode, self.row_dim = f"tcp://127.0.0.1:{port}", mode, row_dim
        self.delay_s = delay_s
        self.jobs = self.answers = 0
        self.channel = Channel(None, "/dev/shm")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            peer, *frames = self.sock.recv_multipart()
            header, _ = self.channel.unpack(frames)  # removes the pixel files it was sent
            answer = self._answer(header)
            if self.mode == "late" and header["op"] == "encode":
                self._stop.wait(self.delay_s)
            if answer is not None:
                self.sock.send_multipart([peer, *self.channel.pack(*answer)])
                self.answers += 1

    def _answer(self, header: dict):
        import torch

        if self.mode == "silent":
            return None
        if header["op"] == "health":
            return {"op": "health", "job": header["job"], "ok": True}, []
        self.jobs += 1
        if self.mode == "refuse":
            return {"op": "error", "job": header["job"], "message": "refused by the fake"}, []
        digests = [row["digest"] for row in header["items"]]
        rows = [row["grid"][0] * row["grid"][1] * row["grid"][2] // 4 for row in header["items"]]
        tensors = [torch.full((n, self.row_dim), float(i)) for i, n in enumerate(rows)]
        return {"op": "embeddings", "job": header["job"], "digests": digests}, tensors

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.ctx.destroy(linger=0)
