"""Where a running batch stands: each line's answer, what to submit next, the counts. Pure.

A line is *final* once it has the answer that goes in the output or error file: the first
answer to its current attempt that does not say "later" (:func:`.lines.retryable`), or a
verdict of the driver's (invalid, expired with the window, cancelled). An answer to a line
already final, or to an attempt it has moved past, is a repeat and changes nothing: so a driver
that reads the answers again after a restart, repeats included, ends with the same lines, and
``request_counts`` count each line once.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from pipeline.batch.lines import Line, line_request_id, retryable
from pipeline.models import Response, Status

#: A refusal for now that names no wait: the line is tried again after this.
DEFAULT_RETRY_MS = 1_000


@dataclass(frozen=True)
class Verdict:
    """A line that did not run, and why (its error file line's code and message)."""

    code: str
    message: str


class BatchProgress:
    def __init__(self, batch_id: str, lines: list[Line], window_end_ms: int, max_outstanding: int):
        self.batch_id = batch_id
        self.lines = lines
        self.window_end_ms = window_end_ms
        self.max_outstanding = max_outstanding
        self.final: dict[int, Response | Verdict] = {}
        self.attempt = [0] * len(lines)
        self._ids: dict[str, tuple[int, int]] = {}
        self.outstanding: set[int] = set()
        self._ready: deque[int] = deque()
        self._later: list[tuple[int, int]] = []  # (not before ms, line)
        for line in lines:
            if line.error is not None:
                self.final[line.index] = Verdict("invalid_request", line.error)
            else:
                self._ids[line_request_id(batch_id, line.index, 0)] = (line.index, 0)
                self._ready.append(line.index)

    # -- answers ---------------------------------------------------------------------------

    def request_id(self, index: int) -> str:
        return line_request_id(self.batch_id, index, self.attempt[index])

    def owns(self, request_id: str) -> bool:
        return request_id in self._ids

    def answer(self, resp: Response, now_ms: int) -> bool:
        """Take a terminal answer; True when it changed the batch."""
        where = self._ids.get(resp.request_id)
        if where is None or not resp.status.is_terminal or resp.status is Status.QUEUED:
            return False
        index, attempt = where
        if index in self.final or attempt != self.attempt[index]:
            return False
        self.outstanding.discard(index)
        if retryable(resp, now_ms < self.window_end_ms):
            self.attempt[index] = attempt + 1
            self._ids[self.request_id(index)] = (index, attempt + 1)
            wait = resp.retry_after_ms or DEFAULT_RETRY_MS
            heapq.heappush(self._later, (now_ms + wait, index))
            return True
        self.final[index] = resp
        return True

    def settle(self, index: int, verdict: Verdict) -> None:
        """The driver's own verdict on a line (one that could not be encoded, say)."""
        if index not in self.final:
            self.final[index] = verdict
            self.outstanding.discard(index)

    # -- what to send ----------------------------------------------------------------------

    def to_submit(self, now_ms: int) -> Iterator[int]:
        """Lines to send now (each marked outstanding as it is yielded), within max_outstanding."""
        while self._later and self._later[0][0] <= now_ms:
            self._ready.append(heapq.heappop(self._later)[1])
        while self._ready and len(self.outstanding) < self.max_outstanding:
            index = self._ready.popleft()
            if index in self.final:
                continue
            self.outstanding.add(index)
            yield index

    def waiting(self) -> list[int]:
        """Lines not final and not outstanding (not sent yet, or to be sent again)."""
        return [i for i in list(self._ready) + [i for _, i in self._later] if i not in self.final]

    def resubmit_all(self) -> None:
        """After a restart: every line not final is sent again under its current attempt (the
        gateway answers an id it has seen once; the driver keeps the first answer)."""
        self.outstanding.clear()
        self._later.clear()
        self._ready = deque(i for i in range(len(self.lines)) if i not in self.final)

    def close(self, verdict: Verdict, *, outstanding_too: bool) -> list[int]:
        """Give ``verdict`` to every line waiting (and the outstanding ones when asked): the
        window closed, or the batch was cancelled. Returns the outstanding lines left."""
        for index in self.waiting():
            self.final[index] = verdict
        self._ready.clear()
        self._later.clear()
        if outstanding_too:
            for index in self.outstanding:
                self.final.setdefault(index, verdict)
            self.outstanding.clear()
        return sorted(self.outstanding)

    # -- counts ----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return len(self.final) == len(self.lines)

    def counts(self) -> tuple[int, int, int]:
        """(total, completed, failed), each line counted once."""
        completed = sum(1 for v in self.final.values() if isinstance(v, Response) and v.status is Status.COMPLETED)
        return len(self.lines), completed, len(self.final) - completed

    def any_expired(self) -> bool:
        return any(isinstance(v, Verdict) and v.code == "batch_expired" for v in self.final.values())
