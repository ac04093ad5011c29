"""No constraint a client sends can crash a process that serves others (issue 57).

The engine (llguidance 1.9.1) recurses once per link of a rule or `$ref` chain and dies of
SIGSEGV when its thread's stack runs out; it raises ValueError for JSON nested past its parser's
depth; it converts GBNF in Python, slowly. Here: the shape limits refuse such inputs up front,
the engine's ValueErrors are 400s naming the field, the scheduler's compile threads have room
for what the front end's workers accept, a compile that kills its worker is a cached 400 and the
worker is replaced, a compile past its deadline is killed, and small constraints never wait
behind slow ones.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from grammar_cases import SCHEMAS
from hostile_inputs import lark_chain, nested_arrays, ref_chain, slow_gbnf
from test_openai_sampling import OneRankServer
from test_server import Server, serve_then_check_teardown
from waits import wait_until

from runtime.grammar import (
    CompileLimits,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    StructureLimits,
    check_limits,
    make_backend,
)
from runtime.grammar.limits import json_shape
from runtime.tiny_checkpoint import build_tokenizer, make_checkpoint
from tokenizer_manager.grammar_check import CheckLimits, GrammarCheck
from tokenizer_manager.protocol import APIError

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
UNBOUNDED = CompileLimits(structure=StructureLimits(10**6, 10**6, 10**6))  # the engine decides
# run in a fresh interpreter: compile a Lark chain on a thread with the given stack, or on a
# GrammarCompiler's own threads ("compiler")
CHAIN_SCRIPT = """
import sys, threading
from runtime.grammar import CompileLimits, GrammarCompiler, GrammarSpec, StructureLimits
from runtime.grammar import make_backend
from runtime.tiny_checkpoint import build_tokenizer
sys.path.insert(0, "tests")
from hostile_inputs import lark_chain
tok = build_tokenizer()
backend = make_backend("llguidance", tok.to_str(), 512, [tok.token_to_id("<|im_end|>")])
spec = GrammarSpec("ebnf", lark_chain(int(sys.argv[1])))
if sys.argv[2] == "compiler":
    limits = CompileLimits(structure=StructureLimits(10**6, 10**6, 10**6))
    GrammarCompiler(backend, limits).compile(spec)
else:
    threading.stack_size(int(sys.argv[2]))
    thread = threading.Thread(target=backend.compile, args=(spec,))
    thread.start()
    thread.join()
print("compiled")
"""


def compile_chain_in_subprocess(links: int, stack: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", CHAIN_SCRIPT, str(links), stack]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_long_rule_chain_crashes_a_default_thread_not_the_compiler() -> None:
    crashed = compile_chain_in_subprocess(3000, str(8 << 20))  # a typical thread's stack
    assert crashed.returncode == -11, crashed.stderr[-2000:]  # SIGSEGV: why workers exist
    served = compile_chain_in_subprocess(3000, "compiler")
    assert served.returncode == 0 and "compiled" in served.stdout, served.stderr[-2000:]


def test_shape_limits_refuse_chains_and_depth_before_the_engine() -> None:
    limits = CompileLimits()
    cases = [
        (GrammarSpec("ebnf", lark_chain(3000), "guided_grammar"), "3002 rules"),
        (GrammarSpec.json_schema(ref_chain(2500), "response_format"), "2501 \\$refs"),
        (GrammarSpec.json_schema(nested_arrays(130), "guided_json"), "131 levels"),
        (GrammarSpec.structural_tag(nested_arrays(130), "structural_tag"), "131 levels"),
    ]
    for spec, needle in cases:
        with pytest.raises(GrammarError, match=needle) as info:
            check_limits(spec, limits)
        assert info.value.param == spec.param
    for schema in SCHEMAS:
        check_limits(GrammarSpec.json_schema(schema, "response_format"), limits)
    check_limits(GrammarSpec("ebnf", lark_chain(1000)), limits)
    assert json_shape({"a": [1, {"$ref": "x"}], "b": 2}) == (3, 1)
    assert json_shape(5) == (0, 0)


def test_engine_value_errors_are_grammar_errors() -> None:
    tok = build_tokenizer()
    backend = make_backend("llguidance", tok.to_str(), VOCAB, [tok.token_to_id("<|im_end|>")])
    compiler = GrammarCompiler(backend, UNBOUNDED)
    try:
        spec = GrammarSpec.json_schema(nested_arrays(130), "response_format")
        with pytest.raises(GrammarError, match="recursion limit") as info:
            compiler.compile(spec)
        assert info.value.param == "response_format"
        compiler.compile(GrammarSpec.json_schema(SCHEMAS[0]))  # still compiling
    finally:
        compiler.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("isolation") / "qwen2_vl"))


def run_check(limits: CheckLimits, folder: str, body) -> None:
    """`await body(check)` with a GrammarCheck over the tiny checkpoint, on one event loop."""

    async def main() -> None:
        check = GrammarCheck(folder, VOCAB, [0], limits)
        try:
            await body(check)
        finally:
            await check.close()

    asyncio.run(main())


def all_pids(check: GrammarCheck) -> list[int]:
    return sorted(pid for pids in check.lane_pids().values() for pid in pids)


async def refusal_of(check: GrammarCheck, spec: GrammarSpec) -> APIError:
    with pytest.raises(APIError) as info:
        await check.check(spec)
    assert info.value.status == 400 and info.value.param == spec.param, info.value.message
    return info.value


def test_a_compile_that_kills_its_worker_is_a_cached_400(folder: str) -> None:
    async def body(check: GrammarCheck) -> None:
        await check.check(GrammarSpec("regex", "[0-9]+", "regex"))
        assert wait_until(lambda: len(all_pids(check)) == 3), "the workers did not start"
        before = all_pids(check)
        hostile = GrammarSpec("ebnf", lark_chain(7000), "guided_grammar")  # past 16 MiB of stack
        error = await refusal_of(check, hostile)
        assert error.message == "guided_grammar: the grammar is too complex to compile"
        assert wait_until(lambda: len(all_pids(check)) == 3), "the dead worker was not replaced"
        after = all_pids(check)
        assert len(set(after) - set(before)) == 1  # one worker died, and only one
        again = await refusal_of(check, replace(hostile, param="ebnf"))
        assert again.message.startswith("ebnf: the grammar is too complex")
        assert all_pids(check) == after  # refused from the cache: no compile, no death
        await check.check(GrammarSpec("ebnf", lark_chain(100), "guided_grammar"))
        assert check.info() == {"verdicts": 3, "compiling": 0}

    run_check(CheckLimits(compile=UNBOUNDED), folder, body)


def test_fast_lane_overrun_moves_to_the_slow_lane_and_the_deadline_kills(folder: str) -> None:
    async def body(check: GrammarCheck) -> None:
        await check.check(GrammarSpec("regex", "[0-9]+", "regex"))  # workers up
        fast = check.lane_pids()["fast"]
        await check.check(GrammarSpec("ebnf", slow_gbnf(300, 0), "ebnf"))  # ~0.2 s: overruns
        assert wait_until(lambda: check.lane_pids()["fast"] not in ([], fast))
        slow = check.lane_pids()["slow"]
        error = await refusal_of(check, GrammarSpec("ebnf", slow_gbnf(1990, 1), "ebnf"))
        assert "too complex to compile" in error.message and "took" in error.message
        assert wait_until(lambda: len(set(check.lane_pids()["slow"]) - set(slow)) == 1)

    limits = CheckLimits(
        compile=replace(CompileLimits(), timeout_s=1.0),
        fast_lane_bytes=1 << 20,
        fast_timeout_s=0.02,
    )
    run_check(limits, folder, body)


# --------------------------------------------------------------------------- a live tp-1 server
def test_the_scheduler_compiles_the_gbnf_the_front_end_converted(
    folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GBNF is converted to the engine's grammar once, in the front end's worker (seconds of
    Python holding the GIL for a long chain): the checked spec carries the converted form, and a
    compile of it does no conversion, so the scheduler loop never pays for it."""
    import llguidance

    spec = GrammarSpec("ebnf", slow_gbnf(200, 3), "guided_grammar")
    checked: list[GrammarSpec] = []

    async def body(check: GrammarCheck) -> None:
        checked.append(await check.check(spec))
        regex = GrammarSpec("regex", "[0-9]+", "regex")
        assert await check.check(regex) == regex and (await check.check(regex)).prepared is None

    run_check(CheckLimits(), folder, body)
    (prepared,) = checked
    assert prepared == spec and prepared.prepared and prepared.prepared != spec.text
    tok = build_tokenizer()
    backend = make_backend("llguidance", tok.to_str(), VOCAB, [tok.token_to_id("<|im_end|>")])

    def no_conversion(*args: object) -> str:
        raise AssertionError("GBNF converted again")

    monkeypatch.setattr(llguidance, "grammar_from", no_conversion)
    matcher = backend.new_matcher(backend.compile(prepared))
    assert matcher.error() is None and not matcher.is_terminated()
    with pytest.raises(AssertionError, match="converted again"):
        backend.compile(spec)  # the raw spec would convert


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serve_then_check_teardown(OneRankServer(folder, log))


def post(server: Server, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json={"max_tokens": 8, **body}, timeout=timeout)


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **kw}


def assert_refused(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def assert_still_serving(server: Server) -> None:
    resp = post(server, "/v1/chat/completions", chat_body(guided_regex="[0-9]{3}"))
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"][0]["message"]["content"]) == 3
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert server.proc.poll() is None
    assert info["running"] == 0 and info["waiting"] == 0
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]


def test_chains_are_400s_and_the_server_keeps_serving(server: Server) -> None:
    lark = post(server, "/v1/chat/completions", chat_body(guided_grammar=lark_chain(3000)))
    assert_refused(lark, "guided_grammar")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(2500)}}
    refs = post(server, "/v1/chat/completions", chat_body(response_format=fmt))
    assert_refused(refs, "response_format")
    assert_still_serving(server)


def test_a_deeply_nested_schema_is_a_400_on_every_spelling(server: Server) -> None:
    deep = nested_arrays(130)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}
    cases = [
        ("/v1/chat/completions", chat_body(response_format=fmt), "response_format"),
        ("/v1/chat/completions", chat_body(guided_json=deep), "guided_json"),
        (
            "/v1/chat/completions",
            chat_body(structured_outputs={"json": deep}),
            "structured_outputs.json",
        ),
        ("/v1/completions", {"prompt": "hi", "guided_json": deep}, "guided_json"),
        ("/v1/completions", {"prompt": "hi", "response_format": fmt}, "response_format"),
    ]
    for path, body, param in cases:
        assert_refused(post(server, path, body), param)
    params = {"max_new_tokens": 8, "json_schema": json.dumps(deep)}
    native = httpx.post(
        server.url + "/generate", json={"text": "hi", "sampling_params": params}, timeout=120
    )
    assert_refused(native, "sampling_params.json_schema")
    assert_still_serving(server)


def test_a_small_constraint_does_not_wait_behind_slow_compiles(server: Server) -> None:
    assert_still_serving(server)  # the compile workers are up
    done: dict[str, tuple[float, int]] = {}

    def send(name: str, body: dict[str, Any]) -> None:
        resp = post(server, "/v1/completions", {"prompt": "hi", **body}, timeout=300)
        done[name] = (time.monotonic(), resp.status_code)

    slow = [
        threading.Thread(target=send, args=(f"slow{i}", {"guided_grammar": slow_gbnf(1990, i)}))
        for i in range(4)
    ]
    for thread in slow:
        thread.start()
    compiling = lambda: httpx.get(server.url + "/server_info", timeout=30).json()["grammar"]  # noqa: E731
    assert wait_until(lambda: compiling()["compiling"] == 4 or len(done) > 0, 120)
    send("regex", {"guided_regex": "[a-c]{2}"})
    for thread in slow:
        thread.join(300)
    assert done["regex"][1] == 200
    slow_done = [done[f"slow{i}"] for i in range(4)]
    assert all(status in (200, 400) for _, status in slow_done), slow_done
    assert done["regex"][0] < min(t for t, _ in slow_done), done  # answered before any of them
    assert_still_serving(server)
