"""End to end with the official openai client: n choices, logprobs (chat, completions, streamed,
and SGLang's on /generate), penalties and stop tokens, against transformers on the same tiny
checkpoint; beam search and its relatives are refused with a 400 that names the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from stress import LaunchedServer
from test_server import Server, client, image_part, serve_then_check_teardown
from transformers.generation import logits_process as hf
from vlm_cases import Case, Checkpoint, hf_generate, load_hf, noise_image

from runtime.tiny_checkpoint import make_checkpoint

NEW = 10
TEXT = "Describe the cat and the dog and the cat again."
QUESTION = "What is in the picture?"


class OneRankServer(Server):
    """launch.py at tp 1 on CPU (the tp 2 paths are covered by test_server)."""

    def __init__(self, folder: str, log: Path, *extra: str):
        flags = ["--model-path", folder, "--device", "cpu", "--max-total-tokens", "6000"]
        LaunchedServer.__init__(self, [*flags, *extra], log)
        try:
            self.wait_healthy(240)
        except BaseException:
            self.stop()
            raise


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("sampling") / "qwen2_vl"))


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serve_then_check_teardown(OneRankServer(folder, log))


@pytest.fixture(scope="module")
def oracle(folder: str) -> dict[str, Any]:
    ckpt = Checkpoint(Path(folder))
    return {
        "ckpt": ckpt,
        "model": load_hf(Path(folder)),
        "text": ckpt.case("text", [TEXT]),
        "image": ckpt.case("image", [noise_image(), QUESTION]),
    }


def hf_tokens(oracle: dict[str, Any], case: Case, *processors: Any) -> tuple[list[int], Any]:
    out = hf_generate(oracle["model"], case, NEW, list(processors))
    return out.sequences[0, case.hf_inputs["input_ids"].shape[1] :].tolist(), out.logits


def text_of(oracle: dict[str, Any], tokens: list[int]) -> str:
    return oracle["ckpt"].tokenizer.decode(tokens, skip_special_tokens=True)


def chat(server: Server, content: str | list[dict], **kw: Any):
    kw = {"max_tokens": NEW, "temperature": 0, **kw}
    messages = [{"role": "user", "content": content}]
    return client(server).chat.completions.create(model="qwen2_vl", messages=messages, **kw)


def server_info(server: Server) -> dict[str, Any]:
    return httpx.get(server.url + "/server_info", timeout=30).json()


# ---------------------------------------------------------------------- n


def test_n_choices_share_one_prefill_and_encode(server: Server, oracle: dict[str, Any]) -> None:
    want = text_of(oracle, hf_tokens(oracle, oracle["image"])[0])
    before = server_info(server)
    out = chat(server, [image_part(noise_image()), {"type": "text", "text": QUESTION}], n=3)
    after = server_info(server)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content == want and c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 3 * NEW
    encoded = after["encoder_cache"]["items_encoded"] - before["encoder_cache"]["items_encoded"]
    assert encoded <= 1  # once (or not at all, when an earlier test left it cached)
    computed = after["counters"]["prompt_tokens_computed"]
    assert computed - before["counters"]["prompt_tokens_computed"] <= out.usage.prompt_tokens + 2


def test_seeded_choices_differ_and_repeat(server: Server) -> None:
    kw = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 6}
    first = [c.message.content for c in chat(server, TEXT, **kw).choices]
    again = [c.message.content for c in chat(server, TEXT, **kw).choices]
    assert first == again and len(set(first)) > 1


def test_streamed_choices_equal_the_whole_response(server: Server) -> None:
    kw = {"n": 2, "temperature": 1.0, "seed": 5, "logprobs": True, "top_logprobs": 2}
    whole = chat(server, TEXT, **kw)
    texts, logprobs, finishes = ["", ""], [[], []], [None, None]
    for chunk in chat(server, TEXT, stream=True, **kw):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            logprobs[choice.index] += choice.logprobs.content if choice.logprobs else []
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == ["length", "length"]
    for streamed, choice in zip(logprobs, whole.choices):
        assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]


# ---------------------------------------------------------------------- logprobs


def test_chat_logprobs_match_hf_log_softmax(server: Server, oracle: dict[str, Any]) -> None:
    tokens, logits = hf_tokens(oracle, oracle["text"])
    out = chat(server, TEXT, logprobs=True, top_logprobs=3).choices[0]
    content = out.logprobs.content
    assert len(content) == NEW
    raw_bytes = b"".join(bytes(e.bytes) for e in content)  # random tokens: maybe not UTF-8
    assert raw_bytes.decode(errors="replace") == out.message.content == text_of(oracle, tokens)
    for entry, token, step in zip(content, tokens, logits):
        raw = step[0].float().log_softmax(-1)
        assert abs(entry.logprob - raw[token].item()) < 2e-3
        values, ids = raw.topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=2e-3)
        assert [t.token for t in entry.top_logprobs] == [
            oracle["ckpt"].tokenizer.decode([i]) for i in ids.tolist()
        ]
    assert chat(server, TEXT).choices[0].logprobs is None


def test_completions_legacy_logprobs_with_text_offset(server: Server) -> None:
    completions = client(server).completions
    kw = {"model": "qwen2_vl", "prompt": TEXT, "max_tokens": NEW, "temperature": 0}
    out = completions.create(logprobs=2, **kw).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == NEW
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(NEW)]
    assert all(len(top) in (2, 3) and tok in top for top, tok in zip(lp.top_logprobs, lp.tokens))
    streamed = [c.choices[0].logprobs for c in completions.create(stream=True, logprobs=2, **kw)]
    offsets = [o for chunk in streamed if chunk for o in chunk.text_offset]
    assert offsets == lp.text_offset


def test_native_generate_returns_sglang_logprobs(server: Server) -> None:
    body = {
        "text": TEXT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    meta = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    chosen, top = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(chosen) == len(top) == 4
    assert all(len(t) == 2 and t[0][0] >= c[0] for c, t in zip(chosen, top))
    assert all(isinstance(c[2], str) for c in chosen)


# ---------------------------------------------------------------------- controls and stops


def test_penalties_through_the_client_match_hf(server: Server, oracle: dict[str, Any]) -> None:
    tokens, _ = hf_tokens(oracle, oracle["text"], hf.RepetitionPenaltyLogitsProcessor(1.8))
    out = chat(server, TEXT, extra_body={"repetition_penalty": 1.8})
    assert out.choices[0].message.content == text_of(oracle, tokens)
    plain = chat(server, TEXT).choices[0].message.content
    pushed = chat(server, TEXT, presence_penalty=-2.0, frequency_penalty=-2.0)
    assert pushed.choices[0].message.content != plain


def test_a_stop_token_is_not_in_the_text(server: Server, oracle: dict[str, Any]) -> None:
    tokens, _ = hf_tokens(oracle, oracle["text"])
    stop = tokens[3]
    cut = tokens.index(stop)
    out = chat(server, TEXT, extra_body={"stop_token_ids": [stop]}).choices[0]
    assert (out.message.content, out.finish_reason) == (text_of(oracle, tokens[:cut]), "stop")
    kept = chat(
        server, TEXT, extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": True}
    )
    assert kept.choices[0].message.content == text_of(oracle, tokens[: cut + 1])
    held = chat(server, TEXT, extra_body={"stop_token_ids": [stop], "min_tokens": cut + 2})
    assert len(held.choices[0].message.content) > len(out.message.content)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_beam_search", True),
        ("best_of", 3),
        ("top_logprobs", 3),  # without logprobs
        ("top_logprobs", 21),
        ("repetition_penalty", 0),
        ("logit_bias", {"100000000": 5}),
        ("min_tokens", 50),
    ],
)
def test_refusals_name_the_field(server: Server, field: str, value: object) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value}
    if field == "top_logprobs" and value == 21:
        body["logprobs"] = True
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert field in json.dumps(resp.json()["error"])
    info = server_info(server)
    assert info["kv_free"] + info["kv_evictable"] == info["kv_total"]


def test_completions_prompts_times_n_choices(server: Server) -> None:
    """Prompt i's choice j is choice i * n + j, whole and streamed; each prompt counts once."""
    completions = client(server).completions
    prompts = [TEXT, "A short other prompt."]
    kw = {"model": "qwen2_vl", "max_tokens": 5, "temperature": 0, "n": 2}
    whole = completions.create(prompt=prompts, **kw)
    alone = [completions.create(prompt=p, **{**kw, "n": 1}) for p in prompts]
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert texts == [a.choices[0].text for a in alone for _ in range(2)]
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert whole.usage.completion_tokens == 4 * 5
    streamed = ["", "", "", ""]
    for chunk in completions.create(prompt=prompts, stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
