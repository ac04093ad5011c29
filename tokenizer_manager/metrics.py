"""Prometheus metrics of the serving path, through prometheus_client.

Latency histograms (time to first token, inter-token latency, end to end, and each stage of a
request: receive, parse, template, tokenize, media, build, send, queue, encoder, prefill,
first_token, decode; the main process times its own, the scheduler measures queue, encoder and
prefill and sends them with the first token) are observed in the main process as
outputs arrive; the scheduler's gauges and counters
(KV pool, queue, caches) are read from each replica's entry rank's `ServerInfo` when `/metrics`
is scraped, and carry a `replica` label.
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
    """A collector that reports the last ServerInfo of each replica it was given (set just
    before a scrape): every gauge and counter carries a `replica` label."""

    def __init__(self) -> None:
        self.infos: list[Any] = []
        self.api: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        if self.infos:
            yield from _gauges(self.infos)
            counters = [vars(info.counters) for info in self.infos]
            yield from _counters("tessera_scheduler", "scheduler counter", counters)
            caches = [vars(info.encoder_cache) for info in self.infos]
            yield from _counters("tessera_encoder_cache", "encoder cache", caches)
        yield from _counters("tessera_api", "HTTP API counter", [self.api], label=False)


def _gauges(infos: list[Any]) -> Iterator[Metric]:
    names = {
        "kv_total_tokens": "kv_total",
        "kv_free_tokens": "kv_free",
        "kv_evictable_tokens": "kv_evictable",
        "kv_protected_tokens": "kv_protected",
        "running_requests": "running",
        "waiting_requests": "waiting",
    }
    for name, field_name in names.items():
        family = GaugeMetricFamily(f"tessera_{name}", name.replace("_", " "), labels=["replica"])
        for info in infos:
            family.add_metric([str(info.replica)], getattr(info, field_name))
        yield family


def _counters(
    prefix: str, doc: str, tables: list[dict[str, Any]], label: bool = True
) -> Iterator[Metric]:
    """One counter family per numeric field; with `label`, table i is replica i's."""
    for name, value in tables[0].items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        labels = ["replica"] if label else []
        family = CounterMetricFamily(f"{prefix}_{name}", f"{doc}: {name}", labels=labels)
        for replica, table in enumerate(tables):
            family.add_metric([str(replica)] if label else [], table[name])
        yield family


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

    def render(self, infos: list[Any], api: dict[str, int]) -> bytes:
        """The text of a scrape: `infos` are the replicas' ServerInfo, in replica order."""
        self.snapshot.infos, self.snapshot.api = infos, api
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
