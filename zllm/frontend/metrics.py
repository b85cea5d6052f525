"""Prometheus metrics of the serving frontend: vLLM's metric names under the `zllm:` prefix.

Two sources:
- request figures (prompt / generation tokens, time to first token, inter-token latency,
  end-to-end latency, finished requests by reason) are measured here, in the frontend, as each
  request's outputs leave for its client — the ZMQ clients and the HTTP API alike;
- engine figures (requests running / waiting, KV cache usage, preemptions, prefix-cache queries
  and hits) are the engine core's own counters, read with the `stats` utility call just before
  each scrape (`update_engine_stats`), one series per data-parallel engine (label `dp_rank`).

Each instance has its own registry, so several servers (or tests) in one process never clash.
Behind several API servers (vllm-launch --api-server-count, which sets $PROMETHEUS_MULTIPROC_DIR
for them), prometheus_client's multiprocess mode keeps the request figures in files that every
API server's /metrics adds up; the engine figures are those of the answering server's engines.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode, when set
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds), so dashboards built for it read ours the same way.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass(slots=True)
class _Timing:
    arrival: float
    num_prompt_tokens: int
    last_token: float | None = None
    num_generated: int = 0


class FrontendMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._live: dict[str, _Timing] = {}
        self._engine = _EngineStats(model_name)
        self.registry.register(self._engine)
        labels, model = ["model_name"], [model_name]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(*model)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(*model)

        self.prompt_tokens = counter("zllm:prompt_tokens", "Prompt tokens received.")
        self.generation_tokens = counter("zllm:generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram(
            "zllm:time_to_first_token_seconds", "From arrival at the frontend to the first token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "zllm:inter_token_latency_seconds", "Time between consecutive generated tokens.", _ITL_BUCKETS
        )
        self.e2e_latency = histogram(
            "zllm:e2e_request_latency_seconds", "From arrival to the last token of finished requests.", _E2E_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "zllm:request_prompt_tokens", "Prompt length of finished requests.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "zllm:request_generation_tokens", "Generated length of finished requests.", _TOKEN_BUCKETS
        )
        self._success = Counter(
            "zllm:request_success",
            "Requests ended, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name

    # ---- request events (called by the frontend server) ----------------------------------------

    def request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        self._live[request_id] = _Timing(time.monotonic(), num_prompt_tokens)
        self.prompt_tokens.inc(num_prompt_tokens)

    def tokens_generated(self, request_id: str, num_tokens: int, finish_reason: str | None) -> None:
        timing = self._live.get(request_id)
        if timing is None:
            return
        now = time.monotonic()
        if num_tokens:
            self._observe_latencies(timing, num_tokens, now)
        if finish_reason is not None:
            self._finish(request_id, timing, finish_reason, now)

    def request_ended(self, request_id: str) -> None:
        """The request left without finishing normally (aborted, failed, client gone)."""
        timing = self._live.get(request_id)
        if timing is not None:
            self._finish(request_id, timing, "abort", time.monotonic())

    def _observe_latencies(self, timing: _Timing, num_tokens: int, now: float) -> None:
        self.generation_tokens.inc(num_tokens)
        if timing.last_token is None:
            self.time_to_first_token.observe(now - timing.arrival)
        else:
            # NOTE: tokens that arrive together share the interval since the previous delivery.
            for _ in range(num_tokens):
                self.inter_token_latency.observe((now - timing.last_token) / num_tokens)
        timing.last_token = now
        timing.num_generated += num_tokens

    def _finish(self, request_id: str, timing: _Timing, reason: str, now: float) -> None:
        del self._live[request_id]
        self._success.labels(self._model_name, reason).inc()
        if reason != "abort":
            self.e2e_latency.observe(now - timing.arrival)
            self.request_prompt_tokens.observe(timing.num_prompt_tokens)
            self.request_generation_tokens.observe(timing.num_generated)

    # ---- engine figures and export ----------------------------------------------------------------

    def update_engine_stats(self, stats: dict[str, Any] | None) -> None:
        """The engine core's latest `stats` result (None: unavailable, its metrics are left out)."""
        self._engine.stats = stats

    def export(self) -> bytes:
        if not os.environ.get(MULTIPROCESS_DIR_ENV):
            return generate_latest(self.registry)
        # Several API servers: the request figures of all of them, from their files, and this
        # server's engines' figures.
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(self._engine)
        return generate_latest(registry)


class _EngineStats:
    """A collector that exposes the engine core's stats snapshot as gauges and counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] | None = None

    def describe(self) -> list[Metric]:
        return []  # the series depend on the snapshot; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        """One series per data-parallel engine, labelled with its dp_rank."""
        stats = self.stats
        if not stats:
            return
        engines = stats.get("engines") or [{"dp_rank": 0, **stats}]
        gauges = [
            ("zllm:num_requests_running", "Requests in the engine's running batch.", "num_running"),
            ("zllm:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            ("zllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", "kv_cache_usage"),
        ]
        counters = [
            ("zllm:num_preemptions", "Requests preempted by the engine.", "num_preemptions"),
            ("zllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
            ("zllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
            ("zllm:encoder_cache_queries", "Images scheduled requests needed encoded.", "encoder_cache_queries"),
            ("zllm:encoder_cache_hits", "Images found in the workers' encoder cache.", "encoder_cache_hits"),
            ("zllm:spec_decode_num_drafts", "Requests whose drafts a step scored.", "spec_decode_num_drafts"),
            ("zllm:spec_decode_num_draft_tokens", "Draft tokens scored.", "spec_decode_num_draft_tokens"),
            ("zllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens"),
        ]
        for family_type, metrics in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, key in metrics:
                family = family_type(name, doc, labels=["model_name", "dp_rank"])
                for engine in engines:
                    if engine.get(key) is not None:
                        family.add_metric([self.model_name, str(engine["dp_rank"])], float(engine[key]))
                if family.samples:
                    yield family
        yield from _accepted_per_position(self.model_name, engines)


def _accepted_per_position(model_name: str, engines: list[dict]) -> Iterator[Metric]:
    """vLLM's spec_decode_num_accepted_tokens_per_pos: a counter per draft position."""
    family = CounterMetricFamily(
        "zllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each draft position.",
        labels=["model_name", "dp_rank", "position"],
    )
    for engine in engines:
        for position, count in enumerate(engine.get("spec_decode_num_accepted_tokens_per_pos") or []):
            family.add_metric([model_name, str(engine["dp_rank"]), str(position)], float(count))
    if family.samples:
        yield family
