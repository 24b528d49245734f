"""Exactly-once outputs without a broker: a round grouped by request partition, one transaction
per partition with outputs, acknowledgements only after it commits, Faust's commit held."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pipeline.gateway import faust_compat
from pipeline.gateway.checkpoint import DecisionCheckpoint
from pipeline.gateway.outputs import Done, Output
from pipeline.gateway.transactions import Transactions, group_round
from tests.unit.gateway.conftest import Event, FaustProducer


def run(coro):
    return asyncio.run(coro)


def done(topic, partition, offset, outputs=0):
    return Done(Event(topic, partition, offset, b""), outputs)


def out(name):
    return Output(f"dispatch.{name}", name.encode(), b"acme")


def test_a_round_groups_outputs_and_next_offsets_by_request_partition():
    a, b, c = done("req.high", 0, 7, 1), done("req.high", 0, 9, 2), done("req.low", 0, 3)
    d, e = done("responses", 0, 40), done("req.high", 2, 5, 1)
    work = group_round([a, b, c, d, e], [(a, [out("a")]), (b, [out("b1"), out("b2")]), (e, [out("e")])])
    assert sorted(work) == [0, 2]
    # every event's offset, those without outputs too (a completion, a duplicate): the next to read
    assert work[0].offsets == {"req.high": 10, "req.low": 4, "responses": 41}
    assert [(dn, o.value) for dn, o in work[0].outputs] == [(a, b"a"), (b, b"b1"), (b, b"b2")]
    assert work[2].offsets == {"req.high": 6}
    assert [o.value for _, o in work[2].outputs] == [b"e"]


def test_a_partition_with_events_but_no_outputs_has_work_without_outputs():
    work = group_round([done("responses", 1, 4), done("receipts", 1, 2)], [])
    assert work[1].offsets == {"responses": 5, "receipts": 3} and work[1].outputs == []


class Producer:
    """aiokafka's transactional producer as the transactions use it; ``fail`` makes one step raise."""

    def __init__(self, log, partition, fail=None):
        self.log, self.p, self.fail = log, partition, fail

    def _step(self, what):
        self.log.append((self.p, what))
        if self.fail == what:
            raise RuntimeError(f"{what} refused")

    async def begin_transaction(self):
        self._step("begin")

    async def send(self, topic, value, key=None, partition=None, headers=None):
        self._step(("send", value))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def send_offsets_to_transaction(self, offsets, group_id):
        self._step(("offsets", group_id, sorted((tp.topic, tp.partition, o) for tp, o in offsets.items())))

    async def commit_transaction(self):
        self._step("commit")

    async def abort_transaction(self):
        self.log.append((self.p, "abort"))


def transactions(log, failures, fail=None, held=None):
    txns = Transactions("gw", {}, failures.append, hold_commits=held)
    txns._producers = {p: Producer(log, p, fail if p == 1 else None) for p in range(3)}
    return txns


def test_one_transaction_per_partition_with_outputs_and_its_offsets_in_it():
    log, failures = [], []
    a, b, c = done("req.high", 0, 7, 1), done("req.high", 1, 3, 1), done("responses", 2, 11)
    assert run(transactions(log, failures).commit([a, b, c], [(a, [out("a")]), (b, [out("b")])])) == set()
    assert [step for p, step in log if p == 0] == [
        "begin", ("send", b"a"), ("offsets", "gw", [("req.high", 0, 8)]), "commit"]
    assert [step for p, step in log if p == 1][-1] == "commit"
    # partition 2 only counted a completion: no transaction, Faust commits it once acknowledged
    assert not [step for p, step in log if p == 2] and not failures


def test_a_failed_transaction_aborts_stops_the_gateway_and_acknowledges_nothing():
    log, failures, faust_log = [], [], []
    txns = transactions(log, failures, fail="commit")
    checkpoint = _checkpoint(faust_log, txns)
    events = [Event("req.high", p, 5, b"") for p in (0, 1)]
    for e in events:
        checkpoint.after_write(e, [out(f"p{e.message.partition}")])
    run(checkpoint.round())
    assert (1, "abort") in log and len(failures) == 1 and "commit refused" in failures[0]
    assert not any(e.acked for e in events)  # partition 0's commit went through, but the round failed


def test_a_transaction_fenced_after_its_partition_moved_is_left_to_the_new_owner_and_the_gateway_goes_on():
    from aiokafka.errors import ProducerFenced

    log, failures, faust_log = [], [], []
    txns = transactions(log, failures)

    class Fenced(Producer):
        async def commit_transaction(self):
            self._step("commit")
            raise ProducerFenced()

    moved = Fenced(log, 1)
    txns._producers[1] = moved
    checkpoint = _checkpoint(faust_log, txns)
    events = [Event("req.high", p, 5, b"") for p in (0, 1)]
    for e in events:
        checkpoint.after_write(e, [out(f"p{e.message.partition}")])

    async def moved_while_committing():
        txns._assigned = {0, 2}  # partition 1 went to another gateway meanwhile
        await checkpoint.round()

    run(moved_while_committing())
    assert not failures  # not a reason to stop
    assert events[0].acked and not events[1].acked  # partition 1's owner redoes it
    assert (1, "abort") in log


def test_requests_are_acknowledged_only_after_their_transaction_and_state_write():
    log, failures, faust_log = [], [], []
    txns = transactions(log, failures)
    checkpoint = _checkpoint(faust_log, txns)
    with_output, without = Event("req.high", 0, 5, b""), Event("responses", 2, 9, b"")
    checkpoint.after_write(with_output, [out("x")])
    checkpoint.after_write(without, [])
    run(checkpoint.round())
    # the tenants' records are written in every round: the transaction commits their offsets
    assert faust_log == ["changelogs flushed"] and checkpoint.tenants.flushed == 1
    assert with_output.acked and without.acked and txns.committed == 1


def test_rounds_never_overlap_in_exactly_once():
    log, failures, faust_log = [], [], []
    txns = transactions(log, failures)
    checkpoint = _checkpoint(faust_log, txns)
    first, second = Event("req.high", 0, 1, b""), Event("req.high", 0, 2, b"")

    async def both():
        checkpoint.after_write(first, [out("1")])
        one = asyncio.ensure_future(checkpoint.round())
        await asyncio.sleep(0)
        checkpoint.after_write(second, [out("2")])
        await asyncio.gather(one, checkpoint.round(final=True))

    run(both())
    offsets = [step[2] for p, step in log if isinstance(step, tuple) and step[0] == "offsets"]
    assert offsets == [[("req.high", 0, 2)], [("req.high", 0, 3)]]
    assert first.acked and second.acked


def _checkpoint(faust_log, txns):
    tenants = SimpleNamespace(flushed=0)
    tenants.flush = lambda now: setattr(tenants, "flushed", tenants.flushed + 1)
    seen = SimpleNamespace(flush=lambda now: 0)
    return DecisionCheckpoint(FaustProducer(faust_log), tenants, seen, None, state_every_s=5.0, transactions=txns)


def test_transactions_hold_faust_commits_and_wait_for_one_in_progress():
    consumer = SimpleNamespace(_commit_fut=None)
    order = []

    async def faust_commit():
        """Faust's Consumer.commit: wait for a commit in progress, then skip; else commit."""
        if consumer._commit_fut is not None:
            await consumer._commit_fut
            order.append("faust skipped")
            return
        consumer._commit_fut = asyncio.get_running_loop().create_future()
        await asyncio.sleep(0.01)
        order.append("faust committed")
        fut, consumer._commit_fut = consumer._commit_fut, None
        fut.set_result(None)

    async def scenario():
        running = asyncio.ensure_future(faust_commit())
        await asyncio.sleep(0)
        async with faust_compat.commits_held(consumer):
            order.append("transaction")
            late = asyncio.ensure_future(faust_commit())
            await asyncio.sleep(0.01)
            order.append("transaction committed")
        await asyncio.gather(running, late)
        assert consumer._commit_fut is None

    run(scenario())
    assert order == ["faust committed", "transaction", "transaction committed", "faust skipped"]


@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_both_guarantees_validate(guarantee):
    from pipeline.config import Settings

    s = Settings.load(env={})
    s.gateway.processing_guarantee = guarantee
    s.gateway.validate()


def test_an_unknown_guarantee_is_refused():
    from pipeline.config import Settings
    from pipeline.errors import ConfigError

    s = Settings.load(env={})
    s.gateway.processing_guarantee = "exactly_once"
    with pytest.raises(ConfigError, match="exactly-once"):
        s.gateway.validate()


def test_a_round_waits_for_the_producer_of_a_partition_still_being_started():
    log, failures = [], []
    txns = Transactions("gw", {}, failures.append)
    started = []

    async def scenario():
        release = asyncio.Event()

        async def start(p):  # initialising: the previous owner's transaction is being aborted
            await release.wait()
            started.append(p)
            return Producer(log, p)

        txns._start = start
        assigning = asyncio.ensure_future(txns.assigned({0}))
        await asyncio.sleep(0)
        a = done("req.high", 0, 3, 1)
        committing = asyncio.ensure_future(txns.commit([a], [(a, [out("a")])]))
        await asyncio.sleep(0.01)
        assert not log  # nothing sent before the producer exists
        release.set()
        await assigning
        return await committing

    assert run(scenario()) == set() and started == [0] and not failures
    assert [step for _, step in log][-1] == "commit"


def test_a_round_with_a_partition_not_assigned_stops_the_gateway():
    failures = []
    txns = Transactions("gw", {}, failures.append)
    a = done("req.high", 1, 3, 1)
    assert not run(txns.commit([a], [(a, [out("a")])]))
    assert "not assigned" in failures[0]


def test_a_record_delivered_again_in_one_assignment_is_dropped():
    from pipeline.gateway.transactions import Redeliveries

    r = Redeliveries()
    assert [r.fresh("req", 0, o) for o in (5, 6, 6, 5, 7)] == [True, True, False, False, True]
    assert r.fresh("req", 1, 0) and r.dropped == 2
    r.assigned()  # a new assignment: what the group committed comes first again
    assert r.fresh("req", 0, 5)


def test_events_the_previous_owner_committed_are_neither_sent_again_nor_take_the_group_back():
    # Faust started below the floor: the previous owner's last transaction was still committing
    # when the offsets were read at assignment; once this partition's producer started it is over.
    log, failures = [], []
    txns = transactions(log, failures)
    txns.floors[0] = {"req.high": 10, "responses": 41}
    old, new, reply = done("req.high", 0, 8, 1), done("req.high", 0, 12, 1), done("responses", 0, 40)
    assert not txns.fresh("req.high", 0, 9) and txns.fresh("req.high", 0, 10) and txns.fresh("req.low", 0, 0)
    assert run(txns.commit([old, new, reply], [(old, [out("old")]), (new, [out("new")])])) == set()
    assert [step for p, step in log if p == 0] == [
        "begin", ("send", b"new"), ("offsets", "gw", [("req.high", 0, 13)]), "commit"]
    log.clear()
    assert run(txns.commit([old], [(old, [out("old")])])) == set()
    assert log == []  # all of it committed by the previous owner: no transaction at all


def test_the_floor_is_read_once_the_partitions_producer_has_started(monkeypatch):
    import aiokafka

    steps = []

    class Started:
        async def start(self):
            steps.append("producer started")

    monkeypatch.setattr(aiokafka, "AIOKafkaProducer", lambda **kw: Started())
    txns = Transactions("gw", {}, [].append, read_floor=lambda p: steps.append(("floor", p)) or {"req.high": 3})
    run(txns._start(4))
    assert steps == ["producer started", ("floor", 4)] and txns.floors == {4: {"req.high": 3}}


def test_a_partition_kept_across_a_rebalance_reads_its_floor_again_once_the_running_round_ended():
    # Faust seeks a kept partition back to the group's offsets while this gateway's own round may
    # still be committing past them: its events wait for the floor read after that round.
    async def go():
        log, failures, reads = [], [], []
        release = asyncio.Event()
        txns = Transactions("gw", {}, failures.append, read_floor=lambda p: reads.append(p) or {"req.high": 150})

        class Slow(Producer):
            async def commit_transaction(self):
                await release.wait()
                self._step("commit")

        txns._producers = {0: Slow(log, 0)}
        a = done("req.high", 0, 149, 1)
        round_ = asyncio.ensure_future(txns.commit([a], [(a, [out("a")])]))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await txns.assigned({0})  # the rebalance, while the round commits
        waiting = txns.settled(0)
        assert waiting is not None and reads == []  # not before the round has ended
        release.set()
        assert await round_ == set()  # the round itself does not wait for the floor read after it
        await asyncio.wait([waiting])
        assert reads == [0] and txns.settled(0) is None
        # Faust delivers 149 again (it sought back to the offset read before the commit): dropped.
        assert not txns.fresh("req.high", 0, 149) and txns.fresh("req.high", 0, 150)

    run(go())
