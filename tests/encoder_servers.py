"""Encoder servers for tests: `launch.py --encoder-only` in its own session."""

from __future__ import annotations

from pathlib import Path

from stress import LaunchedServer
from waits import wait_until


class EncoderProc(LaunchedServer):
    """launch.py --encoder-only; `url` is its job address."""

    def __init__(self, folder: str, log: Path, *extra: str):
        super().__init__(["--encoder-only", "--model-path", folder, "--device", "cpu", *extra], log)
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


def start_encoder(folder: str, log: Path, *extra: str) -> EncoderProc:
    proc = EncoderProc(folder, log, *extra)
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    return proc
