"""The OpenAI backend's choice of server for a call: prefix affinity (:mod:`affinity`) over the
routing table's servers, with the pacing gate's slots and loads, and what the answers and the
servers' metrics teach the index.

Without affinity (``AffinityConfig(enabled=False)``) the choice is the one the backend always
made: of the model's servers that are up, one with a free slot and the fewest calls in flight.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Collection, Mapping
from urllib.parse import urlsplit

from pipeline.models import Request
from pipeline.observability.metrics import RoutingSeries, routing_series
from pipeline.worker.backends.affinity import AffinityConfig, Choice, PrefixAffinity, PromptKey, prompt_key
from pipeline.worker.backends.pacing import PacingGate, ServerLoad, Slot
from pipeline.worker.backends.routing import RoutingTable, Server

#: The server's own hit ratio is published over windows of at least this many queried tokens.
_HIT_WINDOW_TOKENS = 4096
#: Prompt keys kept for requests asked about again (put back to wait, then reserved, then called).
_KEYS_KEPT = 8192


def server_label(server: Server) -> str:
    """A server's name in metrics: its URL without credentials, query or fragment."""
    parts = urlsplit(server.base_url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"


class CacheRouter:
    def __init__(self, routes: RoutingTable, gate: PacingGate, config: AffinityConfig | None = None,
                 metrics: RoutingSeries | None = None):
        self.routes = routes
        self.gate = gate
        self.config = config or AffinityConfig()
        self.affinity = PrefixAffinity(self.config, name=lambda s: s.base_url)
        self.metrics = metrics or routing_series()
        self._labels: dict[Server, str] = {}
        self._hits: dict[Server, tuple[float, float]] = {}  # the hit-ratio window's start
        self._contradictions: dict[Server, int] = {}
        self._keys: OrderedDict[str, PromptKey] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def label(self, server: Server) -> str:
        label = self._labels.get(server)
        if label is None:
            label = self._labels[server] = server_label(server)
        return label

    def key(self, request: Request) -> PromptKey | None:
        """The request's prompt key, made once per request (a waiting request is asked about
        again at every free slot)."""
        if not self.config.enabled:
            return None
        keys, rid = self._keys, request.request_id
        key = keys.get(rid) if rid else None
        if key is None:
            key = prompt_key(request, self.config)
            if rid:
                keys[rid] = key
                if len(keys) > _KEYS_KEPT:
                    keys.popitem(last=False)
        return key

    def done(self, request: Request) -> None:
        self._keys.pop(request.request_id, None)

    # -- choosing --------------------------------------------------------------------------
    def choose(self, request: Request, key: PromptKey | None, exclude: Collection[Server] = (),
               wait: bool = True) -> Choice | None:
        """The server for ``request``'s next call; ``Choice(None, "deferred")`` while it waits for
        the busy server holding its prefix, None when every server is excluded."""
        routes, gate = self.routes, self.gate
        servers = routes.servers_for(request.model)
        pool = [s for s in servers if s not in exclude]
        if not pool:
            return None
        up = [s for s in pool if routes.is_up(s)]
        if not up:
            # Every one cooling down: the one back soonest (the cool-down is a guess).
            return Choice(min(pool, key=lambda s: s.down_until), "least_loaded")
        if key is None:
            best = min(up, key=lambda s: (gate.available(s) <= 0, gate.in_flight(s)))
            return Choice(best, "least_loaded")
        return self.affinity.choose(key, up, gate.load, gate.available, time.monotonic(),
                                    request.request_id if wait else "")

    def reserve(self, request: Request) -> Slot | None:
        """A slot for ``request`` on the server chosen for it now, or None (no room, or it waits
        for the server holding its prefix)."""
        if self.config.enabled and request.request_id:
            # Still waiting for a server that has no slot yet: the answer has not changed.
            waited = self.affinity.waiting_for(request.request_id, time.monotonic())
            if waited is not None and self.gate.available(waited) <= 0 and self.routes.is_up(waited):
                return None
        key = self.key(request)
        if key is None:
            servers = [s for s in self.routes.servers_for(request.model) if self.routes.is_up(s)]
            gate, best = self.gate, None
            for server in servers:
                if gate.available(server) > 0 and (best is None or gate.in_flight(server) < gate.in_flight(best)):
                    best = server
            choice = Choice(best, "least_loaded") if best is not None else None
        else:
            choice = self.choose(request, key)
        if choice is None or choice.server is None:
            if choice is not None and choice.reason == "deferred":
                waited = self.affinity.waiting_for(request.request_id, time.monotonic())
                if waited is not None:
                    self.metrics.deferred.labels(self.label(waited)).inc()
            return None
        slot = self.gate.try_acquire(choice.server)
        if slot is not None:
            self.sent(slot, key, choice)
        return slot

    def sent(self, slot: Slot, key: PromptKey | None, choice: Choice) -> None:
        """The call holding ``slot`` goes to its server now: the index records its prompt there."""
        slot.key, slot.choice = key, choice
        if key is not None:
            self.affinity.record(slot.server, key, time.monotonic())
        self.metrics.routes.labels(self.label(slot.server), choice.reason).inc()

    # -- learning ----------------------------------------------------------------------------
    def answered(self, slot: Slot, usage: Mapping[str, Any] | None) -> None:
        """What the server said of the call's prompt: its prompt and cached token counts."""
        if not usage:
            return
        try:
            prompt = int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
            cached = int(cached) if cached is not None else None
        except (TypeError, ValueError, AttributeError):
            return
        label = self.label(slot.server)
        if prompt > 0:
            self.metrics.prompt_tokens.labels(label).inc(prompt)
        if cached is None:
            return
        self.metrics.cached_prompt_tokens.labels(label).inc(cached)
        self.metrics.cached_tokens.labels().observe(cached)
        key, choice = slot.key, slot.choice
        if isinstance(key, PromptKey) and isinstance(choice, Choice):
            if self.affinity.correct(slot.server, key, choice, cached, prompt):
                self.metrics.index_corrections.labels(label).inc()

    def observed(self, server: Server, load: ServerLoad | None) -> None:
        """A metrics sample of ``server`` (after the pacer took it)."""
        pacer = self.gate.pacer(server)
        seen = self._contradictions.get(server, 0)
        if pacer.kv_contradictions > seen:
            self.metrics.kv_contradictions.labels(self.label(server)).inc(pacer.kv_contradictions - seen)
            self._contradictions[server] = pacer.kv_contradictions
        if load is None or load.prefix_hits is None or load.prefix_queries is None:
            return
        start = self._hits.get(server)
        if start is None or load.prefix_queries < start[1]:  # the first sample, or the server restarted
            if start is not None:
                self.affinity.forget(server)  # its cache went with it
            self._hits[server] = (load.prefix_hits, load.prefix_queries)
            return
        queried = load.prefix_queries - start[1]
        if queried >= _HIT_WINDOW_TOKENS:
            self.metrics.server_hit_ratio.labels(self.label(server)).set(
                round((load.prefix_hits - start[0]) / queried, 4))
            self._hits[server] = (load.prefix_hits, load.prefix_queries)
