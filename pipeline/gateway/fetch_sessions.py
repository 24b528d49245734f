"""Incremental fetch sessions (KIP-227) for the gateway's aiokafka consumer.

aiokafka 0.14 speaks Fetch v7-v11, whose requests carry a session, but it always sends
``session_id`` 0 and epoch -1 (no session): every fetch names every assigned partition
(the gateway's 36) and the broker answers for every one of them, records or not. Each of
those is encoded and decoded in Python on the gateway's consumer thread, a few hundred
times a second while requests keep arriving (under a flood, most of the gateway's
interpreter time).

With a session the broker remembers the partitions and their fetch offsets: after the first
(full) fetch, a request names only the partitions whose fetch offset changed (and those to
forget), and the answer holds only the partitions that have records or whose offsets moved.

The session is kept per broker. It is started again with a full fetch whenever anything is
off: an error in the answer (the broker evicted it, the epoch does not match), a send that
failed or was cancelled, a new assignment. A full fetch is what aiokafka sends anyway, so the
worst case is today's behaviour.
"""

from __future__ import annotations

import logging

from aiokafka.protocol.fetch import FetchRequest

log = logging.getLogger(__name__)
_MAX_EPOCH = 2**31 - 1


class FetchSession:
    """The client side of one broker's fetch session: its id, the epoch of the last request,
    and what that request left the broker believing (partition → fetch offset, max bytes)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.id = 0
        self.epoch = 0
        self.sent: dict[tuple[str, int], tuple[int, int]] = {}

    @property
    def established(self) -> bool:
        return self.id != 0

    def next_request(self, topics: list) -> tuple[int, int, list, list]:
        """For the wanted ``topics`` (aiokafka's ``[(topic, [(partition, offset, max_bytes)])]``):
        the session id, epoch, partitions and forgotten partitions to put on the wire."""
        wanted = {(topic, p): (offset, max_bytes) for topic, parts in topics for p, offset, max_bytes in parts}
        if not self.established:
            # A full fetch that asks for a session (epoch 0).
            self.sent, self.epoch = wanted, 0
            return 0, 0, topics, []
        self.epoch = self.epoch + 1 if self.epoch < _MAX_EPOCH else 1
        changed: dict[str, list] = {}
        for (topic, p), (offset, max_bytes) in wanted.items():
            if self.sent.get((topic, p)) != (offset, max_bytes):
                changed.setdefault(topic, []).append((p, offset, max_bytes))
        forgotten: dict[str, list] = {}
        for topic, p in self.sent.keys() - wanted.keys():
            forgotten.setdefault(topic, []).append(p)
        self.sent = wanted
        return self.id, self.epoch, list(changed.items()), list(forgotten.items())

    def answered(self, error_code: int, session_id: int) -> None:
        """The broker's answer to the last request: a top-level error ends the session (the next
        fetch is a full one); a full fetch's answer carries the new session's id (0: the broker
        keeps none, and the next fetch is a full one again)."""
        if error_code:
            self.reset()
        elif not self.established:
            self.id = session_id
        elif session_id != self.id:
            self.reset()


class SessionFetchRequest(FetchRequest):
    """aiokafka's fetch request with a session. ``topics`` stays the full list of wanted
    partitions and offsets, which aiokafka matches the answer against; only what goes on the
    wire is incremental."""

    def __init__(self, request: FetchRequest, session: FetchSession):
        super().__init__(request._max_wait_ms, request._min_bytes, request._max_bytes,
                         request._isolation_level, request.topics, rack_id=request._rack_id)
        self.session = session

    def build(self, request_struct_class):
        if request_struct_class.API_VERSION < 7:  # a broker without sessions: as aiokafka does
            self.session.reset()
            return super().build(request_struct_class)
        session_id, epoch, topics, forgotten = self.session.next_request(self._topics)
        struct = FetchRequest(self._max_wait_ms, self._min_bytes, self._max_bytes, self._isolation_level,
                              topics, rack_id=self._rack_id).build(request_struct_class)
        struct.session_id, struct.session_epoch, struct.forgotten_topics_data = session_id, epoch, forgotten
        return struct


def use_fetch_sessions(fetcher) -> dict:
    """Make ``fetcher`` (an aiokafka ``Fetcher``, on its consumer thread's loop) fetch through
    sessions. Returns the sessions by node id (for tests and diagnostics)."""
    sessions: dict = {}
    actions = fetcher._get_actions_per_node
    client = fetcher._client
    send = client.send
    last_assignment = [None]

    def get_actions_per_node(assignment):
        requests, *rest = actions(assignment)
        if assignment is not last_assignment[0]:
            last_assignment[0] = assignment
            for session in sessions.values():
                session.reset()
        wrapped = [(node_id, SessionFetchRequest(request, sessions.setdefault(node_id, FetchSession())))
                   for node_id, request in requests]
        return (wrapped, *rest)

    async def send_noting_sessions(node_id, request, *args, **kwargs):
        if not isinstance(request, SessionFetchRequest):
            return await send(node_id, request, *args, **kwargs)
        try:
            response = await send(node_id, request, *args, **kwargs)
        except BaseException:
            # Whether the broker saw this epoch is unknown: start over with a full fetch.
            request.session.reset()
            raise
        session = request.session
        error_code, session_id = getattr(response, "error_code", 0), getattr(response, "session_id", 0)
        was = session.id
        session.answered(error_code, session_id)
        if error_code:
            log.info("fetch session %d with broker %s ended by error %d: the next fetch is a full one",
                     was, node_id, error_code)
        elif session.id and session.id != was:
            # Once per assignment when all is well: more often means sessions are being lost.
            log.info("fetch session %d opened with broker %s (%d partitions)", session.id, node_id, len(session.sent))
        return response

    fetcher._get_actions_per_node = get_actions_per_node
    client.send = send_noting_sessions
    return sessions
