"""Prometheus metrics, one registry per app, named like vLLM's but prefixed `tokenmill:`.

Engine state (running/waiting requests, KV usage, prefix-cache and preemption
counters) is read at scrape time from the snapshot the engine loop publishes after
each step; per-request token counts and latencies are recorded by the server when a
request finishes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.outputs import RequestOutput

PREFIX = "tokenmill:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_THINKING_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, async_engine: AsyncLLMEngine, model_name: str) -> None:
        self.async_engine = async_engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self.async_engine.snapshot
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("num_requests_running", "Sequences running in the engine.", snap.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.",
                    snap.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                    snap.kv_cache_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      snap.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      snap.prefix_cache_hits)
        yield counter("num_preemptions", "Sequences preempted for lack of KV blocks.",
                      snap.num_preemptions)
        yield counter("num_aborted_requests", "Requests aborted (client gone, shutdown).",
                      snap.num_aborted_requests)
        yield counter("spec_decode_num_draft_tokens", "Speculative tokens verified.",
                      snap.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
                      snap.spec_accepted_tokens)
        yield counter("spec_decode_num_verifications",
                      "Verification passes (one per speculating request per step).",
                      snap.spec_verifications)
        by_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted at each draft position (0 = first).",
            labels=[*labels, "position"])
        for position, accepted in enumerate(snap.spec_accepted_by_position):
            by_position.add_metric([*values, str(position)], accepted)
        yield by_position
        if snap.sparse_attention_by_layer:
            keys = CounterMetricFamily(
                PREFIX + "sparse_attention_keys",
                "Keys sparse attention attended, per sparse layer and head kind.",
                labels=[*labels, "layer", "head_kind"])
            queries = CounterMetricFamily(
                PREFIX + "sparse_attention_queries",
                "Decode (query, KV head) pairs sparse attention served, per sparse layer "
                "and head kind.", labels=[*labels, "layer", "head_kind"])
            for layer, kind, kind_keys, kind_queries in snap.sparse_attention_by_layer:
                keys.add_metric([*values, str(layer), kind], kind_keys)
                queries.add_metric([*values, str(layer), kind], kind_queries)
            yield keys
            yield queries
        if snap.expert_tokens:
            yield from self._expert_metrics(snap, labels, values)

    def _expert_metrics(self, snap, labels: list[str], values: list[str]) -> Iterator[Metric]:
        tokens = CounterMetricFamily(PREFIX + "moe_expert_tokens",
                                     "Tokens routed to each expert of each MoE layer.",
                                     labels=[*labels, "layer", "expert"])
        for layer, counts in enumerate(snap.expert_tokens):
            for expert, count in enumerate(counts):
                tokens.add_metric([*values, str(layer), str(expert)], count)
        yield tokens
        yield _per_layer_gauge(
            "moe_load_imbalance", "Busiest expert's tokens over the mean expert's, per MoE "
            "layer, over the engine's window (--expert-stats-window-s; 1 = balanced).",
            snap.expert_imbalance, labels, values)
        if snap.rank_imbalance:
            yield _per_layer_gauge(
                "moe_rank_imbalance", "With replicated experts: the busiest rank's (token, "
                "expert) pairs over the mean rank's, per MoE layer, over the same window "
                "(1 = balanced).", snap.rank_imbalance, labels, values)


def _per_layer_gauge(name: str, documentation: str, per_layer, labels: list[str],
                     values: list[str]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(PREFIX + name, documentation, labels=[*labels, "layer"])
    for layer, value in enumerate(per_layer):
        gauge.add_metric([*values, str(layer)], value)
    return gauge


class ServerMetrics:
    def __init__(self, async_engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(async_engine, model_name))
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens",
                                         "Generated tokens of finished requests.")
        self.request_success = counter("request_success", "Finished requests by finish reason.",
                                       ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first.", _TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.reasoning_tokens = counter(
            "reasoning_tokens", "Generated tokens inside a reasoning model's thinking markers.")
        self.request_thinking_tokens = histogram(
            "request_thinking_tokens", "Thinking tokens per finished request (reasoning models).",
            _THINKING_BUCKETS)
        self.model_name = model_name

    def record_finished(self, output: RequestOutput) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        for choice in output.outputs:
            self.generation_tokens.labels(name).inc(len(choice.token_ids))
            self.request_success.labels(name, choice.finish_reason or "unknown").inc()
            metrics = choice.metrics
            if metrics is None:
                continue
            if choice.reasoning_content is not None or metrics.num_thinking_tokens:
                self.reasoning_tokens.labels(name).inc(metrics.num_thinking_tokens)
                self.request_thinking_tokens.labels(name).observe(metrics.num_thinking_tokens)
            for histogram, value in ((self.ttft, metrics.time_to_first_token),
                                     (self.tpot, metrics.time_per_output_token),
                                     (self.e2e, metrics.e2e_latency),
                                     (self.queue_time, metrics.queue_time)):
                if value is not None:
                    histogram.labels(name).observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
