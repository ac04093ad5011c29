"""scripts/bench_multiturn.py on a smoke setting: one server, 2 conversations of 2 turns; and
the pure parts of its --routing mode (setups, rows, targets) without a server."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import bench_multiturn
import numpy as np
import pytest

from runtime.cpus import rank_cpus
from runtime.tiny_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("multiturn")
    folder = make_checkpoint("qwen2_vl", tmp / "ck")
    return bench_multiturn.main([
        "--model-path", str(folder), "--server", "cache-on=--tp 1", "--conversations", "2",
        "--turns", "2", "--image-size", "112", "--max-tokens", "2", "--log-dir", str(tmp / "logs"),
    ])  # fmt: skip


def test_every_turn_is_measured_against_a_text_prefix_of_its_length(report: dict) -> None:
    turns = report["turns"]
    assert [(r["server"], r["turn"]) for r in turns] == [("cache-on", 1), ("cache-on", 2)]
    for r in turns:
        assert abs(r["text_prompt_tokens"] - r["prompt_tokens"]) <= 0.05 * r["prompt_tokens"]
        assert r["ttft_ms"] > 0 and r["text_ttft_ms"] > 0 and r["ids_vs_text"] > 0
    # 2 conversations x 2 images of 112x112: 64 patches of 1176 float32 each, sent once; the
    # resent images go to the ranks by key
    assert turns[0]["pixel_mb_to_ranks"] == pytest.approx(4 * 64 * 1176 * 4 / 1e6)
    assert turns[1]["pixel_mb_to_ranks"] == 0
    assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"]  # the history grows
    # what each side prefilled: the prompt less the prefix cache's share, from the usage
    assert 0 < turns[1]["new_tokens"] < turns[1]["prompt_tokens"]
    assert 0 < turns[1]["text_new_tokens"] < turns[1]["text_prompt_tokens"]


def test_no_two_text_conversations_share_a_prefix() -> None:
    """A round's text conversations, and the next round's, start differently: identical ones
    were served from one another's cache (1 new token a turn from the second round on, against
    31-41 for the image turns) and made the text baseline look faster than it is."""
    first = [c.messages[0]["content"] for c in bench_multiturn.text_conversations(10, 0, 4)]
    second = [c.messages[0]["content"] for c in bench_multiturn.text_conversations(10, 1000, 4)]
    starts = {text[: text.index(".") + 1] for text in first + second}
    assert len(starts) == 8
    assert all(len(text) == len(first[0]) for text in first)  # the same length within a round


def test_the_hash_comparison_is_reported(report: dict) -> None:
    speeds = report["hash"]
    assert speeds["sha256_gb_s"] > 0 and speeds["xxh3_128_gb_s"] > 0
    assert speeds["xxh3_vs_sha256"] == speeds["xxh3_128_gb_s"] / speeds["sha256_gb_s"]


def test_rounds_are_summarised_by_their_medians(report: dict) -> None:
    assert [r["round"] for r in report["rounds"]] == [0, 0]
    assert all(r["rounds"] == 1 and r["load_avg"] >= 0 for r in report["turns"])
    rows = [
        {"server": "on", "turn": 1, "round": i, "ttft_ms": t, "load_avg": 2.0 + i}
        for i, t in enumerate((30.0, 10.0, 20.0))
    ]
    assert bench_multiturn.medians(rows) == [
        {"server": "on", "turn": 1, "ttft_ms": 20.0, "load_avg": 3.0, "rounds": 3}
    ]


def test_each_turn_reports_where_its_time_went(report: dict) -> None:
    """The server's stages (from /metrics) and the client's upload, per request, for the image
    turn and the text-only one; the main process's stages fall inside its first token time."""
    for r in report["turns"]:
        for prefix in ("stage_", "text_stage_"):
            front = sum(r[f"{prefix}{s}_ms"] for s in ("receive", "parse", "template", "tokenize"))
            assert 0 < front <= r[f"{prefix}send_ms"] <= r[f"{prefix}first_token_ms"]
        assert r["stage_media_ms"] > 0 and r["upload_ms"] > 0 and r["text_upload_ms"] > 0
    assert "upload | receive | parse" in bench_multiturn.stage_table(report["turns"])


def test_stage_means_come_from_two_scrapes() -> None:
    metrics = (
        'tessera_request_stage_seconds_sum{stage="parse"} 0.5\n'
        'tessera_request_stage_seconds_count{stage="parse"} 4.0\n'
        'tessera_request_stage_seconds_sum{stage="send"} 1.0\n'
        'tessera_request_stage_seconds_count{stage="send"} 2.0\n'
    )
    before = bench_multiturn.stage_totals(metrics)
    after = before | {("parse", "sum"): 0.7, ("parse", "count"): 6.0}
    means = bench_multiturn.stage_ms(before, after, "x_")
    assert means["x_parse_ms"] == pytest.approx(100.0)  # 0.2 s over 2 requests
    assert math.isnan(means["x_send_ms"])  # no request in between


# ---------------------------------------------------------------- --routing (pure parts)


def test_the_routing_setups_are_the_reference_three_policies_and_the_router() -> None:
    setups = bench_multiturn.routing_setups(None)
    assert [s.name for s in setups] == [
        "dp1", "cache_aware", "round_robin", "shortest_queue", "router"
    ]  # fmt: skip
    flags = {s.name: " ".join(s.flags) for s in setups}
    assert flags["dp1"] == "--tp 1 --dp 1" and flags["router"] == "--tp 1 --dp 1"
    for policy in ("cache_aware", "round_robin", "shortest_queue"):
        assert flags[policy] == f"--tp 1 --dp 2 --dp-policy {policy}"
    router = setups[-1]
    assert (router.servers, router.router) == (2, "cache_aware")
    picked = bench_multiturn.routing_setups("router,dp1")
    assert [s.name for s in picked] == ["router", "dp1"]
    with pytest.raises(SystemExit, match="unknown"):
        bench_multiturn.routing_setups("dp1,random")


def test_the_router_setup_fronts_two_workers_with_its_policy(tmp_path: Path) -> None:
    argv = ["--routing", "--model-path", "/ck", "--log-dir", str(tmp_path)]
    args = bench_multiturn.parse_args(argv)
    setup = bench_multiturn.routing_setups("router")[0]
    workers = bench_multiturn.setup_servers(setup, args)
    assert [w.name for w in workers] == ["router-w0", "router-w1"]
    assert all(w.argv[-4:] == ["--dp", "1", "--device", "cpu"] for w in workers)
    (router,) = bench_multiturn.router_server(setup, workers, tmp_path)
    at = router.argv.index("--worker-urls")
    assert router.argv[at + 1 : at + 3] == [w.url for w in workers]
    assert router.argv[router.argv.index("--policy") + 1] == "cache_aware"
    alone = bench_multiturn.routing_setups("cache_aware")[0]
    assert [s.name for s in bench_multiturn.setup_servers(alone, args)] == ["cache_aware"]
    assert bench_multiturn.router_server(alone, workers, tmp_path) == []


def reply(ttft_ms: float, prompt: int, cached: int) -> bench_multiturn.Reply:
    return bench_multiturn.Reply(ttft_ms / 1e3, prompt, 0.0, cached)


def test_a_setups_row_from_its_replies_and_counters() -> None:
    convs = [reply(t, 100, 80) for t in (10.0, 20.0, 30.0, 40.0, 50.0)]
    singles = [reply(100.0, 50, 10), reply(300.0, 50, 10)]
    row = bench_multiturn.routing_row("x", convs, singles, 3.5, [3, 4])
    assert row["requests"] == 7 and row["requests_per_s"] == pytest.approx(2.0)
    assert row["cached_share"] == pytest.approx(420 / 600)
    assert row["conv_cached_share"] == pytest.approx(0.8)
    assert row["conv_ttft_p50_ms"] == pytest.approx(30.0)
    assert row["conv_ttft_p99_ms"] == pytest.approx(49.6)  # between the two largest
    assert row["single_ttft_p50_ms"] == pytest.approx(200.0)
    assert row["load_ratio"] == pytest.approx(4 / 3)
    assert bench_multiturn.routing_row("y", convs, [], 1.0, [7, 0])["load_ratio"] == math.inf
    assert math.isnan(bench_multiturn.routing_row("z", convs, [], 1.0, [5])["single_ttft_p50_ms"])


def test_the_targets_are_ratios_to_the_reference_and_the_router() -> None:
    rows = [
        {"setup": "dp1", "cached_share": 0.8, "conv_ttft_p50_ms": 10.0},
        {"setup": "round_robin", "cached_share": 0.4, "conv_ttft_p50_ms": 30.0},
        {"setup": "router", "cached_share": 0.6, "conv_ttft_p50_ms": 20.0},
    ]
    out = bench_multiturn.against_targets(rows)
    assert [r["cached_vs_dp1"] for r in out] == pytest.approx([1.0, 0.5, 0.75])
    assert [r["conv_p50_vs_router"] for r in out] == pytest.approx([0.5, 1.5, 1.0])
    alone = bench_multiturn.against_targets(rows[1:2])[0]
    assert math.isnan(alone["cached_vs_dp1"]) and math.isnan(alone["conv_p50_vs_router"])


def test_replica_counts_come_from_server_info() -> None:
    info = {"replicas": [{"replica": 0, "routed": 5}, {"replica": 1, "routed": 2}]}
    assert bench_multiturn.replica_counts(info) == [5, 2]
    assert bench_multiturn.replica_counts({}) == []


def test_conversations_resend_their_images_and_single_turns_bring_new_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every turn of a conversation carries its first turn's two image URLs; the single-turn
    chats share none."""
    sent: list[list[str]] = []

    async def fake_turn(api: object, conv: bench_multiturn.Conversation) -> bench_multiturn.Reply:
        urls = [
            part["image_url"]["url"]
            for message in conv.messages if isinstance(message["content"], list)
            for part in message["content"] if part["type"] == "image_url"
        ]  # fmt: skip
        sent.append(urls)
        conv.messages.append({"role": "assistant", "content": "ok"})
        return reply(1.0, 10, 0)

    monkeypatch.setattr(bench_multiturn, "turn", fake_turn)
    rng = np.random.default_rng(0)
    conv = bench_multiturn.image_conversation(rng, 16)
    replies = asyncio.run(bench_multiturn.converse(None, conv, 3))
    assert len(replies) == 3 and len(sent) == 3
    assert all(urls == sent[0] for urls in sent) and len(set(sent[0])) == 2
    assert [m["role"] for m in conv.messages] == ["user", "assistant"] * 3
    sent.clear()
    asyncio.run(bench_multiturn.single_turns(None, rng, 16, 4))
    assert len(sent) == 4 and len({url for urls in sent for url in urls}) == 8


def test_routing_rounds_are_summarised_per_setup() -> None:
    rows = [
        {"setup": "a", "round": 0, "cached_share": 0.5, "routed": [3, 1], "load_ratio": 3.0},
        {"setup": "b", "round": 0, "cached_share": 0.2, "routed": [4], "load_ratio": 1.0},
        {"setup": "a", "round": 1, "cached_share": 0.7, "routed": [1, 3], "load_ratio": 3.0},
    ]
    a, b = bench_multiturn.routing_medians(rows)
    assert a == {"setup": "a", "cached_share": pytest.approx(0.6), "routed": [4, 4],
                 "load_ratio": 1.0, "rounds": 2}  # fmt: skip
    assert (b["setup"], b["routed"], b["rounds"]) == ("b", [4], 1)


def test_the_pinned_router_setup_splits_the_cpus_between_its_workers(tmp_path: Path) -> None:
    """`router_pinned` (only when named): each worker on its own half of the CPUs, as `--dp 2`
    shares them out; the plain router's workers take whatever they find."""
    argv = ["--routing", "--model-path", "/ck", "--log-dir", str(tmp_path)]
    args = bench_multiturn.parse_args(argv)
    assert "router_pinned" not in [s.name for s in bench_multiturn.routing_setups(None)]
    (pinned,) = bench_multiturn.routing_setups("router_pinned")
    workers = bench_multiturn.setup_servers(pinned, args)
    cpus = [w.cpus for w in workers]
    assert cpus == [rank_cpus(0, 2), rank_cpus(1, 2)] and pinned.router == "cache_aware"
    plain = bench_multiturn.setup_servers(bench_multiturn.routing_setups("router")[0], args)
    assert [w.cpus for w in plain] == [None, None]
