"""The operator's tools over the dead-letter topic: ``llmq dlq list|show|replay``.

Reading it (:class:`DlqReader`, :class:`DeadLetter`, :class:`Filter`), showing a dead letter
safely on a terminal (escaped text, hexdump, server paths redacted) and replaying dead letters
to the topic they came from. The record format they read (header names, size cap) is
:mod:`pipeline.dlq`'s; this module imports from it, never the other way round, so that the
worker and the gateway, which only write dead letters, import none of this.

Replay
------
``replay`` publishes a dead letter's original key, value and headers again to the topic it
came from (its ``llmq.dlq.source.topic`` header, only ever one of the pipeline's request or
dispatch topics), marked ``llmq.replayed-from: <dlq topic>:<partition>:<offset>``. A dead
letter is replayed at most once, whatever the filters of each run and however a run ends:

* **The ledger is in the dead-letter topic itself.** With each copy, a *replay mark* goes to
  the dead letter's own partition: a record without value, keyed ``llmq.dlq.replay-mark``,
  whose headers name the dead letter it replays (``llmq.dlq.replay.of: <partition>:<offset>``)
  and where the copy went. A mark always follows its dead letter in the partition and lives
  as long as it (same topic, same retention); ``list`` and ``show`` read it, never list it.
* **Copies and marks commit together.** The replay producer is transactional: a batch of
  copies and their marks is one transaction, so a copy is visible exactly when its mark is
  (to the read_committed readers: llmq's workers and these tools). A run that dies
  mid-batch leaves an open transaction, which the next run aborts when it starts.
* **One replay of a topic at a time.** The transactional id is fixed per dead-letter topic:
  a run starting fences any other still running (its next commit fails, it stops), and only
  then reads the marks. So every copy committed before is known, and none can be committed
  behind its back.

A dead letter whose copy fails again comes back as a new dead letter (the copy's
``llmq.replayed-from`` renamed ``original.llmq.replayed-from``, as any producer header in
llmq's namespace), and can itself be replayed once. Dead letters cut to the size limit
(``llmq.dlq.truncated.from``) are never replayed: their original bytes are gone.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterable, Iterator

from pipeline.dlq import (
    H_ERROR,
    H_FAILED_AT,
    H_ORIGINAL_REPLAYED_FROM,
    H_REASON,
    H_REPLAYED_FROM,
    H_SOURCE_OFFSET,
    H_SOURCE_PARTITION,
    H_SOURCE_TOPIC,
    H_STAGE,
    H_TRUNCATED,
    MAX_DEAD_LETTER_BYTES,
    RESERVED_PREFIX,
)

#: A replay mark (see the module's docstring): its key, what it marks, where the copy went.
MARK_KEY = b"llmq.dlq.replay-mark"
H_MARK_OF = "llmq.dlq.replay.of"
H_MARK_TO = "llmq.dlq.replay.to"
H_MARK_AT = "llmq.dlq.replay.at"


def replay_transactional_id(dlq_topic: str) -> str:
    """The one transactional id of every replay of ``dlq_topic`` (a new run fences the last)."""
    return f"llmq-dlq-replay.{dlq_topic}"


# -- reading dead letters ------------------------------------------------------------------

# An absolute path, not inside a URL or a dotted name: "/srv/llmq/schemas/x.avsc".
_PATH = re.compile(r"(?<![\w.:/~-])/(?:[\w.@+~-]+/)+[\w.@+~-]*")


def redact_paths(text: str) -> str:
    """``text`` with absolute file paths replaced by ``<path>``: errors written by a server
    may name its files, which are nobody's business on an operator's screen."""
    return _PATH.sub("<path>", text)


def printable(data: bytes | None, limit: int | None = None) -> str:
    """Untrusted bytes as one line of text: UTF-8 where valid, everything else (control
    characters included, which could drive a terminal) escaped."""
    data = data or b""
    cut = data if limit is None else data[:limit]
    text = cut.decode("utf-8", "backslashreplace")
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return out + ("…" if limit is not None and len(data) > limit else "")


def hexdump(data: bytes, limit: int = 256) -> list[str]:
    """``xxd``-like lines of the first ``limit`` bytes: offset, hex, printable ASCII."""
    lines = []
    for start in range(0, min(len(data), limit), 16):
        chunk = data[start:min(start + 16, limit)]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{start:08x}  {hexes:<47}  |{text}|")
    return lines


def iso_ms(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(text: str, now_ms: int | None = None) -> int:
    """Epoch milliseconds from ``30m``/``2h``/``7d`` (that long ago), an ISO 8601 date or
    time (UTC unless it names its zone), or epoch milliseconds. Raises ValueError."""
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    text = text.strip()
    m = _DURATION.match(text)
    if m:
        return now_ms - int(float(m[1]) * _UNIT_S[m[2].lower()] * 1000)
    if text.isdigit() and len(text) >= 10:
        return int(text)
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not a time: use e.g. 30m, 2h, 7d (ago), 2026-01-31, "
                         "2026-01-31T14:00 (UTC), 2026-01-31T14:00+01:00 or epoch milliseconds") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def parse_locator(text: str, dlq_topic: str) -> tuple[int, int]:
    """``<partition>:<offset>``, ``<offset>`` (partition 0) or ``<dlq topic>:<p>:<o>`` (as in
    a ``llmq.replayed-from`` header). Raises ValueError."""
    parts = text.strip().rsplit(":", 2)
    if len(parts) == 3:
        if parts[0] != dlq_topic:
            raise ValueError(f"{text!r} names topic {parts[0]!r}, not the dead-letter topic {dlq_topic!r}")
        parts = parts[1:]
    try:
        partition, offset = (0, int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise ValueError(f"{text!r} is not a record: use PARTITION:OFFSET, e.g. 0:42") from None
    if partition < 0 or offset < 0:
        raise ValueError(f"{text!r}: partition and offset are never negative")
    return partition, offset


@dataclass
class DeadLetter:
    """One record of the dead-letter topic (a dead letter or a replay mark)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)

    @classmethod
    def from_message(cls, msg) -> "DeadLetter":
        ts_type, ts = msg.timestamp()
        return cls(msg.topic(), msg.partition(), msg.offset(), ts if ts_type else None, msg.key(), msg.value(),
                   [(k, v if v is not None else b"") for k, v in (msg.headers() or [])])

    def _header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v.decode("utf-8", "replace")
        return None

    def _int_header(self, name: str) -> int | None:
        v = self._header(name)
        try:
            return int(v) if v is not None else None
        except ValueError:
            return None

    @property
    def locator(self) -> str:
        return f"{self.partition}:{self.offset}"

    @property
    def is_mark(self) -> bool:
        return self.key == MARK_KEY and self.value is None and self._header(H_MARK_OF) is not None

    @property
    def marks(self) -> tuple[int, int] | None:
        """The (partition, offset) a replay mark stands for."""
        if not self.is_mark:
            return None
        try:
            return parse_locator(self._header(H_MARK_OF) or "", self.topic)
        except ValueError:
            return None

    @property
    def reason(self) -> str:
        return self._header(H_REASON) or "-"

    @property
    def source_topic(self) -> str | None:
        return self._header(H_SOURCE_TOPIC)

    @property
    def failed_at_ms(self) -> int | None:
        """When it failed (its header), else when it was written."""
        at = self._int_header(H_FAILED_AT)
        return at if at is not None else self.timestamp_ms

    @property
    def size(self) -> int:
        return len(self.value or b"")

    @property
    def truncated_from(self) -> int | None:
        return self._int_header(H_TRUNCATED)

    def summary(self, replayed_to: str | None = None) -> dict:
        """What ``list`` shows of it (no value; errors without server paths)."""
        return {
            "dlq_topic": self.topic, "partition": self.partition, "offset": self.offset,
            "source_topic": self.source_topic, "source_partition": self._int_header(H_SOURCE_PARTITION),
            "source_offset": self._int_header(H_SOURCE_OFFSET), "reason": self.reason,
            "stage": self._header(H_STAGE), "failed_at_ms": self.failed_at_ms,
            "failed_at": iso_ms(self.failed_at_ms), "size": self.size, "truncated_from": self.truncated_from,
            "error": redact_paths(self._header(H_ERROR) or ""),
            "replay_of": self._header(H_ORIGINAL_REPLAYED_FROM), "replayed_to": replayed_to,
        }

    def detail(self, preview_bytes: int = 256, replayed_to: str | None = None) -> dict:
        """What ``show`` shows: the summary, every header, the key, a preview of the value."""
        value = self.value or b""
        return {
            **self.summary(replayed_to),
            "timestamp": iso_ms(self.timestamp_ms),
            # llmq's own headers were written by a server: no paths; the rest is the producer's data
            "headers": [(k, redact_paths(printable(v)) if k.startswith(RESERVED_PREFIX) else printable(v))
                        for k, v in self.headers],
            "key": printable(self.key) if self.key is not None else None,
            "value_preview": printable(value, preview_bytes),
            "value_hex": hexdump(value, preview_bytes),
        }


@dataclass(frozen=True)
class Filter:
    """Which dead letters a command takes: reasons (any of), and a failure time range."""

    reasons: frozenset[str] = frozenset()
    since_ms: int | None = None
    until_ms: int | None = None

    def matches(self, letter: DeadLetter) -> bool:
        if letter.is_mark:
            return False
        if self.reasons and letter.reason not in self.reasons:
            return False
        at = letter.failed_at_ms
        if self.since_ms is not None and (at is None or at < self.since_ms):
            return False
        if self.until_ms is not None and (at is None or at > self.until_ms):
            return False
        return True


#: Records are written a moment after they fail; seeking by write time starts this much earlier.
_SEEK_SLACK_MS = 60_000


class DlqReader:
    """Reads the dead-letter topic up to where it ends when asked, read_committed (replay
    marks of aborted replays, and their copies, do not count)."""

    def __init__(self, settings, timeout_s: float = 30.0):
        from confluent_kafka import Consumer

        self.topic = settings.topics.dlq
        self.timeout_s = timeout_s
        # assign() only, never a commit: the group id is a formality of librdkafka's.
        self.consumer = Consumer(settings.kafka.consumer_config("llmq-dlq-tool", **{
            "enable.partition.eof": True, "isolation.level": "read_committed", "fetch.wait.max.ms": 100}))

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> "DlqReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def partitions(self) -> list[int]:
        from pipeline.errors import KafkaOperationError

        md = self.consumer.list_topics(self.topic, timeout=self.timeout_s).topics.get(self.topic)
        if md is None or md.error is not None or not md.partitions:
            raise KafkaOperationError(f"read dead-letter topic {self.topic}",
                                      "no such topic (`llmq topics create` creates it)")
        return sorted(md.partitions)

    def bounds(self, since_ms: int | None = None) -> dict[int, tuple[int, int]]:
        """Per partition, the offset to start from (by time with ``since_ms``) and its end."""
        from confluent_kafka import KafkaException, TopicPartition

        from pipeline.errors import KafkaOperationError

        out = {}
        try:
            parts = self.partitions()
            ends = {p: self._watermarks(p) for p in parts}
            starts = {p: low for p, (low, _) in ends.items()}
            if since_ms is not None:
                asked = [TopicPartition(self.topic, p, max(0, since_ms - _SEEK_SLACK_MS)) for p in parts]
                for tp in self.consumer.offsets_for_times(asked, timeout=self.timeout_s):
                    # -1: nothing written at or after that time
                    starts[tp.partition] = tp.offset if tp.offset >= 0 else ends[tp.partition][1]
        except KafkaException as exc:
            raise KafkaOperationError(f"read dead-letter topic {self.topic}", str(exc.args[0]), exc.args[0]) from exc
        for p, (low, high) in ends.items():
            out[p] = (max(low, starts[p]), high)
        return out

    def _watermarks(self, partition: int) -> tuple[int, int]:
        from confluent_kafka import KafkaException, TopicPartition

        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self.consumer.get_watermark_offsets(TopicPartition(self.topic, partition), timeout=10)
            except KafkaException as exc:
                # a topic just created has no leader for a moment
                if time.monotonic() > deadline or not exc.args[0].retriable():
                    raise
                time.sleep(0.2)

    def read(self, ranges: dict[int, tuple[int, int]]) -> Iterator[DeadLetter]:
        """Every record in ``[start, end)`` of each partition, in offset order per partition."""
        from confluent_kafka import KafkaError, TopicPartition

        from pipeline.errors import KafkaOperationError

        wanted = {p: (s, e) for p, (s, e) in ranges.items() if s < e}
        if not wanted:
            return
        self.consumer.assign([TopicPartition(self.topic, p, s) for p, (s, _) in wanted.items()])
        remaining = set(wanted)
        last_progress = time.monotonic()
        try:
            while remaining:
                batch = self.consumer.consume(500, 0.5)
                if batch:
                    last_progress = time.monotonic()
                elif time.monotonic() - last_progress > self.timeout_s:
                    raise KafkaOperationError(f"read dead-letter topic {self.topic}",
                                              f"no record for {self.timeout_s:.0f} s before its end")
                for msg in batch:
                    p, err = msg.partition(), msg.error()
                    if p not in remaining:
                        continue
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:  # read_committed: the stable end
                            remaining.discard(p)
                            continue
                        raise KafkaOperationError(f"read dead-letter topic {self.topic}", err.str(), err)
                    end = wanted[p][1]
                    if msg.offset() >= end:
                        remaining.discard(p)
                        continue
                    yield DeadLetter.from_message(msg)
                    if msg.offset() >= end - 1:
                        remaining.discard(p)
        finally:
            try:
                self.consumer.unassign()
            except RuntimeError:  # closed already: a generator abandoned, then collected
                pass

    def get(self, partition: int, offset: int) -> tuple[DeadLetter | None, str | None]:
        """One record, and where it was replayed to (a mark later in its partition), if it was."""
        bounds = self.bounds().get(partition)
        if bounds is None or not bounds[0] <= offset < bounds[1]:
            return None, None
        found, replayed = None, None
        for rec in self.read({partition: (offset, bounds[1])}):
            if rec.offset == offset and not rec.is_mark:
                found = rec
            elif rec.marks == (partition, offset):
                replayed = rec._header(H_MARK_TO) or "?"
            if found is None and rec.offset > offset:
                break  # not there (an aborted transaction's record)
        return found, replayed


def list_letters(settings, flt: Filter) -> list[dict]:
    """Summaries of the dead letters ``flt`` takes, oldest first per partition."""
    with DlqReader(settings) as reader:
        rows = []
        replayed: dict[tuple[int, int], str] = {}
        for rec in reader.read(reader.bounds(flt.since_ms)):
            target = rec.marks
            if target is not None:
                replayed[target] = rec._header(H_MARK_TO) or "?"
            elif flt.matches(rec):
                rows.append(rec.summary())
    for row in rows:
        row["replayed_to"] = replayed.get((row["partition"], row["offset"]))
    return rows


def show_letter(settings, locator: str, preview_bytes: int = 256) -> dict | None:
    with DlqReader(settings) as reader:
        partition, offset = parse_locator(locator, reader.topic)
        rec, replayed = reader.get(partition, offset)
    return rec.detail(preview_bytes, replayed) if rec is not None else None


# -- replay ----------------------------------------------------------------------------------


@dataclass
class ReplayReport:
    dry_run: bool
    matched: int = 0
    replayed: list[dict] = field(default_factory=list)  # {"record", "to"} per copy
    already_replayed: int = 0
    #: reason → count of dead letters that can never be replayed
    skipped: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"dry_run": self.dry_run, "matched": self.matched, "replayed": len(self.replayed),
                "already_replayed": self.already_replayed, "skipped": dict(self.skipped),
                "copies": self.replayed}

    def describe(self) -> str:
        verb = "would replay" if self.dry_run else "replayed"
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return (f"{verb} {len(self.replayed)} of {self.matched} matching dead letters"
                f" ({self.already_replayed} already replayed{'; skipped: ' + skipped if skipped else ''})")


SKIP_TRUNCATED = "truncated (the original bytes are gone)"
SKIP_NO_SOURCE = "without a source topic (not an llmq dead letter)"
SKIP_FOREIGN = "from a topic that is not one of llmq's request or dispatch topics"


def why_not_replayable(letter: DeadLetter, inputs: set[str]) -> str | None:
    """Why ``letter`` can never be replayed (one of the ``SKIP_*`` reasons), or None if it can;
    ``inputs`` are the topics a copy may go to (the request and dispatch topics)."""
    if letter.truncated_from is not None:
        return SKIP_TRUNCATED
    if not letter.source_topic:
        return SKIP_NO_SOURCE
    if letter.source_topic not in inputs:
        return SKIP_FOREIGN
    return None


def copy_headers(letter: DeadLetter) -> list[tuple[str, bytes]]:
    """The copy's headers: the producer's own (as the dead letter kept them), and the mark."""
    kept = [(k, v) for k, v in letter.headers if not k.startswith("llmq.dlq.")]
    return kept + [(H_REPLAYED_FROM, f"{letter.topic}:{letter.partition}:{letter.offset}".encode())]


def mark_headers(letter: DeadLetter, to: str, at_ms: int) -> list[tuple[str, bytes]]:
    return [(H_MARK_OF, letter.locator.encode()), (H_MARK_TO, to.encode()), (H_MARK_AT, str(at_ms).encode())]


class Replayer:
    """One replay run over the dead-letter topic (see the module's docstring for why a dead
    letter is never replayed twice). ``dry_run`` only reads: it starts no transaction, so it
    does not stop a replay running meanwhile."""

    def __init__(self, settings, *, dry_run: bool = False, timeout_s: float = 60.0):
        self.settings = settings
        self.topic = settings.topics.dlq
        self.dry_run = dry_run
        self.timeout_s = timeout_s
        t = settings.topics
        self.inputs = set(t.request_topics) | set(t.dispatch_topics)
        self.reader = DlqReader(settings, timeout_s)
        self.producer = None
        self._in_transaction = False
        if not dry_run:
            from confluent_kafka import Producer

            self.producer = Producer(settings.kafka.producer_config(**{
                "transactional.id": replay_transactional_id(self.topic), "client.id": "llmq-dlq-replay",
                # a copy is as large as the request the broker once accepted
                "message.max.bytes": MAX_DEAD_LETTER_BYTES + 65536,
                "transaction.timeout.ms": int(timeout_s * 1000)}))
            # Fences a replay of this topic still running and aborts what a dead one left open;
            # only after this are the marks read, so none can be committed behind our back.
            self._kafka("start the replay (init_transactions)", self.producer.init_transactions, timeout_s)

    def close(self) -> None:
        try:
            if self._in_transaction and self.producer is not None:
                # Interrupted mid-batch: roll it back now rather than at the next run.
                self._in_transaction = False
                self.producer.abort_transaction(self.timeout_s)
        except Exception:  # the next run's init_transactions aborts it anyway
            pass
        finally:
            self.reader.close()
            if self.producer is not None:
                self.producer.flush(1)

    def __enter__(self) -> "Replayer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, flt: Filter, *, batch_size: int = 100,
            on_progress: Callable[[int, int], None] | None = None) -> ReplayReport:
        report = ReplayReport(self.dry_run)
        bounds = self.reader.bounds(flt.since_ms)
        # Pass 1, locations only: a mark comes after its dead letter, so what is left to do is
        # known only at the end of the partition.
        marked: set[tuple[int, int]] = set()
        todo: dict[tuple[int, int], str] = {}
        for rec in self.reader.read(bounds):
            target = rec.marks
            if target is not None:
                marked.add(target)
                continue
            if not flt.matches(rec):
                continue
            report.matched += 1
            why = why_not_replayable(rec, self.inputs)
            if why is not None:
                report.skipped[why] = report.skipped.get(why, 0) + 1
            else:
                todo[(rec.partition, rec.offset)] = rec.source_topic
        for loc in marked & todo.keys():
            del todo[loc]
            report.already_replayed += 1
        total = len(todo)
        if self.dry_run or not todo:
            report.replayed = [{"record": f"{p}:{o}", "to": topic} for (p, o), topic in sorted(todo.items())]
            return report
        if on_progress is not None:
            on_progress(0, total)
        # Pass 2: the values, batch by batch, each batch one transaction with its marks.
        ranges: dict[int, tuple[int, int]] = {}
        for p, o in todo:
            lo, hi = ranges.get(p, (o, o + 1))
            ranges[p] = (min(lo, o), max(hi, o + 1))
        records = self.reader.read(ranges)
        try:
            for batch in chunks((r for r in records if (r.partition, r.offset) in todo), batch_size):
                report.replayed.extend(self._publish(batch))
                if on_progress is not None:
                    on_progress(len(report.replayed), total)
        finally:
            records.close()  # while the consumer is still open
        return report

    def _publish(self, batch: list[DeadLetter]) -> list[dict]:
        from confluent_kafka import KafkaException

        from pipeline.errors import KafkaOperationError

        delivered: dict[str, tuple] = {}

        def on_delivery(locator, err, msg):
            delivered[locator] = (err, msg.topic(), msg.partition(), msg.offset())

        self._kafka("begin a replay batch", self.producer.begin_transaction)
        self._in_transaction = True
        try:
            for letter in batch:
                self._produce(letter.source_topic, letter.value, letter.key, copy_headers(letter),
                              on_delivery=lambda err, msg, loc=letter.locator: on_delivery(loc, err, msg))
            self.producer.flush(self.timeout_s)
            failed = [(loc, d[0]) for loc, d in delivered.items() if d[0] is not None]
            missing = [letter.locator for letter in batch if letter.locator not in delivered]
            if failed or missing:
                loc, err = failed[0] if failed else (missing[0], None)
                detail = err.str() if err is not None else f"not acknowledged within {self.timeout_s:.0f} s"
                raise KafkaOperationError(f"replay dead letter {loc}", f"{detail}; nothing of this batch was kept",
                                          err)
            now = int(time.time() * 1000)
            copies = []
            for letter in batch:
                _, topic, partition, offset = delivered[letter.locator]
                to = f"{topic}:{partition}:{offset}"
                self._produce(self.topic, None, MARK_KEY, mark_headers(letter, to, now), partition=letter.partition)
                copies.append({"record": letter.locator, "to": to})
            self._commit()
            self._in_transaction = False
            return copies
        except (KafkaOperationError, KafkaException):
            if self._in_transaction:
                self._in_transaction = False
                try:
                    self.producer.abort_transaction(self.timeout_s)
                except KafkaException:
                    pass  # fenced or fatal: the broker aborts it
            raise

    def _produce(self, topic, value, key, headers, **kw) -> None:
        while True:
            try:
                self.producer.produce(topic, value, key, headers=headers, **kw)
                return
            except BufferError:
                self.producer.poll(0.05)

    def _commit(self) -> None:
        from confluent_kafka import KafkaError, KafkaException

        from pipeline.errors import KafkaOperationError

        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.producer.commit_transaction(self.timeout_s)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.retriable() and time.monotonic() < deadline:
                    continue
                if err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH):
                    raise KafkaOperationError("commit a replay batch", "another replay of this dead-letter topic "
                                              "started and took over; this one stopped", err) from exc
                raise KafkaOperationError("commit a replay batch", err.str(), err) from exc

    def _kafka(self, what: str, call, *args):
        from confluent_kafka import KafkaException

        from pipeline.errors import KafkaOperationError

        try:
            return call(*args)
        except KafkaException as exc:
            err = exc.args[0]
            raise KafkaOperationError(what, err.str(), err) from exc


def replay(settings, flt: Filter, *, dry_run: bool = False, batch_size: int = 100,
           on_progress: Callable[[int, int], None] | None = None, timeout_s: float = 60.0) -> ReplayReport:
    """Replay the dead letters ``flt`` takes that were never replayed; ``on_progress(done,
    total)`` is called before the first batch and after each committed one."""
    with Replayer(settings, dry_run=dry_run, timeout_s=timeout_s) as replayer:
        return replayer.run(flt, batch_size=batch_size, on_progress=on_progress)


def chunks(items: Iterable, n: int) -> Iterator[list]:
    """``items`` in lists of ``n`` (the last one shorter), read lazily."""
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
