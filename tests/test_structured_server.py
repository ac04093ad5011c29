"""Structured outputs end to end on a served tiny random checkpoint (its output is noise, so only
the constraint makes it valid): every API spelling, streamed and not, n > 1, and the 400s that
name the field of an invalid constraint; the server leaks no KV afterwards."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from grammar_cases import CHOICES, EBNF, EBNF_PATTERN, REGEXES, SCHEMAS
from hostile_inputs import AMBIGUOUS
from test_openai_sampling import OneRankServer
from test_server import Server, client, serve_then_check_teardown
from test_tools import TOOLS_TEMPLATE
from think_tokens import add_think_tokens
from waits import wait_until

from runtime.tiny_checkpoint import make_checkpoint

MAX = 400
PICKED = (0, 1, 3, 6, 9, 10)  # bounded schemas: greedy noise ends them too


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("structured") / "qwen2_vl")
    template = {"chat_template": TOOLS_TEMPLATE}  # one that renders tools
    (folder / "chat_template.json").write_text(json.dumps(template))
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serve_then_check_teardown(OneRankServer(str(folder), log))


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("thinking") / "qwen2_vl")
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TOOLS_TEMPLATE}))
    ids = add_think_tokens(folder)
    log = tmp_path_factory.mktemp("log") / "thinking.log"
    srv = OneRankServer(str(folder), log, "--reasoning-parser", "qwen3")
    srv.think_ids = ids
    yield from serve_then_check_teardown(srv)


def chat(server: Server, **kw: Any):
    kw = {"max_tokens": MAX, "temperature": 0, **kw}
    messages = [{"role": "user", "content": "Fill in the form."}]
    return client(server).chat.completions.create(model="qwen2_vl", messages=messages, **kw)


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    body = {"model": "qwen2_vl", "max_tokens": MAX, **body}
    return httpx.post(server.url + path, json=body, timeout=120)


def response_format(schema: dict) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "form", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize("index", PICKED)
def test_response_format_json_schema_validates_and_stops(server, index) -> None:
    schema = SCHEMAS[index]
    runs = [{"temperature": 0}, *({"temperature": 1, "seed": s} for s in (1, 2))]
    for run in runs:
        reply = chat(server, response_format=response_format(schema), **run)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (run, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_n_choices(server) -> None:
    reply = chat(server, response_format={"type": "json_object"}, temperature=1, seed=3, n=3)
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)


def test_vllm_spellings_on_completions(server) -> None:
    prompt = {"prompt": "Answer:", "temperature": 1, "seed": 7}
    for pattern in REGEXES:
        for field in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
            body = post(server, "/v1/completions", prompt | field).json()
            choice = body["choices"][0]
            assert choice["finish_reason"] == "stop"
            assert re.fullmatch(pattern, choice["text"]), (field, choice["text"])
    for field in ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}):
        body = post(server, "/v1/completions", prompt | field | {"n": 4}).json()
        assert {c["text"] for c in body["choices"]} <= set(CHOICES)
    body = post(server, "/v1/completions", prompt | {"guided_grammar": EBNF}).json()
    assert re.fullmatch(EBNF_PATTERN, body["choices"][0]["text"])
    schema = SCHEMAS[3]
    body = post(server, "/v1/completions", prompt | {"guided_json": schema}).json()
    jsonschema.validate(json.loads(body["choices"][0]["text"]), schema)


def test_streamed_chat_follows_the_schema(server) -> None:
    schema = SCHEMAS[6]
    stream = chat(
        server,
        stream=True,
        temperature=1,
        seed=4,
        extra_body={"structured_outputs": {"json": schema}},
    )
    text, reasons = "", []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_native_generate_spellings(server) -> None:
    schema = SCHEMAS[0]
    cases = [
        ({"json_schema": json.dumps(schema)}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"regex": REGEXES[1]}, lambda t: re.fullmatch(REGEXES[1], t) or pytest.fail(t)),
        ({"ebnf": EBNF}, lambda t: re.fullmatch(EBNF_PATTERN, t) or pytest.fail(t)),
    ]
    for constraint, check in cases:
        params = {"max_new_tokens": MAX, "temperature": 1.0, "sampling_seed": 5, **constraint}
        body = {"text": "Answer:", "sampling_params": params}
        out = httpx.post(server.url + "/generate", json=body, timeout=120).json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        check(out["text"])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"guided_json": "{not json"}, "guided_json"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nothing"}}, None),
        ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "json": {}}}, None),
    ],
)
def test_invalid_constraints_are_400s_naming_the_field(server, path, body, param) -> None:
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    else:
        body = {"prompt": "hi", **body}
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    else:
        assert error["param"].startswith("structured_outputs"), error


def test_sglang_invalid_schema_is_a_400_and_nothing_leaks(server) -> None:
    params = {"json_schema": '{"type": "object", "properties": 5}'}
    body = {"text": "hi", "sampling_params": params}
    resp = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "sampling_params.json_schema"
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]
    assert info["running"] == 0 and info["waiting"] == 0


# Every split of a run of a's and b's is a parse: the engine gives up tens of tokens in.


def server_idle(server: Server) -> bool:
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    idle = info["running"] == 0 and info["waiting"] == 0
    return idle and info["kv_free"] + info["kv_evictable"] == info["kv_total"]


def test_a_grammar_the_engine_gives_up_on_is_a_400_naming_it(server) -> None:
    body = {"prompt": "hi", "guided_grammar": AMBIGUOUS, "min_tokens": 300, "max_tokens": 300}
    resp = post(server, "/v1/completions", {"temperature": 0, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "guided_grammar", error
    assert "per-step limit after" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert wait_until(lambda: server_idle(server))


def test_a_streamed_grammar_the_engine_gives_up_on_ends_with_an_error_event(server) -> None:
    body = {
        "model": "qwen2_vl",
        "messages": [{"role": "user", "content": "hi"}],
        "structured_outputs": {"grammar": AMBIGUOUS},
        "min_tokens": 300,
        "max_tokens": 300,
        "stream": True,
    }
    url = server.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["param"] == "structured_outputs.grammar", error
    assert "per-step limit after" in error["message"]
    text = "".join(
        chunk["choices"][0]["delta"].get("content") or ""
        for chunk in map(json.loads, (line.removeprefix("data: ") for line in lines[:-2]))
    )
    assert text and set(text) <= {"a", "b"}  # what the grammar allowed until it gave up
    assert wait_until(lambda: server_idle(server))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_and_named_tool_calls_parse_and_validate(server) -> None:
    for seed in (1, 2, 3):
        reply = chat(server, tools=TOOLS, tool_choice="required", temperature=1, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        check_calls(choice.message.tool_calls, set(PARAMETERS))
        named = {"type": "function", "function": {"name": "add"}}
        reply = chat(server, tools=TOOLS, tool_choice=named, temperature=1, seed=seed)
        check_calls(reply.choices[0].message.tool_calls, {"add"})


def test_streamed_required_tool_call(server) -> None:
    stream = chat(
        server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True
    )
    calls, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "tool_calls"
    check_calls(calls, set(PARAMETERS))


@pytest.mark.parametrize(
    "choice", [{"type": "function", "function": {"name": "nope"}}, "always", {"type": "function"}]
)
def test_bad_tool_choice_is_a_400(server, choice) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": choice}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice", resp.text


def think_bias(server: Server) -> dict[str, Any]:
    """The noise model opens and closes its thinking section soon (else it thinks for ever)."""
    return {"logit_bias": {str(i): 6 for i in server.think_ids.values()}}


def test_constraint_binds_only_what_follows_the_thinking_section(thinking_server) -> None:
    schema = SCHEMAS[1]
    fmt = response_format(schema)
    extra = think_bias(thinking_server)
    for seed in (1, 2):
        reply = chat(
            thinking_server, response_format=fmt, temperature=1, seed=seed, n=2, extra_body=extra
        )
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.message
            assert choice.message.model_extra.get("reasoning_content") is not None
            jsonschema.validate(json.loads(choice.message.content), schema)
    # a reply that does not open with <think> has no thinking section: JSON from its first token
    never = {"logit_bias": {str(thinking_server.think_ids["<think>"]): -100}}
    plain = chat(thinking_server, response_format=fmt, extra_body=never)
    assert plain.choices[0].message.model_extra.get("reasoning_content") is None
    jsonschema.validate(json.loads(plain.choices[0].message.content), schema)


def test_streamed_thinking_then_constrained_content(thinking_server) -> None:
    schema = SCHEMAS[6]
    stream = chat(
        thinking_server,
        stream=True,
        temperature=1,
        seed=5,
        extra_body={"structured_outputs": {"json": schema}} | think_bias(thinking_server),
    )
    content, thought, reasons = "", None, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            if (piece := choice.delta.model_extra.get("reasoning_content")) is not None:
                thought = (thought or "") + piece
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop" and thought is not None
    jsonschema.validate(json.loads(content), schema)


def test_required_tool_call_after_thinking(thinking_server) -> None:
    reply = chat(
        thinking_server,
        tools=TOOLS,
        tool_choice="required",
        temperature=1,
        seed=2,
        extra_body=think_bias(thinking_server),
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    check_calls(choice.message.tool_calls, set(PARAMETERS))
    info = httpx.get(thinking_server.url + "/server_info", timeout=30).json()
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]


def test_jump_forward_runs_stream_and_stop_strings_cut_them(server) -> None:
    """The keys of a fixed schema are forced runs (counted in /server_info); a stop string
    inside one still ends the reply there, streamed or not."""
    fmt = response_format(SCHEMAS[1])
    whole = chat(server, response_format=fmt).choices[0].message.content
    assert '"vendor"' in whole
    cut = chat(server, response_format=fmt, stop=["vendor"]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == whole[: whole.index("vendor")]
    stream = chat(server, response_format=fmt, stop=["vendor"], stream=True)
    text = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    assert text == cut.message.content
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert info["counters"]["forced_tokens"] > 0
