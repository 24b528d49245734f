"""Request ids a worker has taken, so that a re-seen id never gets a different answer. Pure.

The same request id comes back when a client re-submits it, when the gateway re-admits what
it had not committed before a crash, and when a partition this worker gave up (revoked, or
lost to a freeze) comes back with its uncommitted messages. Running such a copy again would
answer it twice, and a model need not answer the same prompt the same way twice. So:

* while the first submission is in flight (running, or put back in its queue by preemption),
  a copy is dropped: its offset finishes without an answer, as the first one's answer covers
  it;
* once the first is answered, a copy is answered again with the very same bytes, for as long
  as the answer is among the ``window`` most recent ones.

A message is told apart from a copy by where it was read from (topic, partition, offset): a
preempted request that runs again is the same message, not a copy. In exactly-once mode a
message read again from the same place is not a copy either: an answer is published only with
its offset, in one transaction, so a message read again was never answered where anybody saw
it, and it runs as new.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable

#: :meth:`RecentRequests.check`'s verdict for a copy of a request still in flight.
IN_FLIGHT = "in_flight"

Place = tuple[tuple[str, int], int]  # ((topic, partition), offset)


class RecentRequests:
    def __init__(self, window: int, exactly_once: bool = False):
        self.window = window  # 0: off, every message runs
        self.exactly_once = exactly_once
        self._running: dict[str, Place] = {}  # request id → the message running it
        # request id → (the first answer's place, its value, its key), oldest first
        self._answers: OrderedDict[str, tuple[Place, bytes, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._running) + len(self._answers)

    def check(self, request_id: str, place: Place):
        """Where the message at ``place`` carrying ``request_id`` stands: None if it is to run
        (the id is new, or this very message runs again), :data:`IN_FLIGHT` if it is a copy of
        one still running, else the first answer's ``(value, key)`` to give again."""
        if not self.window:
            return None
        running = self._running.get(request_id)
        if running is not None:
            return None if running == place else IN_FLIGHT
        answer = self._answers.get(request_id)
        if answer is not None:
            if not (self.exactly_once and answer[0] == place):
                return answer[1], answer[2]
            del self._answers[request_id]
        self._running[request_id] = place
        return None

    def answer_of(self, request_id: str):
        """The first answer's ``(value, key)`` if it is known by now, else None."""
        answer = self._answers.get(request_id)
        return None if answer is None else (answer[1], answer[2])

    def answered(self, request_id: str, place: Place, value: bytes, key: bytes) -> None:
        """The message at ``place`` carrying ``request_id`` was answered with ``value``."""
        if not self.window:
            return
        running = self._running.get(request_id)
        if running is not None and running == place:
            del self._running[request_id]
        answers = self._answers
        if request_id in answers:
            return  # answered twice would be a bug elsewhere; the first answer stands
        answers[request_id] = (place, value, key)
        if len(answers) > self.window:
            answers.popitem(last=False)

    def release(self, partitions: Iterable[Hashable]) -> None:
        """The in-flight work of ``partitions`` was handed back: their messages run again when
        they are read again, here or elsewhere."""
        partitions = set(partitions)
        if not partitions or not self._running:
            return
        for request_id in [r for r, place in self._running.items() if place[0] in partitions]:
            del self._running[request_id]

    def forget_answers(self, places: set) -> None:
        """Answers that will never be published (an exactly-once partition given up before its
        transaction): a copy must not be given them."""
        if not places:
            return
        for request_id in [r for r, answer in self._answers.items() if answer[0] in places]:
            del self._answers[request_id]

    def clear(self) -> None:
        self._running.clear()
        self._answers.clear()
