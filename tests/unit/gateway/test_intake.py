"""One request in: its decision, its outputs after the state behind them, once per request id."""

from __future__ import annotations

import asyncio

from pipeline.dlq import H_REASON
from pipeline.models import DISPATCHED_AGAIN_HEADER, REDELIVERED, RESUBMITTED, Priority, Request, Response, Status
from pipeline.serde import Codec, SerdeLimits
from tests.unit.gateway.conftest import Event


def run(coro):
    return asyncio.run(coro)


def handled(gw, *events):
    for event in events:
        gw.intake.handle(event)
    run(gw.checkpoint.round())
    gw.outputs.deliver()
    return [(output.topic, output.value) for output, _ in gw.outputs.sent_before]


def test_outputs_leave_once_the_decision_is_written_and_the_request_is_acked_once_they_are_delivered(gw):
    event = gw.request_event(Request.new("acme", "hello", timeout_ms=600_000))
    gw.intake.handle(event)
    assert gw.log == [] and gw.tenants_table == {}  # nothing leaves before its decision is durable
    run(gw.checkpoint.round())
    assert gw.log == ["changelogs flushed", ("sent", gw.settings.topics.dispatch_topic(Priority.NORMAL))]
    assert list(gw.tenants_table) == [b"acme"] and len(gw.seen_table) == 1
    assert not event.acked  # written, but its output not delivered yet
    gw.outputs.deliver()
    assert event.acked


def test_tenant_records_are_written_less_often_than_decisions_and_acks_wait_for_them(gw):
    gw.checkpoint.state_every_s = 3600.0
    event = gw.request_event(Request.new("acme", "hello", timeout_ms=600_000))
    gw.intake.handle(event)
    run(gw.checkpoint.round())
    gw.outputs.deliver()
    assert len(gw.outputs.sent_before) == 1 and len(gw.seen_table) == 1  # answered, its decision written
    assert gw.tenants_table == {} and not event.acked  # the tenant's record is not, so no commit yet
    run(gw.checkpoint.round(final=True))
    assert list(gw.tenants_table) == [b"acme"] and event.acked


def test_a_request_read_again_is_charged_once_whether_or_not_its_tenants_record_was_written(gw):
    req = Request.new("acme", "again", timeout_ms=600_000)
    gw.checkpoint.state_every_s = 3600.0
    handled(gw, gw.request_event(req, offset=7))
    # A crash before the tenant's record was written: the record (empty) is what comes back.
    gw.tenants.forget()
    assert gw.tenants.get("acme").outstanding == [0] * 5
    handled(gw, gw.request_event(req, offset=7))
    state = gw.tenants.get("acme")
    assert state.outstanding[Priority.NORMAL.rank] == 1 and state.buckets  # applied again, once
    handled(gw, gw.request_event(req, offset=7))
    assert gw.tenants.get("acme").outstanding[Priority.NORMAL.rank] == 1


def test_after_a_rebalance_recorded_admissions_are_charged_before_anything_new_is_decided(gw):
    req = Request.new("acme", "decided by the gateway that died", timeout_ms=600_000)
    gw.checkpoint.state_every_s = 3600.0
    handled(gw, gw.request_event(req, offset=7))
    # It died before the tenant's record was written; the new owner loads the decision log.
    gw.tenants.forget()
    gw.seen.load(now_ms=req.created_at)
    assert gw.intake.charge_recorded(lambda partition: True) == 1
    state = gw.tenants.get("acme")
    assert state.outstanding[Priority.NORMAL.rank] == 1 and state.buckets  # before any new request
    # Charged once: neither again here nor when the request itself is read again.
    assert gw.intake.charge_recorded(lambda partition: True) == 0
    handled(gw, gw.request_event(req, offset=7))
    assert gw.tenants.get("acme").outstanding[Priority.NORMAL.rank] == 1
    # Another gateway's partitions are left to it.
    gw.tenants.forget()
    assert gw.intake.charge_recorded(lambda partition: False) == 0


def test_a_response_read_again_is_counted_once(gw):
    req = Request.new("acme", "x", timeout_ms=600_000)
    [(_, dispatched)] = handled(gw, gw.request_event(req))
    d = gw.codec.decode_request(dispatched)
    resp = Response.for_request(d, Status.COMPLETED, admitted_at=d.admitted_at, served_priority=d.effective_priority,
                                started_at=d.admitted_at + 1, output="ok")
    value = gw.codec.encode_response(resp)
    gw.completions.handle(Event(gw.settings.topics.responses, 0, 42, value))
    gw.seen.load(now_ms=d.admitted_at)  # a rebalance: the ids seen come back, the finish with them
    gw.completions.handle(Event(gw.settings.topics.responses, 0, 42, value))
    run(gw.checkpoint.round())
    assert gw.tenants.get("acme").outstanding == [0] * 5


def test_a_receipt_frees_the_quota_of_an_answer_sent_elsewhere_and_counts_once_with_it(gw):
    outstanding = []
    for name in ("only-receipt", "both"):
        req = Request.new("acme", name, timeout_ms=600_000)
        [(_, dispatched)] = handled(gw, gw.request_event(req))
        d = gw.codec.decode_request(dispatched)
        resp = Response.for_request(d, Status.COMPLETED, admitted_at=d.admitted_at,
                                    served_priority=d.effective_priority, started_at=d.admitted_at + 1)
        value = gw.codec.encode_response(resp)
        gw.completions.handle(Event(gw.settings.topics.receipts, 0, 7 if name == "both" else 3, value))
        if name == "both":  # its answer reached the responses topic too (a reply topic that vanished)
            gw.completions.handle(Event(gw.settings.topics.responses, 0, 9, value))
        run(gw.checkpoint.round())
        outstanding.append(list(gw.tenants.get("acme").outstanding))
    assert outstanding == [[0] * 5, [0] * 5]
    finished = gw.completions.metrics.finished.labels(Priority.NORMAL.value, "completed")
    assert finished.value == 2  # one per request, whichever copies arrived


def test_an_answer_outside_its_tenants_partition_is_left_to_its_receipt(gw):
    req = Request.new("acme", "x", timeout_ms=600_000)  # acme lives in partition 0
    [(_, dispatched)] = handled(gw, gw.request_event(req))
    d = gw.codec.decode_request(dispatched)
    value = gw.codec.encode_response(Response.for_request(
        d, Status.COMPLETED, admitted_at=d.admitted_at, served_priority=d.effective_priority, output="ok"))
    gw.completions.handle(Event(gw.settings.topics.responses, 3, 5, value))  # a client's reply partition
    assert gw.tenants.get("acme").outstanding[Priority.NORMAL.rank] == 1
    gw.completions.handle(Event(gw.settings.topics.receipts, 0, 5, value))
    assert gw.tenants.get("acme").outstanding[Priority.NORMAL.rank] == 0


def test_a_tenant_sending_many_requests_costs_one_state_record_per_round(gw):
    handled(gw, *(gw.request_event(Request.new("acme", f"r{i}", timeout_ms=600_000)) for i in range(3)))
    assert [k for k, _ in gw.tenants_table.writes] == [b"acme"]
    assert len(gw.seen_table.writes) == 1


def test_refusals_are_answered_with_their_reason(gw):
    sent = handled(gw, *(gw.request_event(Request.new("acme", f"r{i}", timeout_ms=600_000)) for i in range(4)))
    answers = [gw.codec.decode_response(v) for t, v in sent if t == gw.settings.topics.responses]
    [limited] = answers
    assert limited.status is Status.REJECTED and limited.reason.startswith("rate_limited: limit s")
    assert limited.retry_after_ms > 0


def test_undecodable_bytes_and_a_bug_are_dead_lettered_and_the_rest_goes_on(gw, monkeypatch):
    topic = gw.settings.topics.request_topic(Priority.NORMAL)
    garbage = Event(topic, 0, 100, b"\xc3\x01garbage")
    buggy = gw.request_event(Request.new("acme", "boom", timeout_ms=600_000))
    fine = gw.request_event(Request.new("acme", "fine", timeout_ms=600_000))
    decide = gw.admission.decide

    def failing(req, *a, **kw):
        if req.prompt == "boom":
            raise KeyError("a bug")
        return decide(req, *a, **kw)

    monkeypatch.setattr(gw.admission, "decide", failing)
    sent = handled(gw, garbage, buggy, fine)
    dead = [output.headers for output, _ in gw.outputs.sent_before if output.topic == gw.settings.topics.dlq]
    assert [dict(h)[H_REASON] for h in dead] == [b"truncated", b"gateway_error"]
    assert [t for t, _ in sent].count(gw.settings.topics.dispatch_topic(Priority.NORMAL)) == 1
    assert garbage.acked and buggy.acked and fine.acked


def _over_limit_event(gw, req: Request, offset: int | None = None) -> Event:
    """``req`` encoded without the codec's caps, as any Kafka client may send it."""
    big = Codec(gw.codec.store, SerdeLimits(max_prompt_bytes=10**6, max_string_bytes=10**6))
    return Event(gw.settings.topics.request_topic(req.priority), 0, 200 if offset is None else offset,
                 big.encode_request(req), req.tenant_id.encode())


def test_a_request_over_a_size_cap_is_refused_naming_the_limit_and_remembered_not_dead_lettered(gw):
    req = Request.new("acme", "p" * 300_000, timeout_ms=600_000, reply_partition=2)
    event = _over_limit_event(gw, req)
    [(topic, value)] = handled(gw, event)
    assert topic == gw.settings.topics.responses and event.acked
    [(output, _)] = gw.outputs.sent_before
    assert output.partition == 2 and output.key == b"acme"  # where any answer of it goes
    answer = gw.codec.decode_response(value)
    assert (answer.request_id, answer.status) == (req.request_id, Status.REJECTED)
    assert answer.reason == "invalid_request: prompt is 300000 bytes, over the 262144-byte limit (max_prompt_bytes)"
    assert gw.tenants.get("acme").outstanding == [0] * 5  # charged nothing
    # Its id is decided: a copy within the caps gets the same answer, never a dispatch.
    [(topic, again)] = handled(gw, gw.request_event(Request.new("acme", "small now", request_id=req.request_id)))
    assert topic == gw.settings.topics.responses and gw.codec.decode_response(again).reason == answer.reason


def test_an_over_cap_copy_of_a_dispatched_id_gets_no_second_different_answer(gw):
    req = Request.new("acme", "done", timeout_ms=600_000)
    [(_, dispatched)] = handled(gw, gw.request_event(req))
    completed(gw, gw.codec.decode_request(dispatched))
    copy = Request.new("acme", "p" * 300_000, request_id=req.request_id)
    assert handled(gw, _over_limit_event(gw, copy)) == []  # the first answer (COMPLETED) stands


def test_an_over_cap_request_that_does_not_say_who_sent_it_is_dead_lettered(gw):
    req = Request.new("t" * 70_000, "p" * 300_000, timeout_ms=600_000)  # its tenant over max_string_bytes
    [(topic, _)] = handled(gw, _over_limit_event(gw, req))
    assert topic == gw.settings.topics.dlq
    [(output, _)] = gw.outputs.sent_before
    assert dict(output.headers)[H_REASON] == b"limit_exceeded"


def test_an_id_submitted_again_while_its_first_copy_is_on_its_way_is_dropped(gw):
    req = Request.new("acme", "once", timeout_ms=600_000)
    first, again = gw.request_event(req), gw.request_event(req)
    sent = handled(gw, first, again)
    assert len(sent) == 1 and first.acked and again.acked


def test_an_id_the_gateway_refused_gets_the_same_refusal_again(gw):
    reqs = [Request.new("acme", f"r{i}", timeout_ms=600_000) for i in range(4)]
    handled(gw, *(gw.request_event(r) for r in reqs))
    [(_, again)] = handled(gw, gw.request_event(reqs[3]))
    answer = gw.codec.decode_response(again)
    assert answer.status is Status.REJECTED and answer.reason.startswith("rate_limited")


def test_a_request_redelivered_after_a_crash_goes_out_as_it_did_and_is_charged_once(gw):
    req = Request.new("acme", "again", timeout_ms=600_000)
    [(_, first)] = handled(gw, gw.request_event(req, offset=7))
    budget = [list(v) for v in gw.tenants.get("acme").buckets.values()]
    [(_, second)] = handled(gw, gw.request_event(req, offset=7))  # the same offset: redelivered
    assert gw.codec.decode_request(second).admitted_at == gw.codec.decode_request(first).admitted_at
    assert [list(v) for v in gw.tenants.get("acme").buckets.values()] == budget
    assert gw.tenants.get("acme").outstanding[Priority.NORMAL.rank] == 1


def test_a_request_dispatched_again_says_so_for_a_worker_that_did_not_take_the_first_copy(gw):
    req = Request.new("acme", "again", timeout_ms=600_000)
    handled(gw, gw.request_event(req, offset=7))
    [(first, _)] = gw.outputs.sent_before
    handled(gw, gw.request_event(req, offset=7))  # redelivered after a crash
    [(second, _)] = gw.outputs.sent_before
    assert DISPATCHED_AGAIN_HEADER not in dict(first.headers or ())
    assert dict(second.headers or ()).get(DISPATCHED_AGAIN_HEADER) == REDELIVERED
    assert second.value == first.value


def test_after_its_answer_an_id_submitted_again_is_dispatched_as_before(gw):
    req = Request.new("acme", "done", timeout_ms=600_000)
    [(_, dispatched)] = handled(gw, gw.request_event(req))
    completed(gw, gw.codec.decode_request(dispatched))
    [(topic, again)] = handled(gw, gw.request_event(req))
    assert topic == gw.settings.topics.dispatch_topic(Priority.NORMAL)
    [(output, _)] = gw.outputs.sent_before
    assert dict(output.headers)[DISPATCHED_AGAIN_HEADER] == RESUBMITTED  # a client asked again
    assert gw.tenants.get("acme").outstanding == [0] * 5  # not counted again


def completed(gw, dispatched: Request, *, used: int = 10, times: int = 1) -> None:
    resp = Response.for_request(dispatched, Status.COMPLETED, admitted_at=dispatched.admitted_at,
                                served_priority=dispatched.effective_priority, started_at=dispatched.admitted_at + 5,
                                prompt_tokens=used // 2, completion_tokens=used - used // 2, output="ok")
    for _ in range(times):
        event = Event(gw.settings.topics.responses, 0, 0, gw.codec.encode_response(resp))
        gw.completions.handle(event)
    run(gw.checkpoint.round())


def test_a_terminal_answer_frees_the_quota_and_settles_the_tokens_once(gw):
    req = Request.new("acme", "x", timeout_ms=600_000, max_tokens=100)
    [(_, dispatched)] = handled(gw, gw.request_event(req))
    state = gw.tenants.get("acme")
    assert state.outstanding[Priority.NORMAL.rank] == 1
    completed(gw, gw.codec.decode_request(dispatched), times=2)  # at-least-once: the worker answered twice
    assert state.outstanding == [0] * 5
    assert gw.admission.queues.load(Priority.NORMAL.rank) < 0.01  # it waited 5 ms


def test_the_ids_seen_and_what_is_in_flight_come_back_from_the_table(gw):
    req = Request.new("acme", "x", timeout_ms=600_000)
    finished = Request.new("acme", "y", timeout_ms=600_000)
    [_, (_, dispatched)] = handled(gw, gw.request_event(req), gw.request_event(finished))
    completed(gw, gw.codec.decode_request(dispatched))
    gw.seen.load(now_ms=gw.seen.get(req.request_id).at_ms)
    assert gw.seen.get(req.request_id).in_flight
    assert not gw.seen.get(finished.request_id).in_flight


def test_ids_are_forgotten_past_the_horizon_and_their_records_deleted(gw):
    req = Request.new("acme", "x", timeout_ms=600_000)
    handled(gw, gw.request_event(req))
    at = gw.seen.get(req.request_id).at_ms
    gw.seen.flush(at + 20_000)
    assert gw.seen.get(req.request_id) is None and len(gw.seen_table) == 0


def test_two_writes_in_one_millisecond_keep_both_records(gw, monkeypatch):
    import pipeline.gateway.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "now_ms", lambda: 1_800_000_000_000)
    first, second = (Request.new("acme", f"r{i}", timeout_ms=600_000) for i in range(2))
    handled(gw, gw.request_event(first))
    handled(gw, gw.request_event(second))
    assert len(gw.seen_table) == 2


def test_the_buckets_run_on_arrival_time_so_a_late_gateway_admits_what_arrived_in_time(gw):
    from pipeline.gateway.intake import arrival_ms

    now = 1_800_000_000_000
    assert arrival_ms(None, now) == now
    assert arrival_ms((now - 250) / 1000, now) == now - 250
    assert arrival_ms((now + 5_000) / 1000, now) == now  # a clock ahead of the gateway's: now
    assert arrival_ms((now - 3_600_000) / 1000, now) == now - 60_000  # far behind: a minute at most
    # Three requests that arrived a second apart, decided together later: within a 1-per-second limit.
    reqs = [Request.new("acme", f"r{i}", timeout_ms=600_000) for i in range(3)]
    gw.admission.limits.default[:] = [__import__("pipeline.config.gateway", fromlist=["x"]).RateLimitSettings(
        "s", 1_000, requests=1)]
    events = []
    for i, r in enumerate(reqs):
        e = gw.request_event(r)
        e.message.timestamp = (r.created_at - (2 - i) * 1_000) / 1000  # arrived 2 s, 1 s and 0 s ago
        events.append(e)
    sent = handled(gw, *events)
    assert [gw.codec.decode_request(v).request_id for t, v in sent if "dispatch" in t] == [r.request_id for r in reqs]


def test_a_refusal_goes_to_the_partition_its_client_reads_and_a_partition_it_lacks_to_the_tenants(gw):
    reqs = [Request.new("acme", f"r{i}", timeout_ms=600_000, reply_partition=4) for i in range(4)]
    reqs.append(Request.new("acme", "far", timeout_ms=600_000, reply_partition=99))
    handled(gw, *(gw.request_event(r) for r in reqs))
    answers = [output.partition for output, _ in gw.outputs.sent_before
               if output.topic == gw.settings.topics.responses]
    assert answers == [4, None]  # the rate-limited fourth to partition 4; the last: no such partition


def test_records_faust_skipped_are_decided_before_the_one_that_jumped_and_acked_with_it(gw):
    from pipeline.gateway.positions import Record

    reqs = [Request.new("acme", f"r{i}", timeout_ms=600_000) for i in range(3)]
    events = [gw.request_event(r, offset=10 + i) for i, r in enumerate(reqs)]
    skipped = [Record(e.message.topic, e.message.partition, e.message.offset, e.message.key, e.message.value,
                      None, []) for e in events[:2]]
    gw.intake.handle(events[2], before=skipped)
    run(gw.checkpoint.round())
    gw.outputs.deliver()
    decided = [entry[1] for bucket in gw.seen_table.values() for entry in bucket]
    assert decided == [f"{events[0].message.topic}:0:{o}" for o in (10, 11, 12)]  # all three, in offset order
    assert len(gw.outputs.sent_before) == 3 and events[2].acked


def test_a_shadow_policy_is_counted_beside_the_real_one_and_never_enforced(gw):
    from pipeline.config.gateway import RateLimitSettings
    from pipeline.policy.admission import Admission, DegradePolicy, RateLimits
    from pipeline.policy.fairness import FairnessQuotas
    from pipeline.policy.priority import PriorityPolicy
    from pipeline.policy.queues import CappedView
    from pipeline.policy.shadow import Shadow

    real = gw.admission
    gw.intake.shadow = Shadow(Admission(PriorityPolicy(), RateLimits([RateLimitSettings("s", 60_000, requests=1, over="refuse")]),
                                        FairnessQuotas({}), CappedView(real.queues, [0] * 5), DegradePolicy()))
    sent = handled(gw, *(gw.request_event(Request.new("acme", f"p{i}", timeout_ms=600_000)) for i in range(4)))
    statuses = [gw.codec.decode_response(v).status for t, v in sent if t == gw.settings.topics.responses]
    dispatched = [t for t, _ in sent if t == gw.settings.topics.dispatch_topic(Priority.NORMAL)]
    # The real limit is 3 a minute: three dispatched, one refused, whatever the shadow said.
    assert len(dispatched) == 3 and statuses == [Status.REJECTED]
    m = gw.intake.metrics
    value = m.registry.get_sample_value
    assert value("llmq_gateway_shadow_decisions_total", {"decision": "admitted", "reason": "none"}) == 1
    assert value("llmq_gateway_shadow_decisions_total", {"decision": "rejected", "reason": "rate_limited"}) == 3
    assert value("llmq_gateway_shadow_disagreements_total", {"real": "admitted", "shadow": "rejected"}) == 2
    assert value("llmq_requests_total", {"priority": "NORMAL", "outcome": "admitted"}) == 3
