"""A dependency-free progress bar for long CLI work (a line per 10% when not on a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, stream=sys.stderr, width: int = 30):
        self.total = max(1, total)
        self.label = label
        self.stream = stream
        self.width = width
        self.done = 0
        self.started = time.monotonic()
        self._tty = hasattr(stream, "isatty") and stream.isatty()
        self._last_decile = -1
        self._last_draw = 0.0

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self._draw()

    def _draw(self, final: bool = False) -> None:
        frac = self.done / self.total
        elapsed = time.monotonic() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        text = f"{self.label} {self.done}/{self.total} ({rate:,.0f}/s, {elapsed:.1f}s)"
        if self._tty:
            now = time.monotonic()
            if not final and now - self._last_draw < 0.05 and self.done < self.total:
                return
            self._last_draw = now
            filled = int(frac * self.width)
            self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {text}")
            if final:
                self.stream.write("\n")
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile != self._last_decile or final:
                self._last_decile = decile
                self.stream.write(f"{text}\n")
                self.stream.flush()

    def close(self) -> None:
        self._draw(final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
