"""tokenizer_manager/metrics.py: histograms and the scheduler snapshot in Prometheus text."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from runtime.io_struct import EncoderCacheStats, SchedulerCounters, ServerInfo, StageTimes
from tokenizer_manager.metrics import RequestTimeline, ServingMetrics


def info() -> ServerInfo:
    return ServerInfo(
        kv_total=100, kv_free=60, kv_evictable=40, kv_protected=0, running=1, waiting=2,
        counters=SchedulerCounters(prefill_steps=3, decode_steps=9),
        encoder_cache=EncoderCacheStats(hits=5, misses=2),
    )  # fmt: skip


def samples(text: bytes) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            key = s.name + "".join(f"[{v}]" for v in s.labels.values())
            out[key] = s.value
    return out


def test_one_request_timeline_and_scrape() -> None:
    metrics = ServingMetrics()
    timeline = RequestTimeline(metrics)
    timeline.stage("media", 0.02)
    time.sleep(0.01)
    timeline.output(1)
    time.sleep(0.01)
    timeline.output(2)  # two tokens in one output: two inter-token gaps
    timeline.output(0)  # a text-only flush adds nothing
    timeline.finish(prompt_tokens=30)
    got = samples(metrics.render([info()], {"requests": 4}))
    assert got["tessera_time_to_first_token_seconds_count"] == 1
    assert got["tessera_time_to_first_token_seconds_sum"] >= 0.01
    assert got["tessera_inter_token_latency_seconds_count"] == 2
    assert got["tessera_e2e_request_latency_seconds_count"] == 1
    assert got["tessera_request_stage_seconds_count[media]"] == 1
    assert got["tessera_request_stage_seconds_count[decode]"] == 1
    assert got["tessera_request_generation_tokens_sum"] == 3
    assert got["tessera_request_prompt_tokens_sum"] == 30
    assert got["tessera_kv_free_tokens[0]"] == 60 and got["tessera_waiting_requests[0]"] == 2
    assert got["tessera_scheduler_decode_steps_total[0]"] == 9
    assert got["tessera_encoder_cache_hits_total[0]"] == 5
    assert got["tessera_encoder_cache_misses_total[0]"] == 2
    assert got["tessera_api_requests_total"] == 4


def test_scheduler_stage_times_are_observed_once() -> None:
    metrics = ServingMetrics()
    timeline = RequestTimeline(metrics)
    timeline.scheduler_stages(StageTimes(queue=0.003, encoder=0.02, prefill=0.05))
    timeline.scheduler_stages(None)  # later outputs carry none
    got = samples(metrics.render([], {}))
    for stage, seconds in (("queue", 0.003), ("encoder", 0.02), ("prefill", 0.05)):
        assert got[f"tessera_request_stage_seconds_count[{stage}]"] == 1
        # one observation of a double, rendered as text and parsed back: rounding far below 1e-9
        assert abs(got[f"tessera_request_stage_seconds_sum[{stage}]"] - seconds) < 1e-9


def test_registries_are_per_server() -> None:
    a, b = ServingMetrics(), ServingMetrics()
    RequestTimeline(a).finish(prompt_tokens=1)
    assert samples(a.render([], {}))["tessera_e2e_request_latency_seconds_count"] == 1
    assert samples(b.render([], {}))["tessera_e2e_request_latency_seconds_count"] == 0


def test_scheduler_metrics_carry_each_replicas_label() -> None:
    """--dp: every gauge and scheduler counter once per replica, labelled with its index."""
    metrics = ServingMetrics()
    other = ServerInfo(
        kv_total=100, kv_free=100, kv_evictable=0, kv_protected=0, running=0, waiting=0,
        counters=SchedulerCounters(decode_steps=4), replica=1,
    )  # fmt: skip
    got = samples(metrics.render([info(), other], {}))
    assert got["tessera_kv_free_tokens[0]"] == 60 and got["tessera_kv_free_tokens[1]"] == 100
    assert got["tessera_scheduler_decode_steps_total[0]"] == 9
    assert got["tessera_scheduler_decode_steps_total[1]"] == 4


def test_replicas_server_infos_add_up_field_by_field() -> None:
    other = ServerInfo(
        kv_total=50, kv_free=50, kv_evictable=0, kv_protected=0, running=0, waiting=1,
        counters=SchedulerCounters(decode_steps=1), encoder_plans={"dp": 2}, replica=1,
    )  # fmt: skip
    total = ServerInfo.total([info(), other])
    assert (total.kv_total, total.kv_free, total.waiting) == (150, 110, 3)
    assert total.counters.decode_steps == 10 and total.encoder_cache.hits == 5
    assert total.encoder_plans == {"dp": 2} and ServerInfo.total([other]) is other
