"""scripts/bench_structured.py at smoke size: every row measured, masks timed only where
requests are constrained (a side-by-side report: no timing is asserted)."""

from __future__ import annotations

import bench_structured
import pytest

from runtime.tiny_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("bench") / "ck")
    argv = ["--model-path", str(folder), "--requests", "4", "--max-new-tokens", "8"]
    return bench_structured.main(argv)


def test_every_share_is_measured_side_by_side(results: dict) -> None:
    for name in ("0%", "50%", "100%", "50% stepwise", "100% stepwise"):
        row = results[name]
        assert row["tokens"] == 4 * 8 and row["tokens_per_s"] > 0  # the same work in each
    assert results["0%"]["mask_us_per_token"] == 0.0  # no constraint: no mask at all
    assert results["50%"]["mask_us_per_token"] > 0 and results["100%"]["mask_us_per_token"] > 0


def test_jump_forward_saves_steps_on_the_same_work(results: dict) -> None:
    jumping, stepwise = results["100%"], results["100% stepwise"]
    assert stepwise["steps_saved"] == 0 < jumping["steps_saved"]
    assert jumping["steps"] < stepwise["steps"]
    assert results["jump_forward_steps_saved"] == jumping["steps_saved"]
