"""librdkafka's log lines through Python logging, repeated connection failures summarised.

Every client built from the settings (``KafkaSettings.common_config()``) hands librdkafka the
logger ``pipeline.kafka``; confluent-kafka then passes each log line to it (from the thread
that polls the client) instead of librdkafka writing ``%3|1700000000.123|FAIL|...`` to stderr.

A broker that is down makes every client retry its connection with a short backoff: a worker
started against an absent broker wrote some 700 ``FAIL`` lines in half a minute. The
:class:`ConnectionNoiseFilter` on that logger shows the first failure of each kind (per broker
address and error, whichever client saw it) at WARNING, swallows the repeats, and says how many
there were when the same failure comes again after ``interval_s`` ("... repeated 120 times in
the last 30 s"), or when the process stops (:func:`flush`). A failure that comes back after a
quiet interval is shown again as new. Other librdkafka lines pass at their own level, only
rid of librdkafka's thread tag.

The CLI installs the filter (:func:`install`); a program using llmq as a library can do the
same. Config does not import this module: it only names the logger.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field

from pipeline.config.kafka import KAFKA_LOGGER as LOGGER_NAME

SUMMARY_INTERVAL_S = 30.0

#: What confluent-kafka passes to ``Logger.log``: facility, client name, text.
_RDKAFKA_FORMAT = "%s [%s] %s"
_THREAD_TAG = re.compile(r"^\[thrd:[^\]]*\]:\s*")
#: The parts of a connection failure that change from one attempt to the next.
_ATTEMPT_DETAIL = re.compile(
    r"\s*\(after \d+ms in state [A-Z_]+(?:, (?P<suppressed>\d+) identical error\(s\) suppressed)?\)")
_CONNECTION_FACILITIES = {"FAIL"}


@dataclass
class _Seen:
    since: float
    repeats: int = 0
    clients: set[str] = field(default_factory=set)


def parse(record: logging.LogRecord) -> tuple[str, str, str] | None:
    """(facility, client name, text without the thread tag) of a librdkafka line, else None."""
    if record.msg != _RDKAFKA_FORMAT or not isinstance(record.args, tuple) or len(record.args) != 3:
        return None
    facility, client, text = (str(a) for a in record.args)
    return facility, client, _THREAD_TAG.sub("", text)


class ConnectionNoiseFilter(logging.Filter):
    """Rate-limits librdkafka's connection failures on the ``pipeline.kafka`` logger."""

    def __init__(self, interval_s: float = SUMMARY_INTERVAL_S, clock=time.monotonic,
                 logger: logging.Logger | None = None):
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self.logger = logger or logging.getLogger(LOGGER_NAME)
        self._seen: dict[str, _Seen] = {}
        # Clients are polled from several threads (a worker's consumer, producer, cancellations).
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        parsed = parse(record)
        if parsed is None:
            return True  # not a librdkafka line (e.g. our own summaries)
        facility, client, text = parsed
        if facility not in _CONNECTION_FACILITIES:
            _rewrite(record, "%s %s: %s", (client, facility, text))
            return True
        match = _ATTEMPT_DETAIL.search(text)
        extra = int(match["suppressed"]) if match and match["suppressed"] else 0
        what = _ATTEMPT_DETAIL.sub("", text)
        now = self.clock()
        with self._lock:
            seen = self._seen.get(what)
            if seen is None or (now - seen.since >= self.interval_s and seen.repeats == 0):
                self._seen[what] = _Seen(now, extra, {client})
                _rewrite(record, "Kafka connection: %s (%s; repeats are summarised every %g s)",
                         (what, client, self.interval_s), logging.WARNING)
                return True
            seen.repeats += 1 + extra
            seen.clients.add(client)
            if now - seen.since < self.interval_s:
                return False
            summary = self._summary_args(what, seen, now)
            self._seen[what] = _Seen(now)
        _rewrite(record, *_summary(*summary), logging.WARNING)
        return True

    def flush(self) -> None:
        """Log the repeats not yet summarised (a process about to stop)."""
        now = self.clock()
        with self._lock:
            pending = [self._summary_args(what, seen, now) for what, seen in self._seen.items() if seen.repeats]
            self._seen.clear()
        for args in pending:
            msg, msg_args = _summary(*args)
            self.logger.warning(msg, *msg_args)

    @staticmethod
    def _summary_args(what: str, seen: _Seen, now: float) -> tuple:
        return what, seen.repeats, max(0.0, now - seen.since), ", ".join(sorted(seen.clients))


def _summary(what: str, repeats: int, elapsed_s: float, clients: str) -> tuple:
    # Lines reach Python only when a client is polled, so a burst may arrive all at once.
    if elapsed_s < 1:
        return "Kafka connection: %s: repeated %d more times (%s)", (what, repeats, clients)
    return "Kafka connection: %s: repeated %d times in the last %.0f s (%s)", (what, repeats, elapsed_s, clients)


def _rewrite(record: logging.LogRecord, msg: str, args: tuple, level: int | None = None) -> None:
    record.msg, record.args = msg, args
    if level is not None:
        record.levelno, record.levelname = level, logging.getLevelName(level)


def install(interval_s: float = SUMMARY_INTERVAL_S) -> ConnectionNoiseFilter:
    """Attach the filter to ``pipeline.kafka`` (once; later calls return the same filter)."""
    logger = logging.getLogger(LOGGER_NAME)
    for f in logger.filters:
        if isinstance(f, ConnectionNoiseFilter):
            return f
    f = ConnectionNoiseFilter(interval_s, logger=logger)
    logger.addFilter(f)
    return f


def flush() -> None:
    for f in logging.getLogger(LOGGER_NAME).filters:
        if isinstance(f, ConnectionNoiseFilter):
            f.flush()
