"""Prometheus metrics of the serving path, through prometheus_client.

Latency histograms (time to first token, inter-token latency, end to end, and each stage of a
request: receive, parse, template, tokenize, media, build, send, queue, encoder, prefill,
first_token, decode; the main process times its own, the scheduler measures queue, encoder and
prefill and sends them with the first token) are observed in the main process as
outputs arrive; the scheduler's gauges and counters
(KV pool, queue, caches) are read from the entry rank's `ServerInfo` when `/metrics` is scraped.
Each server owns one registry, so tests can run several servers in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from runtime.io_struct import StageTimes

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SchedulerSnapshot:
    """A collector that reports the last ServerInfo it was given (set just before a scrape)."""

    def __init__(self) -> None:
        self.info: Any = None
        self.api: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        info = self.info
        if info is not None:
            yield from _gauges(info)
            yield from _counters("tessera_scheduler", "scheduler counter", vars(info.counters))
            cache = vars(info.encoder_cache)
            yield from _counters("tessera_encoder_cache", "encoder cache", cache)
        yield from _counters("tessera_api", "HTTP API counter", self.api)


def _gauges(info: Any) -> Iterator[Metric]:
    values = {
        "kv_total_tokens": info.kv_total,
        "kv_free_tokens": info.kv_free,
        "kv_evictable_tokens": info.kv_evictable,
        "kv_protected_tokens": info.kv_protected,
        "running_requests": info.running,
        "waiting_requests": info.waiting,
    }
    for name, value in values.items():
        yield GaugeMetricFamily(f"tessera_{name}", name.replace("_", " "), value=value)


def _counters(prefix: str, doc: str, table: dict[str, Any]) -> Iterator[Metric]:
    for name, value in table.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield CounterMetricFamily(f"{prefix}_{name}", f"{doc}: {name}", value=value)


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.snapshot = SchedulerSnapshot()
        self.registry.register(self.snapshot)
        self.ttft = self._latency("time_to_first_token", "arrival to the first output token")
        self.itl = self._latency("inter_token_latency", "gap between output tokens")
        self.e2e = self._latency("e2e_request_latency", "arrival to the last output")
        self.stage = Histogram(
            "tessera_request_stage_seconds",
            "time a request spends in each stage",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = self._tokens("prompt_tokens", "prompt length")
        self.output_tokens = self._tokens("generation_tokens", "output length")

    def _latency(self, name: str, doc: str) -> Histogram:
        return Histogram(
            f"tessera_{name}_seconds", doc, buckets=LATENCY_BUCKETS, registry=self.registry
        )

    def _tokens(self, name: str, doc: str) -> Histogram:
        return Histogram(
            f"tessera_request_{name}", doc, buckets=TOKEN_BUCKETS, registry=self.registry
        )

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Observe the seconds the `with` block takes (awaits included) as `stage`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage.labels(stage).observe(time.perf_counter() - start)

    def render(self, info: Any, api: dict[str, int]) -> bytes:
        self.snapshot.info, self.snapshot.api = info, api
        return generate_latest(self.registry)


@dataclass
class RequestTimeline:
    """One request's clock, observed into the histograms as its outputs arrive."""

    metrics: ServingMetrics
    arrival: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def stage(self, name: str, seconds: float) -> None:
        self.metrics.stage.labels(name).observe(seconds)

    def scheduler_stages(self, stages: StageTimes | None) -> None:
        """The scheduler's queue, encoder and prefill seconds (they come with the first token)."""
        if stages is not None:
            for name, seconds in dataclasses.asdict(stages).items():
                self.stage(name, seconds)

    def output(self, new_tokens: int) -> None:
        """An output with `new_tokens` more tokens arrived now."""
        now = time.perf_counter()
        if new_tokens <= 0:
            return
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
            self.stage("first_token", now - self.arrival)
        else:
            gap = (now - self.last) / new_tokens
            for _ in range(new_tokens):
                self.metrics.itl.observe(gap)
        self.last, self.tokens = now, self.tokens + new_tokens

    def finish(self, prompt_tokens: int) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        if self.first is not None:
            self.stage("decode", self.last - self.first)
        self.metrics.prompt_tokens.observe(prompt_tokens)
        self.metrics.output_tokens.observe(self.tokens)
