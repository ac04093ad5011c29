"""What each kernel backend needs of the machine, checked without importing the backend.

Pure of torch and of every backend module, so the flags (runtime/server_args.py) and the
backends themselves ask the same question the same way.
"""

from __future__ import annotations

import importlib.util


def flashinfer_problem(device: str) -> str | None:
    """Why the FlashInfer backend cannot run on `device` ("cuda" or "cpu"), None when it can.
    Looks for the package without importing it."""
    if device != "cuda":
        return "--attention-backend flashinfer needs CUDA (--device cuda); use torch on CPU"
    if importlib.util.find_spec("flashinfer") is None:
        return (
            "--attention-backend flashinfer needs the flashinfer package: "
            "pip install -e '.[gpu]', or use --attention-backend triton"
        )
    return None
