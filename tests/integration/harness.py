"""Helpers shared by integration tests: settings with unique topics, a worker on a thread, llmq
processes to start and kill."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

from pipeline.broker import free_port  # noqa: F401 (the tests import it from here)
from pipeline.config import Settings


def make_settings(bootstrap: str, **worker) -> Settings:
    """Settings whose topics and group are unique to the calling test."""
    settings = Settings.load(env={})
    settings.kafka.bootstrap = bootstrap
    settings.topics.prefix = f"t{uuid.uuid4().hex[:10]}.llm"
    settings.topics.request_partitions = 3
    settings.topics.response_partitions = 3
    settings.topics.dispatch_partitions = 3
    settings.worker.group_id = f"{settings.topics.prefix}.workers"
    settings.worker.commit_interval_ms = 200
    settings.worker.shutdown_grace_s = 5
    for k, v in worker.items():
        setattr(settings.worker, k, v)
    return settings


@contextlib.contextmanager
def running_worker(settings: Settings, backend=None, **kwargs):
    """A Worker on a thread; stopped (drain, commit, leave) on exit."""
    from pipeline.worker.backends.simulated import SimulatedBackend
    from pipeline.worker.loop import Worker

    worker = Worker(settings, backend or SimulatedBackend(), **kwargs)
    errors = []

    def run():
        try:
            worker.run(install_signals=False)
        except BaseException as exc:  # surfaced in the test, not lost in the thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-worker", daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(30)
        assert not thread.is_alive(), "worker did not stop within 30 s"
        if errors:
            raise errors[0]


def read_topic(bootstrap: str, topic: str, *, until=None, timeout: float = 30.0,
               isolation: str = "read_committed") -> list:
    """Every message of ``topic`` from the beginning.

    Reads until the high watermarks seen at the start are reached, or — with ``until``, a
    predicate over the messages so far — until it holds (waiting up to ``timeout``).
    """
    import time

    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": isolation,
                         "enable.partition.eof": False})
    try:
        md = consumer.list_topics(topic, timeout=10).topics[topic]
        parts = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.partitions]
        consumer.assign(parts)
        highs = {p.partition: _high_watermark(consumer, TopicPartition(topic, p.partition)) for p in parts}
        out = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.2):
                if msg.error() is None:
                    out.append(msg)
            if until is not None:
                if until(out):
                    return out
            else:
                # The consumer's position, not the last message's offset: transaction markers
                # occupy offsets that are never returned as messages.
                positions = {tp.partition: tp.offset for tp in consumer.position(parts)}
                if all(highs[p] == 0 or positions.get(p, -1) >= highs[p] for p in highs):
                    return out
        if until is not None:
            raise AssertionError(f"condition on {topic} not met within {timeout}s ({len(out)} messages read)")
        return out
    finally:
        consumer.close()


def _high_watermark(consumer, tp, timeout: float = 30.0) -> int:
    """The partition's end offset; a topic just created may not have a leader for a moment."""
    import time

    from confluent_kafka import KafkaException

    deadline = time.monotonic() + timeout
    while True:
        try:
            return consumer.get_watermark_offsets(tp, timeout=10)[1]
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def committed_offsets(bootstrap: str, group: str, topics: list[str]) -> dict[tuple[str, int], int]:
    """Where ``group`` stands now: offsets committed so far (an open transaction's offsets are not,
    and are not waited for: read_committed would ask for stable offsets, KIP-447)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                         "isolation.level": "read_uncommitted"})
    try:
        parts = []
        for topic in topics:
            md = consumer.list_topics(topic, timeout=10).topics[topic]
            parts += [TopicPartition(topic, p) for p in md.partitions]
        return {(tp.topic, tp.partition): tp.offset for tp in consumer.committed(parts, timeout=10)}
    finally:
        consumer.close()


def end_offsets(bootstrap: str, topics: list[str]) -> dict[tuple[str, int], int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "end-offsets"})
    try:
        out = {}
        for topic in topics:
            for p in consumer.list_topics(topic, timeout=10).topics[topic].partitions:
                out[(topic, p)] = _high_watermark(consumer, TopicPartition(topic, p))
        return out
    finally:
        consumer.close()


class LlmqProcess:
    """One llmq process as deployed (``python -m pipeline.cli ...``), started, SIGKILLed and
    restarted by a test as a supervisor would, its output in one log (``ready``: the line that
    says it serves; None: none awaited)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], workdir: Path, ready: str | None):
        self.name, self.argv, self.env, self.ready = name, argv, env, ready
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self._offset = 0

    def start(self) -> None:
        with open(self.log, "a") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')}\n")
            log.flush()
            self._offset = log.tell()
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.workdir, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            f.seek(self._offset)
            return f.read()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ready and self.ready not in self.output():
            assert self.proc.poll() is None, f"{self.name} exited: {self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.name} not ready: {self.output()[-3000:]}"
            time.sleep(0.1)

    def kill(self) -> float:
        """SIGKILL a running process (a process already gone would be a fault that did not happen)."""
        assert self.proc is not None and self.proc.poll() is None, f"{self.name} was not running to be killed"
        at = time.time()
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(10) == -signal.SIGKILL
        return at

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
