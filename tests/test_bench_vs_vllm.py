"""scripts/bench_vs_vllm.py without vLLM: workloads, the peers' groups, the summary and its
ratios, the costs per request, the tables, the greedy verdicts, and the teardown of a server's
whole process group (a dummy server whose leader leaves a child behind, and one that ignores
SIGINT)."""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import bench_vs_vllm as bench  # scripts/ is on sys.path (conftest)
import pytest
from waits import wait_until

# ---------------------------------------------------------------- workloads


def test_mixed_requests_alternate_text_and_image_chats() -> None:
    scenario = bench.SCENARIOS["mixed"]
    requests = bench.build_requests(scenario, seed=5, stream=0)
    assert len(requests) == scenario.num_prompts
    assert [len(r.image_urls) for r in requests[:4]] == [0, 1, 0, 1]
    assert [r.output_len for r in requests[:2]] == [64, 32]
    assert len({r.text for r in requests}) == len(requests)
    assert len({r.image_urls for r in requests[1::2]}) == len(requests) // 2


def test_shared_image_scenario_sends_one_image_with_different_texts() -> None:
    requests = bench.build_requests(bench.quick(bench.SCENARIOS["shared-image"]), seed=1, stream=0)
    assert len({r.image_urls for r in requests}) == 1
    assert len(requests[0].image_urls) == 1
    assert len({r.text for r in requests}) == len(requests)


def test_requests_depend_on_seed_and_stream_only() -> None:
    scenario = bench.quick(bench.SCENARIOS["images3"])
    again = bench.build_requests(scenario, seed=2, stream=0)
    assert bench.build_requests(scenario, seed=2, stream=0) == again
    assert all(len(r.image_urls) == 3 for r in again)
    other_round = bench.build_requests(scenario, seed=3, stream=0)
    warmup = bench.build_requests(scenario, seed=2, stream=1)
    assert not {r.image_urls for r in again} & {r.image_urls for r in other_round}
    assert not {r.image_urls for r in again} & {r.image_urls for r in warmup}


def test_quick_keeps_shapes_and_cuts_counts() -> None:
    full = bench.SCENARIOS["decode"]
    small = bench.quick(full)
    assert (small.num_prompts, small.concurrency) == (bench.QUICK_PROMPTS, full.concurrency)
    assert small.parts[0].output_len == bench.QUICK_OUTPUT_LEN
    assert small.parts[0].input_len == full.parts[0].input_len
    assert bench.quick(bench.SCENARIOS["vit-tp2"]).parts[0].output_len == 1


def test_long_prompt_is_over_two_thousand_tokens() -> None:
    """Counted with the tokenizer every tiny checkpoint carries (the hd64 and 100m presets too)."""
    from runtime.tiny_checkpoint import build_tokenizer

    request = bench.build_requests(bench.SCENARIOS["long-prompt"], seed=0, stream=0)[0]
    assert len(build_tokenizer().encode(request.text).ids) > 2000


# ---------------------------------------------------------------- summary and ratios


def run(server: str, scenario: str, req_s: float, ttft_p99: float | None, failed: int = 0) -> dict:
    row = {m: None for m in bench.METRICS}
    row |= {"req_s": req_s, "out_tok_s": req_s * 10, "ttft_p99_ms": ttft_p99}
    return row | {"server": server, "scenario": scenario, "failed": failed}


def hand_made_runs() -> list[dict[str, Any]]:
    return [
        run("tessera", "decode", 3.0, 100.0),
        run("tessera", "decode", 1.0, 300.0),
        run("tessera", "decode", 2.0, None, failed=1),
        run("vllm", "decode", 2.0, 400.0),
        run("vllm", "decode", 4.0, 200.0),
    ]


def test_summary_takes_medians_over_rounds() -> None:
    summary = bench.summarize(hand_made_runs())
    mine = summary[("decode", "tessera")]
    assert mine["req_s"] == 2.0 and mine["out_tok_s"] == 20.0
    assert mine["ttft_p99_ms"] == 200.0  # the round without a value is left out
    assert (mine["rounds"], mine["failed"]) == (3, 1)
    assert summary[("decode", "vllm")]["req_s"] == 3.0
    assert summary[("decode", "vllm")]["itl_p50_ms"] is None


def test_ratios_are_first_over_second() -> None:
    summary = bench.summarize(hand_made_runs())
    ratios = bench.pair_ratios(summary, "decode", ("tessera", "vllm"))
    assert ratios["req_s"] == pytest.approx(2.0 / 3.0)
    assert ratios["ttft_p99_ms"] == pytest.approx(200.0 / 300.0)
    assert ratios["itl_p99_ms"] is None
    assert bench.pair_ratios(summary, "image1", ("tessera", "vllm")) is None
    group = bench.Group((), ("decode", "image1"), (("tessera", "vllm"), ("vllm", "tessera")))
    rows = bench.ratio_rows(summary, [group])
    assert [(r["scenario"], r["pair"]) for r in rows] == [
        ("decode", ["tessera", "vllm"]),
        ("decode", ["vllm", "tessera"]),
    ]
    assert rows[1]["ratios"]["req_s"] == pytest.approx(1.5)
    assert bench.ratio(1.0, 0.0) is None and bench.ratio(None, 2.0) is None


def test_tables_show_medians_and_ratios() -> None:
    summary = bench.summarize(hand_made_runs())
    group = bench.Group((), ("decode",), (("tessera", "vllm"),))
    text = bench.markdown(summary, bench.ratio_rows(summary, [group]))
    lines = text.splitlines()
    assert "| decode | tessera | 2.00 | 20.0 | - | 200.0 | - | - | - | 3 | 1 |" in lines
    assert "| decode | vllm | 3.00 | 30.0 | - | 300.0 | - | - | - | 2 | 0 |" in lines
    assert "| decode | tessera / vllm | 0.67x | 0.67x | 0.67 | - |" in lines
    header = next(line for line in lines if line.startswith("| workload | server"))
    assert header.count("|") == lines[lines.index(header) + 1].count("|")


def test_rotation_alternates_who_goes_first() -> None:
    assert [bench.rotated(["a", "b"], r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]


def test_vllm_server_runs_outside_the_repository(tmp_path: Path) -> None:
    args = bench.parse_args(["--model-path", "/tmp/m", "--log-dir", str(tmp_path)])
    assert args.group == ["tp1", "tp2"] and args.rounds == 3
    spec = bench.GROUPS["tp2"].servers[2]
    server = bench.make_server(spec, args)
    assert server.cwd == tmp_path.resolve() and server.env["PYTHONPATH"] == ""
    assert server.argv[-2:] == ["--mm-encoder-tp-mode", "data"]
    assert len(server.env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert "VLLM_CPU_OMP_THREADS_BIND" not in bench.vllm_env(())
    tessera = bench.make_server(bench.GROUPS["tp2"].servers[0], args)
    assert tessera.argv[1] == "launch.py" and "--mm-enable-dp-encoder" in tessera.argv
    assert bench.parse_args(["--model-path", "m", "--quick"]).rounds == 1
    assert tessera.argv[tessera.argv.index("--model-path") + 1] == "/tmp/m"


def test_workload_filter_runs_only_that_workload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--workload long-prompt`: the tp 1 group measures only it on each server; the tp 2
    group, which has no such workload, starts no server at all."""
    args = bench.parse_args(["--model-path", "/tmp/a", "--workload", "long-prompt",
                             "--rounds", "1", "--log-dir", str(tmp_path)])
    started, measured = [], []

    @contextlib.contextmanager
    def fake_running(server: Any, ready_timeout: float) -> Any:
        started.append(server)
        yield server

    monkeypatch.setattr(bench, "running", fake_running)
    monkeypatch.setattr(bench, "measure", lambda server, scenario, seed, warmup: (
        measured.append(scenario.name) or {"scenario": scenario.name, "server": "s",
                                          "req_s": 1.0, "out_tok_s": 1.0, "ttft_p99_ms": 1.0,
                                          "failed": 0, "errors": []}))
    runs: list[dict[str, Any]] = []
    bench.run_group(bench.GROUPS["tp2"], args, runs)
    assert not started and not runs
    bench.run_group(bench.GROUPS["tp1"], args, runs)
    assert len(started) == len(bench.GROUPS["tp1"].servers)
    assert set(measured) == {"long-prompt"} and len(measured) == len(started)


def test_variants_group_starts_tessera_with_each_variants_flags(tmp_path: Path) -> None:
    """`--group variants --variant NAME=FLAGS`: tessera with its defaults and once per variant
    with the variant's flags, ratios variant / defaults; a malformed variant is refused."""
    argv = ["--model-path", "/tmp/a", "--log-dir", str(tmp_path), "--group", "variants",
            "--variant", "mixed-b=--enable-mixed-chunk --max-encoder-patches-per-step 1024"]
    args = bench.parse_args(argv)
    group = bench.variants_group(args.variant)
    assert [s.name for s in group.servers] == ["tessera", "mixed-b"]
    assert group.pairs == (("mixed-b", "tessera"),)
    assert group.scenarios == bench.GROUPS["tp1"].scenarios
    server = bench.make_server(group.servers[1], args)
    flags = server.argv[server.argv.index("launch.py") + 1:]
    assert flags[:2] == ["--model-path", "/tmp/a"]
    assert "--enable-mixed-chunk" in flags
    assert flags[flags.index("--max-encoder-patches-per-step") + 1] == "1024"
    for bad in (["oops"], ["vllm=--tp 1"], []):
        with pytest.raises(SystemExit):
            bench.variants_group(bad)


def test_tp2_group_runs_on_its_own_checkpoint(tmp_path: Path) -> None:
    argv = ["--model-path", "/tmp/a", "--tp2-model-path", "/tmp/b", "--log-dir", str(tmp_path)]
    args = bench.parse_args(argv)
    tp1 = bench.make_server(bench.GROUPS["tp1"].servers[1], args)
    tp2 = bench.make_server(bench.GROUPS["tp2"].servers[3], args)
    assert tp1.argv[tp1.argv.index("--model") + 1] == "/tmp/a"
    assert tp2.argv[tp2.argv.index("--model") + 1] == "/tmp/b"


def fake_group_run(
    monkeypatch: pytest.MonkeyPatch, group: Any, args: Any
) -> list[tuple[Any, str]]:
    """Run `group` with servers that never start and runs that cost nothing: each server as
    made, with the scenario it measured."""
    measured: list[tuple[Any, str]] = []

    @contextlib.contextmanager
    def fake_running(server: Any, ready_timeout: float) -> Any:
        yield server

    def fake_measure(server: Any, scenario: Any, seed: int, warmup: int) -> dict[str, Any]:
        measured.append((server, scenario.name))
        return {"scenario": scenario.name, "server": server.name, "req_s": 1.0,
                "out_tok_s": 1.0, "ttft_p99_ms": 1.0, "failed": 0, "errors": []}  # fmt: skip

    monkeypatch.setattr(bench, "running", fake_running)
    monkeypatch.setattr(bench, "measure", fake_measure)
    bench.run_group(group, args, [])
    return measured


def test_transformers_peer_is_the_reference_server_on_each_groups_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--peer transformers`: tessera against scripts/hf_reference_server.py, in the tp 1 group
    on --model-path and in the tp 2 group (both encoder modes against it) on the tp 2
    checkpoint, although the reference itself has no tp."""
    argv = ["--model-path", "/tmp/a", "--tp2-model-path", "/tmp/b", "--peer", "transformers",
            "--rounds", "1", "--log-dir", str(tmp_path)]  # fmt: skip
    args = bench.parse_args(argv)
    groups = bench.peer_groups(args.peer)
    assert [s.name for s in groups["tp1"].servers] == ["tessera", "transformers"]
    assert groups["tp1"].pairs == (("tessera", "transformers"),)
    assert ("tessera-tp2-dp", "transformers") in groups["tp2"].pairs
    assert ("tessera-tp2-dp", "tessera-tp2-tp") in groups["tp2"].pairs
    assert not any(s.kind == bench.VLLM for g in groups.values() for s in g.servers)
    for name, checkpoint in (("tp1", "/tmp/a"), ("tp2", "/tmp/b")):
        runs = fake_group_run(monkeypatch, groups[name], args)
        made = {server.name: server for server, _ in runs}
        reference = made["transformers"]
        assert reference.argv[1].endswith("scripts/hf_reference_server.py")
        for server in made.values():
            assert server.argv[server.argv.index("--model-path") + 1] == checkpoint
    assert bench.peer_groups(bench.VLLM) == bench.GROUPS


def test_a_variant_from_another_checkout_runs_that_checkouts_launcher(tmp_path: Path) -> None:
    """`--variant base@DIR=`: two versions of tessera side by side, each with its own code."""
    args = bench.parse_args(["--model-path", "/tmp/a", "--log-dir", str(tmp_path)])
    group = bench.variants_group(["base@" + str(tmp_path / "old") + "=--tp 1"])
    assert [s.name for s in group.servers] == ["tessera", "base"]
    assert group.pairs == (("base", "tessera"),)
    old, mine = (bench.make_server(s, args) for s in reversed(group.servers))
    assert old.cwd == (tmp_path / "old").resolve() and mine.cwd == bench.ROOT
    assert old.argv[1:] == ["launch.py", "--model-path", "/tmp/a", "--tp", "1", "--device", "cpu"]
    assert bench.variants_group(["same@/x="]).servers[1].flags == ()
    with pytest.raises(SystemExit):
        bench.variants_group(["transformers@/x=--tp 1"])


def test_costs_are_per_request_and_reported_with_medians() -> None:
    before = {"main_cpu_s": 1.0, "tree_cpu_s": 10.0, "scheduler_minor_faults": 100}
    after = {"main_cpu_s": 1.4, "tree_cpu_s": 18.0, "scheduler_minor_faults": 900}
    spent = bench.costs_per_request(before, after, requests=4)
    assert spent["main_cpu_ms_per_req"] == pytest.approx(100.0)
    assert spent["tree_cpu_ms_per_req"] == pytest.approx(2000.0)
    assert spent["scheduler_faults_per_req"] == pytest.approx(200.0)
    assert bench.costs_per_request(before, before, requests=0)["main_cpu_ms_per_req"] == 0.0
    runs = hand_made_runs()
    for r, main_ms in zip(runs, (30.0, 10.0, 20.0, 5.0, 7.0)):
        r |= {"main_cpu_ms_per_req": main_ms, "tree_cpu_ms_per_req": 10 * main_ms,
              "scheduler_faults_per_req": 0.0}  # fmt: skip
    summary = bench.summarize(runs)
    assert summary[("decode", "tessera")]["main_cpu_ms_per_req"] == 20.0
    lines = bench.costs_table(summary).splitlines()
    assert "| decode | tessera | 20.0 | 200 | 0 |" in lines
    assert "| decode | vllm | 6.0 | 60 | 0 |" in lines
    assert lines[0].count("|") == lines[1].count("|")
    no_costs = bench.summarize(hand_made_runs())  # runs without costs: '-' in the table
    assert "| decode | vllm | - | - | - |" in bench.costs_table(no_costs).splitlines()


def test_a_server_on_cpus_of_its_own(tmp_path: Path) -> None:
    """--cpus-per-server: the server's taskset CPUs, and vLLM's ranks bound among them."""
    args = bench.parse_args(["--model-path", "/tmp/a", "--log-dir", str(tmp_path)])
    args.server_cpus = [6, 7]
    vllm = bench.make_server(bench.GROUPS["tp2"].servers[2], args)
    assert vllm.cpus == [6, 7] and vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "6|7"
    assert bench.make_server(bench.GROUPS["tp1"].servers[0], args).cpus == [6, 7]


def test_segments_a_server_left_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "SHM", tmp_path)
    (tmp_path / "vllm_old").write_text("")  # there before the server: not ours
    (tmp_path / "other").write_text("")
    before = bench.shm_names()
    for name in ("vllm_dist_1", "sem.mp-x"):
        (tmp_path / name).write_text("")
    assert bench.remove_new_segments(before, "vllm") == ["vllm_dist_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "sem.mp-x", "vllm_old"]


# ---------------------------------------------------------------- greedy verdicts


def test_greedy_verdicts() -> None:
    assert bench.verdict({"text": "ab"}, "ab") == "equal"
    assert bench.verdict({"text": "ab"}, "ab\ufffd").startswith("equal less a trailing partial")
    assert bench.verdict({"text": "abX"}, "abc") == "differs at char 2"
    assert bench.verdict({"text": "a"}, "abc") == "differs at char 1"
    assert bench.verdict({"error": "HTTP 400: x"}, "abc") == "error: HTTP 400: x"
    expected = [{"text": "hi", "prompt_tokens": 5}]
    same = bench.greedy_rows(
        {
            "tessera": [{"text": "hi", "prompt_tokens": 5}],
            "vllm": [{"text": "h", "prompt_tokens": 5}],
        },
        expected,
    )[0]
    assert same["prompt_tokens_equal"] and same["verdicts"]["vllm"] == "differs at char 1"
    other = bench.greedy_rows(
        {
            "tessera": [{"text": "hi", "prompt_tokens": 5}],
            "vllm": [{"text": "hi", "prompt_tokens": 6}],
        },
        expected,
    )[0]
    assert not other["prompt_tokens_equal"]
    assert "| 0 | 5, 6, 5 | False | equal | equal |" in bench.greedy_table([other])


def test_greedy_cases_cover_text_and_images() -> None:
    cases = bench.greedy_cases()
    images = [sum(p["type"] == "image_url" for p in c["messages"][0]["content"]) for c in cases]
    assert images == [0, 0, 0, 0, 1, 1, 2]
    assert all(c["temperature"] == 0.0 and "ignore_eos" not in c for c in cases)


# ---------------------------------------------------------------- process-group teardown

LEAVES_A_CHILD = """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(sys.argv[1], "w").write(str(child.pid))
    time.sleep(float(sys.argv[2]))  # then the leader exits and the child stays behind
"""

IGNORES_SIGINT = """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(sys.argv[1], "w").write(str(child.pid))
    time.sleep(120)
"""

SERVES_HEALTH = """
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(sys.argv[1], "w").write(str(child.pid))

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[-1])), Health).serve_forever()
"""


def dummy_server(tmp_path: Path, code: str, *args: str) -> tuple[Any, Path]:
    script = tmp_path / "dummy.py"
    script.write_text(textwrap.dedent(code))
    pid_file = tmp_path / "child.pid"
    argv = [sys.executable, str(script), str(pid_file), *args]
    return bench.Server("dummy", argv, tmp_path / "dummy.log"), pid_file


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def started_child(pid_file: Path) -> int:
    wait_until(lambda: pid_file.exists() and pid_file.read_text(), timeout=30)
    return int(pid_file.read_text())


def test_stop_ends_children_the_leader_left_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a shell's background job starts with SIGINT ignored, and its children inherit that: the
    # group is then ended by SIGKILL after the grace period, which need not be 30 s here
    monkeypatch.setattr(bench, "STOP_GRACE_S", 0.5)
    server, pid_file = dummy_server(tmp_path, LEAVES_A_CHILD, "0")
    server.start()
    child = started_child(pid_file)
    server.proc.wait(30)
    assert alive(child)  # the leader is gone, its child is not
    server.stop()
    assert not alive(child)


def test_stop_kills_a_group_that_ignores_sigint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "STOP_GRACE_S", 0.5)
    server, pid_file = dummy_server(tmp_path, IGNORES_SIGINT)
    server.start()
    child = started_child(pid_file)
    server.stop()
    assert not alive(child) and server.proc.returncode is not None
    assert not bench.group_alive(server.proc.pid)


def test_running_stops_the_server_when_the_run_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "STOP_GRACE_S", 0.5)  # as above
    server, pid_file = dummy_server(tmp_path, SERVES_HEALTH)
    with pytest.raises(RuntimeError, match="workload failed"):
        with bench.running(server, ready_timeout=60.0):
            child = started_child(pid_file)
            raise RuntimeError("workload failed")
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child) and not alive(server.proc.pid)
    assert os.path.exists(server.log)
