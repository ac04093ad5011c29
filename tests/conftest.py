from __future__ import annotations

import os

# Triton kernels run on CPU only in its interpreter, which must be chosen before anything in this
# process imports triton (some libraries do so on import). A machine with NVIDIA devices runs them
# natively.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "parity_subset(keep): keep(tp, params) says whether a parity test runs at tp"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselect_parity_subsets(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def deselect_parity_subsets(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A family's parity tests at a TP size that runs only some modes and cases (the `ranks`
    fixture's param; tests/vlm_cases.py `parity_tests`): the others are deselected, not
    skipped, as their results were never computed."""
    dropped = []
    for item in items:
        marker = item.get_closest_marker("parity_subset")
        params = getattr(getattr(item, "callspec", None), "params", {})
        if marker is not None and "ranks" in params and not marker.args[0](params["ranks"], params):
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = {id(item) for item in dropped}
        items[:] = [item for item in items if id(item) not in gone]
