"""Whether the worker's consumer has gone without its group coordinator for too long.

Seen in `make chaos` on a three-node cluster: after the whole cluster restarted and then a node
was killed, both workers' consumers (librdkafka, consumer group protocol) kept a request for the
group coordinator queued and never sent ("GroupCoordinator: Timed out 0 in-flight, 1 out-queue"
every minute, commits failing "Waiting for coordinator") while every broker was up again. They
fetched nothing for minutes; a new consumer in a new process carried on at once.

So the worker reads librdkafka's statistics of its consumer (``statistics.interval.ms``; the
``GroupCoordinator`` connection and the ``cgrp`` state) and, once the coordinator connection or
the group has not been up for ``worker.coordinator_stall_ms``, starts a new session: a new
consumer and producer, from the committed offsets, as after an aborted transaction. Pure: it
only parses the statistics it is handed.
"""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger(__name__)

#: The logical broker librdkafka keeps for the group coordinator (its name in the statistics).
COORDINATOR = "GroupCoordinator"


class CoordinatorWatch:
    def __init__(self, stall_s: float, clock=time.monotonic):
        self.stall_s = stall_s
        self.clock = clock
        self._down_since: float | None = None
        self.what = ""

    def interval_ms(self) -> int:
        """How often librdkafka should hand over its statistics: a few times per stall period."""
        return max(1000, min(10_000, int(self.stall_s * 1000 / 4)))

    def observe(self, stats_json: str) -> None:
        """``stats_cb``: called by librdkafka (inside poll) with its statistics as JSON."""
        try:
            stats = json.loads(stats_json)
        except ValueError:
            return
        cgrp = stats.get("cgrp") or {}
        coordinator = (stats.get("brokers") or {}).get(COORDINATOR) or {}
        problems = []
        if cgrp and cgrp.get("state") != "up":
            problems.append(f"group {cgrp.get('state')}")
        if coordinator and coordinator.get("state") != "UP":
            problems.append(f"coordinator connection {coordinator.get('state')}")
        if not cgrp and not coordinator:
            return  # a consumer outside any group: nothing to watch
        if problems:
            if self._down_since is None:
                self._down_since = self.clock()
            self.what = ", ".join(problems)
        else:
            self._down_since = None
            self.what = ""

    def stalled_for(self) -> float | None:
        """Seconds without the coordinator, once that is ``stall_s`` or more; else None."""
        if self._down_since is None or not self.stall_s:
            return None
        down = self.clock() - self._down_since
        return down if down >= self.stall_s else None
