"""End to end: `launch.py --dp 2 --tp 1` on CPU: two replicas behind one front end. Greedy
outputs equal transformers' (text, image, a stream); a conversation resent with its image stays
on the replica that caches it (cache_aware) and reports cached prompt tokens; a request may
name its replica (`data_parallel_rank`) or keep to its session; each replica is idle-clean."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_openai_sampling import OneRankServer
from test_server import (
    Server,
    client,
    image_part,
    metric_values,
    png_url,
    serve_then_check_teardown,
)
from vlm_cases import Checkpoint, load_hf, noise_image, run_hf
from waits import wait_until

from runtime.tiny_checkpoint import make_checkpoint

NEW = 8
TEXT = "Describe the cat and the dog."
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint("qwen2_vl", tmp_path_factory.mktemp("dp") / "qwen2_vl"))


@pytest.fixture(scope="module")
def oracle(folder: str) -> dict[str, str]:
    ckpt = Checkpoint(Path(folder))
    cases = {
        "text": ckpt.case("text", [TEXT]),
        "image": ckpt.case("image", [noise_image(), QUESTION]),
    }
    model = load_hf(Path(folder))
    for case in cases.values():
        run_hf(model, case, NEW)
    decode = ckpt.tokenizer.decode
    return {k: decode(c.hf_tokens, skip_special_tokens=True) for k, c in cases.items()}


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serve_then_check_teardown(OneRankServer(folder, log, "--dp", "2"))


def chat(server: Server, messages: list[dict], **kw: Any) -> Any:
    kw = {"max_tokens": NEW, "temperature": 0, **kw}
    return client(server).chat.completions.create(model="qwen2_vl", messages=messages, **kw)


def user(content: str | list[dict]) -> dict:
    return {"role": "user", "content": content}


def info(server: Server) -> dict[str, Any]:
    return httpx.get(server.url + "/server_info", timeout=30).json()


def idle_replicas(server: Server) -> list[dict[str, Any]]:
    """/server_info's replicas once none runs, waits or has a request in flight."""

    def idle() -> bool:
        reps = info(server)["replicas"]
        return all(r["running"] == r["waiting"] == r["in_flight"] == 0 for r in reps)

    wait_until(idle)
    return info(server)["replicas"]


def routed(server: Server) -> list[int]:
    return [r["routed"] for r in idle_replicas(server)]


def delta(before: list[int], after: list[int]) -> list[int]:
    return [b - a for a, b in zip(before, after, strict=True)]


def test_text_image_and_stream_equal_hf(server: Server, oracle: dict[str, str]) -> None:
    assert chat(server, [user(TEXT)]).choices[0].message.content == oracle["text"]
    image = [image_part(noise_image()), {"type": "text", "text": QUESTION}]
    assert chat(server, [user(image)]).choices[0].message.content == oracle["image"]
    stream = chat(server, [user(image)], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == oracle["image"]
    # the replicas share the one detokenizer and each replica answers as HF does
    for rank in (0, 1):
        out = chat(server, [user(TEXT)], extra_body={"data_parallel_rank": rank})
        assert out.choices[0].message.content == oracle["text"]


def conversation(image_url: str, answers: list[str]) -> list[dict]:
    """The image and a question, then each answer and a follow-up question."""
    image = {"type": "image_url", "image_url": {"url": image_url}}
    messages = [user([image, {"type": "text", "text": QUESTION}])]
    for i, answer in enumerate(answers):
        messages += [{"role": "assistant", "content": answer}, user(f"And then, {i}?")]
    return messages


def test_a_resent_image_conversation_stays_on_its_replica(server: Server) -> None:
    """Three turns of one conversation, the image resent each time: every turn goes to the
    replica of the first (cache_aware) and the later turns report cached prompt tokens (the
    image's pad values included); the same last turn sent to the other replica by
    `data_parallel_rank` computes it again (far fewer cached tokens) and answers the same."""
    url = png_url(noise_image((84, 84), seed=11))
    before, answers, cached = routed(server), [], []
    for _ in range(3):
        out = chat(server, conversation(url, answers))
        answers.append(out.choices[0].message.content)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    moved = delta(before, routed(server))
    assert sorted(moved) == [0, 3], moved
    home = moved.index(3)
    assert cached[1] > 0 and cached[2] > cached[1]
    last = conversation(url, answers[:2])
    away = chat(server, last, extra_body={"data_parallel_rank": 1 - home})
    assert away.choices[0].message.content == answers[2]
    assert away.usage.prompt_tokens_details.cached_tokens < cached[2] // 2
    assert delta(before, routed(server))[1 - home] == 1


def test_a_session_keeps_to_one_replica(server: Server) -> None:
    """Different prompts of one session (the header, or the `user` field) go to one replica."""
    for key in ("header", "user"):
        before = routed(server)
        for i in range(3):
            kw: dict[str, Any] = {"extra_headers": {"X-Session-Id": "s-1"}}
            if key == "user":
                kw = {"user": "someone"}
            chat(server, [user(f"Question number {i} of {key}")], max_tokens=2, **kw)
        assert sorted(delta(before, routed(server))) == [0, 3], key


def test_data_parallel_rank_out_of_range_is_a_400_naming_it(server: Server) -> None:
    body = {"messages": [user("hi")], "max_tokens": 2, "data_parallel_rank": 2}
    for path in ("/v1/chat/completions", "/generate"):
        payload = body if path != "/generate" else {"text": "hi", "data_parallel_rank": 2}
        reply = httpx.post(server.url + path, json=payload, timeout=60)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "data_parallel_rank"
    payload = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "data_parallel_rank": 1}
    assert httpx.post(server.url + "/generate", json=payload, timeout=60).status_code == 200


def test_server_info_lists_each_replica_and_each_is_idle_clean(server: Server) -> None:
    """Each replica: up, its own rank process, its own KV pool all free or evictable when idle
    (no encoder pin, nothing in flight); the top level adds them up."""
    chat(server, [user([image_part(noise_image()), {"type": "text", "text": QUESTION}])])
    replicas = idle_replicas(server)
    top = info(server)
    assert top["dp_size"] == 2 and [r["replica"] for r in replicas] == [0, 1]
    pids = [r["pids"] for r in replicas]
    assert all(len(p) == 1 for p in pids) and pids[0] != pids[1]
    for r in replicas:
        assert r["up"] and r["load_tokens"] == 0 and r["encoder_cache_pins"] == 0
        assert r["kv_free"] + r["kv_evictable"] == r["kv_total"] == 6000
        assert r["pixels"]["requests_holding_pixels"] == 0
    assert top["kv_total"] == 12000
    assert top["kv_free"] + top["kv_evictable"] == top["kv_total"]
    log = server.log.read_text()
    assert all(f"started scheduler-DP{r}-TP0 (pid {pids[r][0]})" in log for r in (0, 1))
    metrics = metric_values(server)
    for r in replicas:
        assert metrics[f"tessera_kv_total_tokens[{r['replica']}]"] == 6000
        assert metrics[f"tessera_scheduler_finished_total[{r['replica']}]"] == r["finished"]


def test_two_replicas_of_two_ranks_with_the_dp_encoder(
    folder: str, oracle: dict[str, str], tmp_path: Path
) -> None:
    """--dp 2 --tp 2 --mm-enable-dp-encoder: four ranks, two groups of their own; an image chat
    on each replica answers as HF does, and each replica lists its two rank processes."""
    flags = ["--dp", "2", "--tp", "2", "--mm-enable-dp-encoder"]
    body = serve_then_check_teardown(OneRankServer(folder, tmp_path / "server.log", *flags))
    srv = next(body)
    try:
        image = [image_part(noise_image()), {"type": "text", "text": QUESTION}]
        for rank in (0, 1):
            out = chat(srv, [user(image)], extra_body={"data_parallel_rank": rank})
            assert out.choices[0].message.content == oracle["image"]
        replicas = idle_replicas(srv)
        assert [len(r["pids"]) for r in replicas] == [2, 2]
        assert [r["encoder_cache_misses"] for r in replicas] == [1, 1]
        assert all(r["kv_free"] + r["kv_evictable"] == r["kv_total"] for r in replicas)
    finally:
        next(body, None)


LONG_QUESTION = " ".join(f"Tell me what the number {i} means to a cat." for i in range(11))


def test_a_prefix_its_replica_evicted_is_not_chased(folder: str, tmp_path: Path) -> None:
    """Replicas of 1000 KV tokens. A long conversation's first turn goes to one replica; four
    long choices sent there need the room, so its radix cache evicts the conversation (the
    front end's own tree, bound by the pool, has room for both and would keep it). The replica
    reports the eviction, its prefix tree forgets the conversation, and the next turn is
    balanced to the other replica (the less loaded, the smaller tree) instead of going after a
    prefix that is gone, where it would be computed again anyway."""
    flags = ["--dp", "2", "--max-total-tokens", "1000"]
    body = serve_then_check_teardown(OneRankServer(folder, tmp_path / "server.log", *flags))
    srv = next(body)
    try:
        messages = [user(LONG_QUESTION)]
        before = routed(srv)
        first = chat(srv, messages)
        home = delta(before, routed(srv)).index(1)
        held = info(srv)["replicas"][home]["tree_tokens"]
        assert held >= first.usage.prompt_tokens > 250
        crowd = chat(
            srv, [user("Count.")], n=4, max_tokens=200,
            extra_body={"data_parallel_rank": home, "ignore_eos": True},
        )  # fmt: skip
        assert [c.finish_reason for c in crowd.choices] == ["length"] * 4
        trees = [r["tree_tokens"] for r in idle_replicas(srv)]
        assert trees[home] < first.usage.prompt_tokens, trees  # the conversation is gone
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        before = routed(srv)
        chat(srv, [*messages, user("And then?")])
        assert delta(before, routed(srv))[1 - home] == 1, "sent after the evicted prefix"
        replicas = idle_replicas(srv)
        assert all(r["kv_free"] + r["kv_evictable"] == r["kv_total"] for r in replicas)
    finally:
        next(body, None)
