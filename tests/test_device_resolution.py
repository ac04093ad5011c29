"""--device: "auto" never lands on CPU without a word when some GPUs are visible."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import runtime.server_args
from runtime.server_args import ServerArgs, resolve_device


@pytest.mark.parametrize(
    ("requested", "tp", "visible", "device"),
    [("auto", 1, 0, "cpu"), ("auto", 2, 2, "cuda"), ("auto", 2, 8, "cuda"), ("cpu", 2, 8, "cpu"),
     ("cuda", 4, 4, "cuda")],
)
def test_resolve_device_quietly(
    requested: str, tp: int, visible: int, device: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert resolve_device(requested, tp, visible) == device
    assert not caplog.records


def test_auto_with_too_few_gpus_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert resolve_device("auto", 4, 2) == "cpu"
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "--tp 4 needs 4 GPUs but 2 are visible" in record.getMessage()
    assert "running on CPU" in record.getMessage()


def test_cuda_with_too_few_gpus_is_an_error() -> None:
    with pytest.raises(ValueError, match="--device cuda: --tp 2 needs 2 GPUs but 1 are visible"):
        resolve_device("cuda", 2, 1)


def test_server_args_resolve_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The parsed flags take the same path: --tp 2 on a one-GPU machine."""
    monkeypatch.setattr(runtime.server_args, "_cuda_count", lambda: 1)
    with caplog.at_level(logging.WARNING):
        args = ServerArgs(tp_size=2, ipc_dir=str(tmp_path / "ipc")).resolve()
    assert args.device == "cpu" and not args.use_cuda and args.attention_backend == "torch"
    assert any("2 GPUs but 1 are visible" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="1 are visible"):
        ServerArgs(tp_size=2, device="cuda", ipc_dir=str(tmp_path / "ipc")).resolve()


def test_replicas_need_dp_times_tp_gpus() -> None:
    """--dp 4 --tp 2: replica r takes devices 2r and 2r+1, so eight are needed."""
    assert resolve_device("auto", 2, 8, dp_size=4) == "cuda"
    with pytest.raises(ValueError, match="--dp 4 x --tp 2 needs 8 GPUs but 6 are visible"):
        resolve_device("cuda", 2, 6, dp_size=4)
