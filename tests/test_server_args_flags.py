"""On/off command-line flags of ServerArgs: a setting that is on by default can be turned off."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

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
