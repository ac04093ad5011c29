"""scripts/profile_serving_cpu.py without a server: CPU per process per request, the counters
that moved between two /server_info answers, the names of a process tree's members, and the
--py-spy phases of vLLM's processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import profile_serving_cpu as prof  # scripts/ is on sys.path (conftest)
import pytest


def test_cpu_per_request_divides_each_process_delta_by_the_requests() -> None:
    before = {10: 1.0, 11: 5.0, 12: 2.0}
    after = {10: 1.2, 11: 9.0, 12: 2.0}
    rows = prof.cpu_per_request(before, after, {10: "main", 11: "scheduler-TP0"}, requests=8)
    assert [r.pid for r in rows] == [11, 10, 12]  # busiest first
    assert rows[0].name == "scheduler-TP0" and rows[2].name == "?"
    assert rows[0].ms_per_request == pytest.approx(500.0)
    assert rows[1].ms_per_request == pytest.approx(25.0)
    assert rows[2].ms_per_request == 0.0
    assert sum(r.share for r in rows) == pytest.approx(1.0)
    assert rows[0].share == pytest.approx(4.0 / 4.2)


def test_moved_counters_keep_only_changed_numbers_with_their_paths() -> None:
    before = {"encoder_cache": {"encode_calls": 2, "bytes": 10, "ok": True}, "model": "m", "n": 1.5}
    after = {"encoder_cache": {"encode_calls": 18, "bytes": 10, "ok": False}, "model": "x", "n": 2}
    assert prof.moved_counters(before, after) == {"encoder_cache.encode_calls": 16, "n": 0.5}
    assert prof.moved_counters({}, {"a": 1}) == {}
    assert prof.moved_counters({"a": 1}, {}) == {}


def test_process_names_take_the_launchers_log_then_the_command(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "subprocess.Popen(['sleep', '30']); time.sleep(30)"]
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while len(prof.process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = prof.process_tree(child.pid)[1]
        log = tmp_path / "server.log"
        log.write_text(f"INFO tessera.launch: started scheduler-TP0 (pid {os.getpid()})\n")
        assert prof.process_names(child.pid, log) == {child.pid: "main", grandchild: "sleep"}
        log.write_text(f"INFO tessera.launch: started scheduler-TP0 (pid {grandchild})\n")
        assert prof.process_names(child.pid, log)[grandchild] == "scheduler-TP0"
    finally:
        for pid in prof.process_tree(child.pid)[1:]:
            os.kill(pid, 9)
        child.kill()
        child.wait()


def test_the_servers_are_those_of_the_benchmark_groups() -> None:
    args = prof.parse_args(["--model-path", "/m", "--server", "vllm-tp2-data"])
    assert args.tp2_model_path == "/m" and args.workload == "vit-tp2"
    assert {"tessera-tp2-dp", "tessera-tp2-tp", "vllm-tp2-data", "tessera"} <= set(prof.SERVERS)
    assert prof.SERVERS["transformers"].kind == "transformers"  # the other peer


def test_a_spawned_python_worker_is_named_by_its_role() -> None:
    code = "from multiprocessing.spawn import spawn_main; import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while "spawn_main" not in Path(f"/proc/{child.pid}/cmdline").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert prof.command_name(child.pid) == "worker"
    finally:
        child.kill()
        child.wait()
    assert prof.command_name(child.pid) == "?"


def test_py_spy_samples_fall_in_the_innermost_listed_phase() -> None:
    raw = "\n".join(
        [
            "thread (7): MainThread;run (core.py:1);Runner.execute_model (r.py:2);"
            "Runner._model_forward (r.py:3) 6",
            "thread (7): MainThread;run (core.py:1);Runner.execute_model (r.py:2);"
            "Sampler._sample (r.py:9) 2",
            "thread (7): MainThread;run (core.py:1);Runner.execute_model (r.py:2);h (r.py:5) 1",
            "thread (7): MainThread;run (core.py:1);MessageQueue.dequeue (shm.py:4) 3",
            "thread (8): io;Thread.run (t.py:1);select (t.py:2) 5",
            "not a sample line",
        ]
    )
    threads = prof.phase_samples(raw, "worker")
    assert threads["thread (7): MainThread"] == {
        "forward": 6,
        "sampling": 2,
        "other work in execute_model": 1,
        "waiting for the engine (idle)": 3,
    }
    assert threads["thread (8): io"] == {"other": 5}
    assert prof.process_kind("VLLM::EngineCore") == "engine"
    assert prof.process_kind("python -m vllm.entrypoints.openai.api_server") == "api"


def test_py_spy_keeps_the_workload_running_and_is_for_vllm_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--model-path", "/m", "--server", "vllm", "--workload", "decode", "--py-spy",
            "--running", "16", "--output-len", "512"]  # fmt: skip
    scenario = prof.running_scenario(prof.parse_args(argv))
    assert (scenario.concurrency, scenario.num_prompts) == (16, 48)
    assert scenario.parts[0].output_len == 512
    plain = prof.running_scenario(prof.parse_args(["--model-path", "/m", "--workload", "decode"]))
    assert plain.concurrency == prof.bench.SCENARIOS["decode"].concurrency
    assert plain.parts == prof.bench.SCENARIOS["decode"].parts
    with pytest.raises(SystemExit):
        prof.parse_args(["--model-path", "/m", "--server", "tessera", "--py-spy"])
    assert "vLLM's processes only" in capsys.readouterr().err
