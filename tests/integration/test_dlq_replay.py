"""`llmq dlq list|show|replay` on the real broker.

The story of the first test: a producer already writes a schema revision the workers do not
know yet; the worker dead-letters it; the revision is published ("the schema is upgraded");
`llmq dlq replay` sends it back and it is answered COMPLETED; replaying again answers nothing
more. The others: a replay interrupted between batches, one that died mid-transaction, and
the filters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Producer

from pipeline import dlq, dlq_tools
from pipeline.client import LlmqClient
from pipeline.partitioning import tenant_partition
from pipeline.dlq_tools import Filter
from pipeline.models import Priority, Request, Status
from pipeline.serde import Codec, SchemaStore
from tests.integration.harness import read_topic, running_worker


def llmq(settings, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMQ_BOOTSTRAP": settings.kafka.bootstrap, "LLMQ_TOPICS__PREFIX": settings.topics.prefix}
    env.pop("LLMQ_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, env=env,
                          timeout=180)


def schemas_with_a_new_request_revision(tmp_path: Path) -> Path:
    """A copy of the published schemas plus one more llm_request revision (a new optional
    field), which is also the current one: what a producer upgraded before the workers has."""
    root = tmp_path / "schemas"
    shutil.copytree(SchemaStore.default_directory(), root)
    history = root / "history"
    newest = max(int(p.name.split(".")[1]) for p in history.glob("llm_request.*.avsc"))
    schema = json.loads((root / "llm_request.avsc").read_text())
    schema["fields"].append({"name": "replay_probe", "type": ["null", "string"], "default": None,
                             "doc": "a field the workers' schemas do not have yet"})
    text = json.dumps(schema, indent=2) + "\n"
    (history / f"llm_request.{newest + 1}.avsc").write_text(text)
    (root / "llm_request.avsc").write_text(text)
    return root


def replay_copies(settings, topic: str) -> list:
    """Messages of ``topic`` that are replayed copies, as read_committed readers see them."""
    return [m for m in read_topic(settings.kafka.bootstrap, topic)
            if any(k == dlq.H_REPLAYED_FROM for k, _ in (m.headers() or []))]


def test_a_record_of_an_unknown_revision_is_dead_lettered_replayed_after_the_upgrade_and_answered_once(
        settings, tmp_path):
    settings.worker.source = "requests"  # gateway-less: the worker reads the request topics
    upgraded = Codec(SchemaStore.load(schemas_with_a_new_request_revision(tmp_path)))
    topic = settings.topics.request_topic(Priority.NORMAL)
    request = Request.new("tenant-upgraded", "written with a revision the worker does not know yet")
    value = upgraded.encode_request(request)
    with pytest.raises(Exception) as unknown:
        Codec.default().decode_request(value)
    assert getattr(unknown.value, "reason", None) == "unknown_fingerprint"

    # The record names no reply partition (any Kafka client's): its answer is in the tenant's
    # partition of the response topic, so that is the one this client reads.
    home = tenant_partition(request.tenant_id.encode(), settings.topics.response_partitions)
    with LlmqClient(settings, reply_partitions=[home]) as client:
        producer = Producer(settings.kafka.producer_config())
        producer.produce(topic, value, request.tenant_id.encode(), headers=[("trace", b"t-42")])
        assert producer.flush(10) == 0

        with running_worker(settings) as worker:  # the schemas of the repository: revision unknown
            (letter,) = read_topic(settings.kafka.bootstrap, settings.topics.dlq, until=lambda m: len(m) >= 1)
            assert worker.stats.dead_lettered == 1
        assert dlq.header_dict(letter.headers())["llmq.dlq.reason"] == "unknown_fingerprint"

        listed = llmq(settings, "dlq", "list", "--json", "--reason", "unknown_fingerprint", "--since", "10m")
        assert listed.returncode == 0, listed.stderr
        (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (row["source_topic"], row["reason"], row["size"]) == (topic, "unknown_fingerprint", len(value))
        assert row["replayed_to"] is None
        assert llmq(settings, "dlq", "list", "--json", "--reason", "malformed").stdout == ""

        shown = llmq(settings, "dlq", "show", f"{settings.topics.dlq}:{row['partition']}:{row['offset']}")
        assert shown.returncode == 0, shown.stderr
        assert "unknown_fingerprint" in shown.stdout and "trace = t-42" in shown.stdout
        assert "00000000  c3 01" in shown.stdout  # the single-object header, in hex
        assert str(tmp_path) not in shown.stdout and str(Path.cwd()) not in shown.stdout

        dry = llmq(settings, "dlq", "replay", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert f"-> {topic}" in dry.stdout and "would replay 1 of 1" in dry.stdout
        assert replay_copies(settings, topic) == []

        # The upgrade: the worker now knows the revision.
        with running_worker(settings, codec=upgraded):
            first = llmq(settings, "dlq", "replay")
            assert first.returncode == 0, first.stderr
            assert "replayed 1 of 1 matching dead letters (0 already replayed)" in first.stdout
            answer = client.result(request.request_id, timeout=30)
            assert answer.status is Status.COMPLETED, answer.reason

            second = llmq(settings, "dlq", "replay")
            assert second.returncode == 0, second.stderr
            assert "replayed 0 of 1 matching dead letters (1 already replayed)" in second.stdout
            # Same tenant, same partition, behind anything a second replay could have written.
            sentinel = Request.new(request.tenant_id, "after the second replay")
            client.submit(sentinel)
            assert client.result(sentinel.request_id, timeout=30).status is Status.COMPLETED

    answers = [m for m in read_topic(settings.kafka.bootstrap, settings.topics.responses)
               if Codec.default().decode_response(m.value()).request_id == request.request_id]
    assert len(answers) == 1
    (copy,) = replay_copies(settings, topic)
    assert copy.value() == value and copy.key() == request.tenant_id.encode()
    assert (dlq.H_REPLAYED_FROM, f"{settings.topics.dlq}:{letter.partition()}:{letter.offset()}".encode()) \
        in copy.headers()
    assert ("trace", b"t-42") in copy.headers()
    listed = json.loads(llmq(settings, "dlq", "list", "--json").stdout)
    assert listed["replayed_to"].startswith(f"{topic}:")


def _dead_letters(settings, reasons: list[str], source: str) -> None:
    """Dead letters as the worker writes them, of valid requests (a replay only moves bytes)."""
    producer = Producer(settings.kafka.producer_config())
    codec = Codec.default()
    for i, reason in enumerate(reasons):
        value = codec.encode_request(Request.new(f"tenant-{i}", f"prompt {i}", priority=Priority.LOW))
        headers = dlq.dead_letter_headers(source, 0, i, reason, f"error {i}", "worker", [("n", str(i).encode())])
        producer.produce(settings.topics.dlq, value, f"tenant-{i}".encode(), headers=headers)
    assert producer.flush(10) == 0


def _sources(copies) -> list[str]:
    return sorted(dict(m.headers())[dlq.H_REPLAYED_FROM].decode() for m in copies)


class Stop(Exception):
    pass


def test_an_interrupted_replay_goes_on_where_it_stopped_and_filters_never_cause_a_second_copy(settings):
    low = settings.topics.request_topic(Priority.LOW)
    _dead_letters(settings, ["malformed", "malformed", "bad_magic", "malformed", "malformed", "truncated"], low)

    def stop_after_first_batch(done, total):
        if done >= 2:
            raise Stop

    with pytest.raises(Stop):
        dlq_tools.replay(settings, Filter(frozenset({"malformed"})), batch_size=2, on_progress=stop_after_first_batch)
    assert len(replay_copies(settings, low)) == 2

    again = dlq_tools.replay(settings, Filter(frozenset({"malformed"})), batch_size=2)
    assert (again.matched, len(again.replayed), again.already_replayed) == (4, 2, 2)
    everything = dlq_tools.replay(settings, Filter())
    assert (everything.matched, len(everything.replayed), everything.already_replayed) == (6, 2, 4)
    nothing = dlq_tools.replay(settings, Filter())
    assert (len(nothing.replayed), nothing.already_replayed) == (0, 6)

    copies = replay_copies(settings, low)
    assert _sources(copies) == [f"{settings.topics.dlq}:0:{o}" for o in range(6)]  # each once
    rows = dlq_tools.list_letters(settings, Filter())
    assert len(rows) == 6 and all(r["replayed_to"] for r in rows)  # the marks are not listed


def test_a_replay_that_died_mid_transaction_is_rolled_back_and_done_once_by_the_next(settings):
    low = settings.topics.request_topic(Priority.LOW)
    _dead_letters(settings, ["malformed", "malformed"], low)
    # What a replay killed after publishing its first copy and mark leaves: an open transaction.
    dead = Producer(settings.kafka.producer_config(**{"transactional.id": dlq_tools.replay_transactional_id(
        settings.topics.dlq), "transaction.timeout.ms": 600_000}))
    dead.init_transactions(30)
    dead.begin_transaction()
    first = dlq_tools.DlqReader(settings)
    try:
        (letter, _) = list(first.read(first.bounds()))
    finally:
        first.close()
    dead.produce(low, letter.value, letter.key, headers=dlq_tools.copy_headers(letter))
    dead.produce(settings.topics.dlq, None, dlq_tools.MARK_KEY, partition=0,
                 headers=dlq_tools.mark_headers(letter, f"{low}:0:0", 0))
    assert dead.flush(10) == 0

    report = dlq_tools.replay(settings, Filter())  # fences the dead one, aborting its transaction
    assert (len(report.replayed), report.already_replayed) == (2, 0)
    assert _sources(replay_copies(settings, low)) == [f"{settings.topics.dlq}:0:0", f"{settings.topics.dlq}:0:1"]
    assert dlq_tools.replay(settings, Filter()).already_replayed == 2


def test_list_filters_by_time_and_show_refuses_what_is_not_there(settings):
    low = settings.topics.request_topic(Priority.LOW)
    _dead_letters(settings, ["malformed", "bad_magic"], low)
    assert [r["reason"] for r in dlq_tools.list_letters(settings, Filter(since_ms=dlq_tools.parse_time("5m")))] == [
        "malformed", "bad_magic"]
    assert dlq_tools.list_letters(settings, Filter(until_ms=dlq_tools.parse_time("1h"))) == []
    assert dlq_tools.list_letters(settings, Filter(since_ms=dlq_tools.parse_time("1m") + 120_000)) == []
    table = llmq(settings, "dlq", "list", "--reason", "bad_magic")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("RECORD") and len(lines) == 2
    assert lines[1].startswith(f"{settings.topics.dlq}:0:1 ") and f"{low}:0:1" in lines[1]
    missing = llmq(settings, "dlq", "show", "0:99")
    assert missing.returncode == 1 and "no dead letter 0:99" in missing.stderr
    bad = llmq(settings, "dlq", "show", "zero:one")
    assert bad.returncode == 2 and "PARTITION:OFFSET" in bad.stderr
