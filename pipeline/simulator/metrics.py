"""The simulator's ``/metrics``: the vLLM series a router or autoscaler reads, under vLLM's names.

Each simulator has its own registry, so several can share a process (tests, benchmarks).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pipeline.simulator.engine import Engine, Sequence

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Wide enough for a slow CPU model and a fast simulated one.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self._running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                              labels, registry=r).labels(model_name)
        self._waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                              labels, registry=r).labels(model_name)
        self._kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                         labels, registry=r).labels(model_name)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of end to end request latency in seconds.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self._tpot = Histogram("vllm:time_per_output_token_seconds",
                               "Histogram of time per output token in seconds.",
                               labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels, registry=r).labels(model_name)
        self._prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                               labels, registry=r).labels(model_name)
        self._generated = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                  labels, registry=r).labels(model_name)
        # vLLM counts both in tokens: looked up in the prefix cache, and found there.
        self._prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                       "queried tokens.", labels, registry=r).labels(model_name)
        self._prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                    "tokens.", labels, registry=r).labels(model_name)
        self._exported = (0, 0)

    def finished(self, seq: Sequence) -> None:
        self._success.inc()
        self._prompt.inc(seq.prompt_tokens)
        self._generated.inc(seq.generated)
        if seq.first_token_at is not None:
            self._ttft.observe(seq.first_token_at - seq.arrived_at)
            if seq.generated > 1:
                self._tpot.observe((seq.finished_at - seq.first_token_at) / (seq.generated - 1))
        self._e2e.observe(seq.finished_at - seq.arrived_at)

    def render(self) -> bytes:
        # The gauges are the engine's state at the moment of the scrape, as vLLM logs them per step.
        self._running.set(self.engine.num_running)
        self._waiting.set(self.engine.num_waiting)
        self._kv.set(self.engine.kv_cache_usage)
        cache = self.engine.cache
        if cache is not None:
            queries, hits = self._exported
            self._prefix_queries.inc(cache.queries - queries)
            self._prefix_hits.inc(cache.hits - hits)
            self._exported = (cache.queries, cache.hits)
        return generate_latest(self.registry)
