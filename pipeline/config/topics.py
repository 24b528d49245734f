"""[topics]: every topic name and partition count, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.fields import positive
from pipeline.errors import ConfigError
from pipeline.models import Priority

#: Worker pools (the seed's real-time / async / background queues): which bands each consumes.
DEFAULT_POOLS: dict[str, tuple[str, ...]] = {
    "realtime": ("CRITICAL", "HIGH"),
    "async": ("NORMAL", "LOW"),
    "background": ("BACKGROUND",),
    "all": ("CRITICAL", "HIGH", "NORMAL", "LOW", "BACKGROUND"),
}

def min_insync_replicas(replication_factor: int) -> int:
    """Kafka's usual pairing: RF 3 → 2, RF 2 → 1, one broker → 1. Fewer than all replicas, so
    one may be down without refusing acks=all writes; with RF 3 a majority, so a write
    acknowledged to a producer survives its leader's death."""
    return max(1, min(2, replication_factor - 1))


@dataclass
class TopicSettings:
    prefix: str = "llm"
    request_partitions: int = 6
    response_partitions: int = 6
    dlq_partitions: int = 1
    replication_factor: int = 1
    #: min.insync.replicas of the topics llmq creates; 0 = from the replication factor
    #: (RF 3 → 2, RF 2 → 1, RF 1 → 1). A topic's own *_config wins.
    min_insync_replicas: int = 0
    request_config: dict[str, str] = field(default_factory=lambda: {"retention.ms": str(7 * 24 * 3600 * 1000)})
    response_config: dict[str, str] = field(default_factory=lambda: {"retention.ms": str(7 * 24 * 3600 * 1000)})
    cancellation_partitions: int = 3
    #: Admitted requests, per band, keyed by tenant: more partitions spread tenants wider, so
    #: a flooding tenant shares its partition with fewer quiet ones (stochastic fair queuing).
    dispatch_partitions: int = 12
    #: Compacted (one record per request id) and deleted after a day: cancelling is for live work.
    cancellation_config: dict[str, str] = field(default_factory=lambda: {
        "cleanup.policy": "compact,delete", "retention.ms": str(24 * 3600 * 1000)})
    #: max.message.bytes: a dead letter is the original message plus llmq's headers.
    dlq_config: dict[str, str] = field(default_factory=lambda: {"retention.ms": str(30 * 24 * 3600 * 1000),
                                                                "max.message.bytes": str(8 * 1024 * 1024 + 65536)})
    #: A day: chunks are for live streams; the terminal response keeps the whole answer.
    chunk_config: dict[str, str] = field(default_factory=lambda: {"retention.ms": str(24 * 3600 * 1000)})
    #: Completion receipts (see :attr:`receipts`): a day is far longer than any gateway is down.
    receipt_config: dict[str, str] = field(default_factory=lambda: {"retention.ms": str(24 * 3600 * 1000)})
    #: The Batch API's files (chunked) and batch records (pipeline/batch/): compacted, one record
    #: per key, removed by tombstones when a file is deleted or a batch's results pass
    #: batch.retention_s. max.message.bytes: one chunk (batch.chunk_bytes) and its key.
    batch_partitions: int = 3
    batch_config: dict[str, str] = field(default_factory=lambda: {
        "cleanup.policy": "compact", "max.message.bytes": str(2 * 1024 * 1024)})
    #: The Responses API's stored responses (pipeline/responses/): one record per response id,
    #: its latest state. compact,delete: a response is kept retention.ms after its last write
    #: (OpenAI keeps stored responses 30 days), then dropped. max.message.bytes: a response with
    #: its input and output (a chain's turns are records of their own).
    stored_response_partitions: int = 3
    stored_response_config: dict[str, str] = field(default_factory=lambda: {
        "cleanup.policy": "compact,delete", "retention.ms": str(30 * 24 * 3600 * 1000),
        "max.message.bytes": str(8 * 1024 * 1024)})

    @property
    def min_isr(self) -> int:
        return self.min_insync_replicas or min_insync_replicas(self.replication_factor)

    def request_topic(self, priority: Priority) -> str:
        return f"{self.prefix}.requests.{priority.value.lower()}"

    @property
    def request_topics(self) -> list[str]:
        return [self.request_topic(p) for p in Priority]

    def pool_topics(self, pool: str, source: str = "requests") -> list[str]:
        """The topics a worker of ``pool`` consumes: the gateway's dispatch topics, or the
        request topics themselves in the gateway-less set-up."""
        topic = self.dispatch_topic if source == "dispatch" else self.request_topic
        return [topic(Priority(band)) for band in DEFAULT_POOLS[pool]]

    def dispatch_topic(self, priority: Priority) -> str:
        return f"{self.prefix}.dispatch.{priority.value.lower()}"

    @property
    def dispatch_topics(self) -> list[str]:
        return [self.dispatch_topic(p) for p in Priority]

    @property
    def responses(self) -> str:
        return f"{self.prefix}.responses"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    @property
    def cancellations(self) -> str:
        return f"{self.prefix}.cancellations"

    @property
    def chunks(self) -> str:
        """Streamed chunks of answers, keyed by request id, in the partition its answer goes to
        (the client's reply partition, else the tenant's), so as many partitions as the
        responses: a client reads the same partition number of both."""
        return f"{self.prefix}.chunks"

    @property
    def chunk_partitions(self) -> int:
        return self.response_partitions

    @property
    def receipts(self) -> str:
        """Where a worker says a dispatched request finished, when its answer went elsewhere
        than the tenant's partition of the responses (a reply topic, a client's own reply
        partition): the gateway reads its tenants' partitions of both to free their quotas.
        Keyed by tenant, with the request topics' partition count (co-partitioned)."""
        return f"{self.prefix}.receipts"

    @property
    def files(self) -> str:
        """Batch API files: a metadata record and chunks per file (pipeline/batch/files.py)."""
        return f"{self.prefix}.files"

    @property
    def batches(self) -> str:
        """Batch API batches: one record per batch, its latest state (pipeline/batch/record.py)."""
        return f"{self.prefix}.batches"

    @property
    def stored_responses(self) -> str:
        """Responses API: one record per response, its latest state (pipeline/responses/record.py)."""
        return f"{self.prefix}.stored-responses"

    def validate(self) -> None:
        for key in ("batch_partitions", "stored_response_partitions", "request_partitions", "response_partitions", "dlq_partitions", "cancellation_partitions",
                    "replication_factor"):
            positive(f"topics.{key}", getattr(self, key))
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ConfigError("topics.prefix", "must be a non-empty name without spaces")
        positive("topics.dispatch_partitions", self.dispatch_partitions)
        if not 0 <= self.min_insync_replicas <= self.replication_factor:
            raise ConfigError("topics.min_insync_replicas",
                              f"must be 0 (automatic) or at most topics.replication_factor ({self.replication_factor})")
