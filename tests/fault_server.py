"""A tessera server with the suite's injected faults: the test-only entry point.

    python tests/fault_server.py --fault-rate 0.01 --fault-seed 3 [launch.py's flags]

It calls `launch.main` with an `InjectorFactory` (tests/fault_injection.py), which reaches every
scheduler rank through the scheduler's factory (scheduler/input_checks.py); launch.py's own
command line has no way to inject faults. scripts/stress.py starts this instead of launch.py
when it is asked for faults.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fault_injection import InjectorFactory  # noqa: E402  (this folder: the script's own)

import launch  # noqa: E402


def split_args(argv: list[str] | None) -> tuple[InjectorFactory, list[str]]:
    """The injector's settings, and the rest of the flags for launch.py."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault-rate", type=float, required=True)
    parser.add_argument("--fault-seed", type=int, default=0)
    ours, rest = parser.parse_known_args(argv)
    return InjectorFactory(ours.fault_rate, ours.fault_seed), rest


def main(argv: list[str] | None = None) -> int:
    faults, rest = split_args(argv)
    return launch.main(rest, faults=faults)


if __name__ == "__main__":
    sys.exit(main())
