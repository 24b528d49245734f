"""[batch]: OpenAI's Batch API in ``llmq serve`` (pipeline/batch/, pipeline/serve/batch_api.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.fields import positive
from pipeline.errors import ConfigError
from pipeline.models import Priority


@dataclass
class BatchSettings:
    #: ``llmq serve`` answers /v1/files and /v1/batches and drives the batches it owns.
    enabled: bool = True
    #: Largest input file, and most lines in one (OpenAI's own limits: 200 MB, 50,000 lines). The
    #: driver keeps a running batch's parsed lines in memory.
    max_file_bytes: int = 200 * 1024 * 1024
    max_file_lines: int = 50_000
    #: Files are stored in Kafka in records of this size (under topics.batch_config's max.message.bytes).
    chunk_bytes: int = 512 * 1024
    #: Lines of one batch submitted and not yet answered, at most. Enough to keep every model
    #: slot of the batch's pool busy; the rest wait in the batch, not in the request topics, so
    #: a cancel or an expiry has little to take back.
    max_outstanding: int = 1024
    #: The band of a batch's lines; a batch may ask for LOW in metadata.priority when its
    #: tenant's record allows that band.
    default_priority: str = "BACKGROUND"
    #: A line's own deadline (within the batch's window). A line not started by then (the
    #: interactive bands took every slot) is submitted again, until the window closes.
    line_timeout_ms: int = 600_000
    #: Longest completion_window accepted (OpenAI's "24h"; shorter windows such as "1h" too).
    max_completion_window_s: int = 24 * 3600
    #: Finished batches, their output and error files are deleted this long after they ended.
    retention_s: int = 7 * 24 * 3600
    #: A cancelled batch waits this long for the answers of lines already started.
    cancel_grace_s: float = 30.0
    #: request_counts are published this often while a batch runs.
    progress_interval_ms: int = 1_000
    #: The consumer group whose members share the batches (their partitions of the batches
    #: topic): "" = llmq-batch.<topics.prefix>. A dead process's batches move to another
    #: member after session_timeout_ms (the broker's group.min.session.timeout.ms bounds it).
    group_id: str = ""
    session_timeout_ms: int = 10_000

    def group(self, prefix: str) -> str:
        return self.group_id or f"llmq-batch.{prefix}"

    def band(self) -> Priority:
        return Priority.parse(self.default_priority)

    def validate(self) -> None:
        for key in ("max_file_bytes", "max_file_lines", "chunk_bytes", "max_outstanding", "line_timeout_ms",
                    "max_completion_window_s", "retention_s", "progress_interval_ms", "session_timeout_ms"):
            positive(f"batch.{key}", getattr(self, key))
        if self.cancel_grace_s < 0:
            raise ConfigError("batch.cancel_grace_s", "must be >= 0")
        try:
            band = self.band()
        except ValueError:
            raise ConfigError("batch.default_priority", f"unknown band {self.default_priority!r}") from None
        if band not in (Priority.LOW, Priority.BACKGROUND):
            raise ConfigError("batch.default_priority", "batches run in LOW or BACKGROUND")
