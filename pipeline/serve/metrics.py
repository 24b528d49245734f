"""What ``llmq serve`` exports on ``GET /metrics``: its HTTP requests by route and status, their
latency, the requests waiting for their answers and the event streams open; the Responses API's
responses ended by status and tier, background responses waiting, streams replayed.

Routes are labelled by their pattern (``/v1/batches/{batch_id}``), never by the path a caller
sent, so that the series stay few whatever callers ask for; a path no route matches is
``unmatched``.
"""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

#: Answers wait for a model: seconds, up to the longest deadline serve accepts.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ServeMetrics:
    def __init__(self, server, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("llmq_serve_requests", "HTTP requests answered by llmq serve, by route and status",
                                ["route", "method", "code"], registry=self.registry)
        self.latency = Histogram("llmq_serve_request_seconds",
                                 "Time from an HTTP request's arrival to the end of its answer (a stream's "
                                 "last event), by route", ["route"], buckets=_BUCKETS, registry=self.registry)
        inflight = Gauge("llmq_serve_inflight", "Requests written to Kafka and waiting for their answers",
                         registry=self.registry)
        inflight.set_function(lambda: server.inflight)
        streams = Gauge("llmq_serve_open_streams", "Server-sent event streams open to callers",
                        registry=self.registry)
        streams.set_function(lambda: len(server.streams))
        self.responses = Counter("llmq_serve_responses", "Responses API responses ended, by status and the "
                                 "service tier that served them", ["status", "tier"], registry=self.registry)
        self.stream_resumes = Counter("llmq_serve_response_stream_resumes", "Response streams resumed from the "
                                      "chunks topic (GET /v1/responses/{id}?stream=true&starting_after=N)",
                                      registry=self.registry)
        self._pending = lambda: 0
        waiting = Gauge("llmq_serve_responses_background_waiting", "Background responses stored and not ended yet, "
                        "all serve processes' (the stored-responses topic)", registry=self.registry)
        waiting.set_function(lambda: self._pending())

    def count_pending(self, pending) -> None:
        """``pending()``: how many background responses wait (the Responses API's store)."""
        self._pending = pending

    @web.middleware
    async def middleware(self, http: web.Request, handler):
        started = time.perf_counter()
        status = 500
        try:
            response = await handler(http)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            info = http.match_info
            route = info.route.resource.canonical if info.route.resource is not None else "unmatched"
            if route != "/metrics":
                self.requests.labels(route, http.method, str(status)).inc()
                self.latency.labels(route).observe(time.perf_counter() - started)

    async def view(self, http: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
