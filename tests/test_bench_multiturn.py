"""scripts/bench_multiturn.py on a smoke setting: one server, 2 conversations of 2 turns."""

from __future__ import annotations

import math

import bench_multiturn
import pytest

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
