"""scripts/gpu_check.py on a machine without CUDA: its arguments, report and table, and the clear
exit when there is no device (its GPU checks themselves run only on a GPU node)."""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import gpu_check
import pytest
import torch
from gpu_check import CheckResult, format_table, parse_args, run_check, write_report


def test_arguments() -> None:
    opts = parse_args([])
    assert opts.checks == list(gpu_check.CHECKS) and opts.tp is None
    opts = parse_args(["--checks", "serve, parity_tiny", "--tp", "2", "--json", "r.json"])
    assert opts.checks == ["serve", "parity_tiny"] and opts.tp == 2 and opts.json == "r.json"


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--checks", "serve,warp"], "unknown ['warp']"), (["--checks", ","], "--checks"),
     (["--tp", "0"], "at least 1")],
)
def test_bad_arguments_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err


def test_a_failing_check_is_a_row_not_a_crash() -> None:
    def broken() -> str:
        raise RuntimeError("kernel exploded")

    good = run_check("parity_tiny", lambda: "tokens agreed [16, 16]")
    bad = run_check("serve", broken)
    assert good.ok and good.detail == "tokens agreed [16, 16]"
    assert not bad.ok and "kernel exploded" in bad.detail and "Traceback" in bad.detail


def test_a_failed_check_holds_nothing_after_it() -> None:
    """A check that fails half way leaves its objects (on a GPU: a KV pool of most of the
    device) in frames that its traceback keeps in a cycle; run_check lets them go."""

    class Pool:
        pass

    alive: list[weakref.ref] = []

    def broken() -> str:
        pool = Pool()
        pool.me = pool  # a cycle, as a scheduler and its runner make
        alive.append(weakref.ref(pool))
        raise RuntimeError("decode failed")

    assert not run_check("parity_tiny", broken).ok
    assert alive[0]() is None


def test_report_and_table(tmp_path: Path) -> None:
    results = [CheckResult("gpu_tests", True, 12.345, "41 passed"),
               CheckResult("serve", False, 3.0, "AssertionError('no completion')\ntrace...")]
    path = tmp_path / "report.json"
    write_report(path, {"torch": "x", "gpus": ["H100"]}, results, "1 GPU(s): H100")
    report = json.loads(path.read_text())
    assert report["ok"] is False and report["environment"]["gpus"] == ["H100"]
    assert [c["name"] for c in report["checks"]] == ["gpu_tests", "serve"]
    assert report["checks"][1]["detail"].startswith("AssertionError")
    lines = format_table(results).splitlines()
    assert lines[0].split()[:3] == ["check", "result", "seconds"]
    assert lines[1].split()[:4] == ["gpu_tests", "PASS", "12.3", "41"]
    assert lines[2].split()[:3] == ["serve", "FAIL", "3.0"] and "trace" not in lines[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_exits_clearly(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "report.json"
    assert gpu_check.main(["--json", str(path)]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
    report = json.loads(path.read_text())
    assert report["ok"] is False and report["checks"] == [] and report["environment"]["gpus"] == []
    assert report["environment"]["torch"] == torch.__version__


def test_parity_and_serve_checks_run_on_cpu(tmp_path: Path) -> None:
    """The parity and serve checks' own code on CPU (Triton in the interpreter, one rank), so a
    GPU node's time is not spent finding a slip in them."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels were not set up for the interpreter in this process")
    from runtime.tiny_checkpoint import make_checkpoint

    opts = parse_args(["--new-tokens", "2", "--tp", "1", "--timeout", "240", "--image-size", "56"])
    opts.device = "cpu"
    folder = str(make_checkpoint("qwen2_vl", tmp_path / "ck"))
    detail = gpu_check.compare_backends(folder, None, opts, drift=True)
    assert detail.startswith("tokens agreed [2, 2] of 2; first token's logprob differs by ")
    drift = detail.split("; drift ")[1]
    assert drift.startswith("vision block 1 ") and "decoder input" in drift and "layer 1 " in drift
    assert "kernel's step" not in detail  # the two backends agree to float32 rounding
    assert all(float(part.split()[-1]) < 1e-4 for part in drift.split(", "))
    assert gpu_check.check_serve(opts).startswith("--tp 1: ")


def test_7b_parity_allows_a_near_tie_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy outputs may part (7B) only where both engines found the two tokens within the
    margin of each other; anything else, or any difference in exact mode, fails."""
    ref = [gpu_check.Greedy([5, 6, 7], [{5: -1.0, 9: -2.0}, {6: -0.5, 8: -0.6}, {7: -1.0}])]
    near = [gpu_check.Greedy([5, 8, 3], [{5: -1.0, 9: -2.1}, {8: -0.55, 6: -0.6}, {3: -1.0}])]
    far = [gpu_check.Greedy([5, 4, 3], [{5: -1.0, 9: -2.1}, {4: -0.1, 6: -2.0}, {3: -1.0}])]
    runs: dict[str, list] = {"torch": ref}
    monkeypatch.setattr(gpu_check, "greedy_tokens", lambda path, name, *args, **kw: runs[name])
    opts = parse_args(["--new-tokens", "3"])
    runs["triton"] = near
    detail = gpu_check.compare_backends("ck", 0.25, opts)
    assert "tokens agreed [1] of 3" in detail and "[0.1] nats" in detail
    with pytest.raises(AssertionError, match="tokens agreed"):
        gpu_check.compare_backends("ck", 0.05, opts)  # a tie wider than the margin
    with pytest.raises(AssertionError):
        gpu_check.compare_backends("ck", None, opts)  # exact mode: no difference at all
    runs["triton"] = far  # the reference's top two lack the other's token: no near tie
    with pytest.raises(AssertionError, match="inf"):
        gpu_check.compare_backends("ck", 0.25, opts)
    runs["triton"] = ref
    assert gpu_check.compare_backends("ck", None, opts).startswith("tokens agreed [3] of 3")


def test_7b_parity_explains_parted_tokens_only_by_smooth_drift(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tokens that part beyond the margin pass only where the activations drifted apart stage
    by stage with no kernel's step (a first stage already apart, or a jump between two) and
    grew far enough to explain it; streams still equal with tokens apart fail."""
    x = torch.ones(3, 4, dtype=torch.float64)
    names = ["vision block 1", "vision block 2", "decoder input", "layer 1", "layer 2"]
    drifts: dict[str, list[float]] = {}

    def greedy(path: str, name: str, opts: object, dtype: str, stages: dict | None) -> list:
        for stage, d in zip(names, drifts[name] if stages is not None else []):
            stages[stage] = [x * (1 + d)]
        tokens = [5, 6] if name == "torch" else [7, 8]
        return [gpu_check.Greedy(tokens, [{t: -1.0} for t in tokens])]  # no near tie

    monkeypatch.setattr(gpu_check, "greedy_tokens", greedy)
    opts = parse_args(["--new-tokens", "2"])
    drifts["torch"] = [0.0] * 5
    drifts["triton"] = [1e-7, 2e-7, 3e-6, 1e-4, 2e-3]
    detail = gpu_check.compare_backends("ck", 0.02, opts, drift=True)
    assert "vision block 1 1.0e-07" in detail and "layer 2 2.0e-03" in detail
    assert "amplified rounding" in detail
    profile = [("a", 1e-7), ("b", 2e-6), ("c", 1e-4)]
    assert gpu_check.drift_jump(profile) is None
    for bad in ([1e-7, 1e-2, 1e-2, 2e-2, 3e-2], [2e-4, 2e-4, 3e-4, 1e-3, 3e-3]):
        drifts["triton"] = bad  # a jump between two stages; the first stage already apart
        with pytest.raises(AssertionError, match="a kernel's step"):
            gpu_check.compare_backends("ck", 0.02, opts, drift=True)
    drifts["triton"] = [1e-7, 1e-7, 1e-7, 1e-7, 2e-7]  # streams equal, tokens apart
    with pytest.raises(AssertionError):
        gpu_check.compare_backends("ck", 0.02, opts, drift=True)
    drifts["triton"] = [1e-7, 2e-7, 3e-6, 1e-4, 2e-3]
    with pytest.raises(AssertionError):
        gpu_check.compare_backends("ck", 0.02, opts)  # without the drift, no explanation
