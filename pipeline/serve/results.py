"""The requests accepted by ``POST /v1/requests``, kept for ``GET /v1/requests/{id}``.

Each entry holds its tenant, its kind (chat or completion) and the future the client's reply
listener resolves with the terminal response; while it waits, the latest QUEUED event (position,
ETA) comes from the client. Entries live ``serve.result_ttl_s`` after they were accepted, at most
``serve.result_max`` of them (the oldest go first); a forgotten entry's waiter is dropped from
the client too.

The answer reaches only the process whose reply partition the request named, so a poll must
come to the process that accepted the request (its reply partitions are fixed per process:
route ``/v1/requests/{id}`` by the ``x-llmq-reply-partition`` the 202 answer carries, or keep
clients on one process). A restarted process has forgotten what it accepted before.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from pipeline.models import Response


@dataclass
class Accepted:
    request_id: str
    tenant: str
    kind: str
    model: str
    priority: str
    created: float
    future: Future

    def response(self) -> Response | None:
        fut = self.future
        if not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        return fut.result()

    def error(self) -> BaseException | None:
        fut = self.future
        return fut.exception() if fut.done() and not fut.cancelled() else None


class ResultStore:
    def __init__(self, ttl_s: float, max_entries: int, forget: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._forget = forget
        self._clock = clock
        self._entries: OrderedDict[str, Accepted] = OrderedDict()

    def add(self, request_id: str, tenant: str, kind: str, model: str, priority: str, future: Future) -> Accepted:
        self.expire()
        entry = self._entries[request_id] = Accepted(request_id, tenant, kind, model, priority, self._clock(),
                                                      future)
        while len(self._entries) > self.max_entries:
            old, _ = self._entries.popitem(last=False)
            self._forget(old)
        return entry

    def get(self, request_id: str, tenant: str) -> Accepted | None:
        """The entry, if ``tenant`` submitted it (another tenant's id is as unknown as a wrong one)."""
        self.expire()
        entry = self._entries.get(request_id)
        return entry if entry is not None and entry.tenant == tenant else None

    def expire(self) -> None:
        horizon = self._clock() - self.ttl_s
        entries = self._entries
        while entries:
            request_id, entry = next(iter(entries.items()))
            if entry.created > horizon:
                break
            entries.popitem(last=False)
            self._forget(request_id)

    def __len__(self) -> int:
        return len(self._entries)
