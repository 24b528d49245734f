"""Which priority band a worker serves next: pure, no I/O.

Strict priority (the highest band with work goes first), except that a lower band whose
share of the recent dispatches fell below its configured minimum is served first, so
sustained high-band load slows the lower bands but never starves them.
"""

from __future__ import annotations

from collections import deque
from itertools import islice, repeat
from typing import Sequence


class BandScheduler:
    def __init__(self, min_shares: Sequence[float], window: int = 200):
        if any(s < 0 for s in min_shares) or sum(min_shares) >= 1:
            raise ValueError("minimum shares must be >= 0 and sum to less than 1")
        self.min_shares = tuple(min_shares)
        self._recent: deque[int] = deque(maxlen=window)
        self._counts = [0] * len(min_shares)

    def pick(self, has_work: Sequence[bool]) -> int | None:
        """The band (0 = highest) to serve next among those with work, or None."""
        total = len(self._recent) + 1
        starved, starved_ratio = None, 1.0
        first = None
        for band, busy in enumerate(has_work):
            if not busy:
                continue
            if first is None:
                first = band
            floor = self.min_shares[band] * total
            if floor >= 1 and self._counts[band] + 1 <= floor:
                ratio = self._counts[band] / floor
                if ratio < starved_ratio:
                    starved, starved_ratio = band, ratio
        return starved if starved is not None else first

    def record(self, band: int) -> None:
        recent = self._recent
        if len(recent) == recent.maxlen:
            self._counts[recent[0]] -= 1
        recent.append(band)
        self._counts[band] += 1

    def record_many(self, band: int, count: int) -> None:
        """:meth:`record` ``count`` times."""
        recent = self._recent
        drop = len(recent) + count - recent.maxlen
        if drop > 0:
            counts = self._counts
            for old in islice(recent, min(drop, len(recent))):
                counts[old] -= 1
        keep = min(count, recent.maxlen)
        recent.extend(repeat(band, keep))
        self._counts[band] += keep

    def shares(self) -> list[float]:
        n = len(self._recent) or 1
        return [c / n for c in self._counts]
