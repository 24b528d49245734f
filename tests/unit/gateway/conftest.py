"""Stand-ins for what the gateway's parts touch outside themselves: a Faust table (a dict), Faust's
producer, the librdkafka outputs and the events Faust hands the agents."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.config import Settings
from pipeline.config.gateway import RateLimitSettings
from pipeline.gateway.checkpoint import DecisionCheckpoint
from pipeline.gateway.completions import Completions
from pipeline.gateway.intake import Intake
from pipeline.gateway.partitions import Ownership
from pipeline.gateway.seen import SeenDecisions
from pipeline.gateway.tenant_states import TenantStates
from pipeline.models import BANDS, Priority, Request
from pipeline.observability.metrics import GatewayMetrics
from pipeline.policy.admission import Admission, DegradePolicy, RateLimits
from pipeline.policy.fairness import FairnessQuotas
from pipeline.policy.priority import PriorityPolicy
from pipeline.policy.queues import QueueModel
from pipeline.serde import Codec


class Table(dict):
    """A Faust table as the gateway uses it; ``writes`` are its changelog records in order."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.writes.append((key, value))

    def __delitem__(self, key):
        super().__delitem__(key)
        self.writes.append((key, None))


class FaustProducer:
    def __init__(self, log):
        self.log = log

    async def flush(self):
        self.log.append("changelogs flushed")


class Outputs:
    """Records what is sent (each :class:`~pipeline.gateway.outputs.Output` with its countdown);
    ``deliver()`` acknowledges it as the broker would."""

    def __init__(self, log):
        self.log = log
        self.sent = []

    def send(self, output, done):
        self.log.append(("sent", output.topic))
        self.sent.append((output, done))

    def deliver(self):
        for _, done in self.sent:
            done.one()
        self.sent_before, self.sent = self.sent, []


class Event:
    def __init__(self, topic, partition, offset, value, key=b"acme", timestamp=None):
        self.message = SimpleNamespace(topic=topic, partition=partition, offset=offset, value=value, key=key,
                                       headers=[], timestamp=timestamp)
        self.acked = False

    def ack(self):
        self.acked = True
        return True


@pytest.fixture
def gw():
    settings = Settings.load(env={})
    log: list = []
    tenants_table, seen_table = Table(), Table()
    ownership = Ownership(settings.topics.request_partitions)
    ownership.assigned(set(range(settings.topics.request_partitions)))
    tenants = TenantStates(tenants_table)
    seen = SeenDecisions(seen_table, ownership, horizon_ms=10_000)
    outputs = Outputs(log)
    checkpoint = DecisionCheckpoint(FaustProducer(log), tenants, seen, outputs, state_every_s=0.0)
    admission = Admission(PriorityPolicy(), RateLimits([RateLimitSettings("s", 60_000, requests=3, over="refuse")]),
                          FairnessQuotas({}, floor=Priority.LOW), QueueModel([0] * len(BANDS)), DegradePolicy())
    metrics = GatewayMetrics()
    codec = Codec.default()
    common = dict(codec=codec, admission=admission, tenants=tenants, seen=seen, checkpoint=checkpoint,
                  metrics=metrics)
    intake = Intake(wire="single-object", topics=settings.topics, **common)
    completions = Completions(partitions=settings.topics.request_partitions, receipts=settings.topics.receipts,
                              **common)
    offsets = iter(range(10**9))

    def request_event(req: Request, offset: int | None = None, partition: int = 0):
        topic = settings.topics.request_topic(req.priority)
        return Event(topic, partition, next(offsets) if offset is None else offset, codec.encode_request(req),
                     req.tenant_id.encode())

    return SimpleNamespace(settings=settings, log=log, tenants_table=tenants_table, seen_table=seen_table,
                           tenants=tenants, seen=seen, outputs=outputs, checkpoint=checkpoint, admission=admission,
                           intake=intake, completions=completions, codec=codec, request_event=request_event,
                           ownership=ownership)
