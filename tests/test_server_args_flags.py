"""On/off command-line flags of ServerArgs: a setting that is on by default can be turned off."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.cpus import MAX_AUTO_MEDIA_WORKERS, auto_media_workers, usable_cpus
from runtime.server_args import ServerArgs, _opt


def test_mixed_steps_are_on_by_default_and_the_off_flag_turns_them_off():
    assert ServerArgs.from_cli([]).enable_mixed_chunk is True
    assert ServerArgs.from_cli(["--enable-mixed-chunk"]).enable_mixed_chunk is True
    assert ServerArgs.from_cli(["--disable-mixed-chunk"]).enable_mixed_chunk is False


def test_every_setting_on_by_default_has_a_flag_that_turns_it_off():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    on = [f for f in dataclasses.fields(ServerArgs) if f.type == "bool" and f.default is True]
    assert "enable_mixed_chunk" in {f.name for f in on}
    for f in on:
        assert getattr(parser.parse_args([f.metadata["off_flag"]]), f.name) is False, f.name


def test_a_setting_on_by_default_without_an_off_flag_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Args(ServerArgs):
        always_on: bool = _opt("a setting nothing could turn off", default=True)

    with pytest.raises(TypeError, match="always_on .*off_flag"):
        Args.add_cli_args(argparse.ArgumentParser())


@pytest.mark.parametrize(
    ("cpus", "ranks", "cuda", "workers"),
    [
        (16, 1, True, 14),  # a GPU node: the front end and one rank keep a CPU each
        (16, 8, True, 7),
        (64, 1, True, MAX_AUTO_MEDIA_WORKERS),
        (2, 1, True, 1),
        (2, 1, False, 2),  # on CPU the workers share the ranks' cores, up to 4
        (16, 2, False, 4),
        (1, 1, False, 1),
    ],
)
def test_auto_media_workers_are_the_cpus_the_ranks_leave(
    cpus: int, ranks: int, cuda: bool, workers: int
) -> None:
    assert auto_media_workers(cpus, ranks, cuda) == workers


def test_media_workers_are_resolved_at_parse_time() -> None:
    auto = ServerArgs.from_cli(["--device", "cpu"]).media_workers
    assert auto == auto_media_workers(len(usable_cpus()), 1, use_cuda=False)
    assert ServerArgs.from_cli(["--device", "cpu", "--media-workers", "6"]).media_workers == 6
    with pytest.raises(ValueError, match="media-workers"):
        ServerArgs(device="cpu", media_workers=0).resolve()
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--media-workers", "many"])


def test_the_flashinfer_check_imports_no_backend() -> None:
    """Refusing --attention-backend flashinfer on CPU takes the pure check of
    kernels/availability.py: no attention backend module is imported."""
    code = (
        "import sys\n"
        "from runtime.server_args import ServerArgs\n"
        "try:\n"
        "    ServerArgs(device='cpu', attention_backend='flashinfer').resolve()\n"
        "except ValueError as e:\n"
        "    assert '--attention-backend flashinfer' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('not refused')\n"
        "print(sorted(m for m in sys.modules if m.startswith('kernels.attention')))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_dp_takes_each_spelling_and_replicas_get_their_own_inputs() -> None:
    for flag in ("--dp", "--dp-size", "--data-parallel-size"):
        args = ServerArgs.from_cli([flag, "3", "--tp", "2", "--device", "cpu"])
        assert args.dp_size == 3 and args.ranks_per_node == 6
    assert len({args.scheduler_ipc(r) for r in range(3)}) == 3
    assert args.scheduler_input_ipc == args.scheduler_ipc(0)
    with pytest.raises(ValueError, match="--dp with --nnodes"):
        ServerArgs.from_cli(["--dp", "2", "--tp", "2", "--nnodes", "2", "--device", "cpu"])
