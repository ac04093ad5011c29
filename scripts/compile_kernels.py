"""Compile every Triton kernel for sm_80 and sm_90 without a GPU; exit 1 on any compile error.

float32 specialisations compile for sm_90 only (`compile_check.TARGET_TYPES` says why).

    env -u TRITON_INTERPRET TRITON_CACHE_DIR=$(mktemp -d) python scripts/compile_kernels.py
    python scripts/compile_kernels.py --arch 90 --dtype bf16 --json results.json

Nothing is launched: each specialisation in kernels.triton.compile_check goes through
`triton.compile` for a `GPUTarget` down to PTX and a cubin (ptxas ships with the Triton wheel).
Set TRITON_CACHE_DIR to an empty folder: a cached binary is not compiled again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.triton.compile_check import (  # noqa: E402
    DTYPES,
    TARGETS,
    TRITON_TYPES,
    all_specs,
    compile_all,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", help="sm number (default: 80 and 90)")
    parser.add_argument("--dtype", choices=list(TRITON_TYPES.values()), action="append")
    parser.add_argument("--json", help="write every result to this file")
    args = parser.parse_args(argv)
    dtypes = tuple(d for d in DTYPES if not args.dtype or TRITON_TYPES[d] in args.dtype)
    results = compile_all(all_specs(dtypes), tuple(args.arch or TARGETS))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"FAILED sm_{r.arch} {r.spec}\n  {r.error}", file=sys.stderr)
    seconds = sum(r.seconds for r in results)
    print(f"{len(results) - len(failed)}/{len(results)} compiled in {seconds:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
