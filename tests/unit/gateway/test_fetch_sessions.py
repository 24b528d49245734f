"""The gateway's incremental fetch sessions (KIP-227): what goes on the wire, and how a session
falls back to a full fetch whenever the broker and the client may disagree."""

import asyncio

import pytest
from aiokafka.protocol.fetch import FetchRequest, FetchRequest_v4, FetchRequest_v11, FetchResponse_v11

from pipeline.gateway.fetch_sessions import FetchSession, SessionFetchRequest, use_fetch_sessions

MAX = 1 << 20
REQ, RESP = "llm.requests.normal", "llm.responses"


def _topics(offsets: dict) -> list:
    by_topic: dict = {}
    for (topic, partition), offset in offsets.items():
        by_topic.setdefault(topic, []).append((partition, offset, MAX))
    return list(by_topic.items())


def _flat(topics: list) -> dict:
    return {(topic, p): offset for topic, parts in topics for p, offset, _ in parts}


def test_the_first_fetch_is_a_full_one_that_asks_for_a_session():
    session = FetchSession()
    wanted = _topics({(REQ, 0): 10, (REQ, 1): 20, (RESP, 0): 5})
    session_id, epoch, topics, forgotten = session.next_request(wanted)
    assert (session_id, epoch, forgotten) == (0, 0, [])
    assert _flat(topics) == _flat(wanted)


def test_once_established_a_fetch_names_only_the_partitions_whose_offset_moved():
    session = FetchSession()
    session.next_request(_topics({(REQ, 0): 10, (REQ, 1): 20, (RESP, 0): 5}))
    session.answered(0, 77)
    session_id, epoch, topics, forgotten = session.next_request(_topics({(REQ, 0): 13, (REQ, 1): 20, (RESP, 0): 5}))
    assert (session_id, epoch, forgotten) == (77, 1, [])
    assert _flat(topics) == {(REQ, 0): 13}
    session.answered(0, 77)
    assert session.next_request(_topics({(REQ, 0): 13, (REQ, 1): 20, (RESP, 0): 5}))[1:] == (2, [], [])


def test_a_partition_no_longer_wanted_is_forgotten_and_one_wanted_again_is_sent_in_full():
    session = FetchSession()
    session.next_request(_topics({(REQ, 0): 10, (REQ, 1): 20}))
    session.answered(0, 5)
    _, _, topics, forgotten = session.next_request(_topics({(REQ, 0): 10}))  # REQ/1 paused
    assert topics == [] and forgotten == [(REQ, [1])]
    session.answered(0, 5)
    _, _, topics, forgotten = session.next_request(_topics({(REQ, 0): 10, (REQ, 1): 20}))
    assert _flat(topics) == {(REQ, 1): 20} and forgotten == []


@pytest.mark.parametrize("error_code", [70, 71, 1])  # session not found, wrong epoch, any other
def test_an_error_in_the_answer_ends_the_session_and_the_next_fetch_is_full(error_code):
    session = FetchSession()
    wanted = _topics({(REQ, 0): 10, (REQ, 1): 20})
    session.next_request(wanted)
    session.answered(0, 9)
    session.next_request(wanted)
    session.answered(error_code, 0)
    session_id, epoch, topics, _ = session.next_request(wanted)
    assert (session_id, epoch) == (0, 0) and _flat(topics) == _flat(wanted)


def test_a_broker_that_keeps_no_session_gets_full_fetches():
    session = FetchSession()
    wanted = _topics({(REQ, 0): 10})
    session.next_request(wanted)
    session.answered(0, 0)
    assert session.next_request(wanted)[:2] == (0, 0)


def test_the_epoch_wraps_to_one_not_zero():
    session = FetchSession()
    session.next_request([])
    session.answered(0, 3)
    session.epoch = 2**31 - 1
    assert session.next_request([])[1] == 1


def test_on_the_wire_the_request_carries_the_session_while_aiokafka_still_sees_every_partition():
    session = FetchSession()
    wanted = _topics({(REQ, 0): 10, (REQ, 1): 20})
    SessionFetchRequest(FetchRequest(100, 1, MAX, 0, wanted), session).build(FetchRequest_v11)
    session.answered(0, 42)
    moved = _topics({(REQ, 0): 11, (REQ, 1): 20})
    request = SessionFetchRequest(FetchRequest(100, 1, MAX, 0, moved), session)
    struct = request.build(FetchRequest_v11)
    assert (struct.session_id, struct.session_epoch, struct.forgotten_topics_data) == (42, 1, [])
    assert [(t, [p[0] for p in parts]) for t, parts in struct.topics] == [(REQ, [0])]
    assert request.topics == moved  # aiokafka matches the answer's partitions against these
    assert struct.encode()  # and it encodes


def test_a_broker_older_than_fetch_v7_gets_aiokafkas_request_and_no_session():
    session = FetchSession()
    session.id = 8
    wanted = _topics({(REQ, 0): 10})
    struct = SessionFetchRequest(FetchRequest(100, 1, MAX, 0, wanted), session).build(FetchRequest_v4)
    assert not session.established and struct.topics == wanted


class _Fetcher:
    def __init__(self, wanted, fail=None):
        self.wanted, self.sent = wanted, []
        self._client = self
        self.fail = fail

    def _get_actions_per_node(self, assignment):
        return [(1, FetchRequest(100, 1, MAX, 0, self.wanted))], {}, 0.2, False, []

    async def send(self, node_id, request):
        struct = request.build(FetchRequest_v11)
        self.sent.append(struct)
        if self.fail:
            raise self.fail
        return FetchResponse_v11(0, 0, 99, [])


def test_the_fetcher_sends_through_the_session_and_notes_the_brokers_answer():
    fetcher = _Fetcher(_topics({(REQ, 0): 10, (RESP, 0): 3}))
    sessions = use_fetch_sessions(fetcher)
    assignment = object()
    for _ in range(2):
        (node_id, request), = fetcher._get_actions_per_node(assignment)[0]
        asyncio.run(fetcher._client.send(node_id, request))
    assert [(s.session_id, s.session_epoch, len(s.topics)) for s in fetcher.sent] == [(0, 0, 2), (99, 1, 0)]
    assert sessions[1].id == 99


def test_a_new_assignment_or_a_failed_send_starts_over_with_a_full_fetch():
    fetcher = _Fetcher(_topics({(REQ, 0): 10}))
    sessions = use_fetch_sessions(fetcher)
    assignment = object()
    (node_id, request), = fetcher._get_actions_per_node(assignment)[0]
    asyncio.run(fetcher._client.send(node_id, request))
    assert sessions[1].established
    fetcher._get_actions_per_node(object())  # a rebalance: aiokafka makes a new assignment
    assert not sessions[1].established
    (node_id, request), = fetcher._get_actions_per_node(assignment)[0]
    asyncio.run(fetcher._client.send(node_id, request))
    fetcher.fail = asyncio.CancelledError()
    (node_id, request), = fetcher._get_actions_per_node(assignment)[0]
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(fetcher._client.send(node_id, request))
    assert not sessions[1].established
