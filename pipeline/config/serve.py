"""[serve]: ``llmq serve``, the OpenAI-compatible HTTP front door (pipeline/serve/)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.fields import positive
from pipeline.errors import ConfigError


def parse_partitions(key: str, text: str) -> list[int] | None:
    """``"auto"``/``""`` → None (one chosen at start); ``"3"``, ``"0,2"``, ``"4-7"`` → the list."""
    text = text.strip()
    if text in ("", "auto"):
        return None
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ConfigError(key, f"expected auto, N, N,M or N-M, got {text!r}") from None
    if any(p < 0 for p in out):
        raise ConfigError(key, "partitions are >= 0")
    return sorted(set(out))


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    #: The partitions of the response and chunk topics this process reads, and names as
    #: ``reply_partition`` in every request it writes. Give each serve process its own (a
    #: StatefulSet ordinal, say): "auto" picks one at random at start, which two processes may
    #: share (each still only takes its own answers, but reads the other's too).
    reply_partitions: str = "auto"
    #: A request's deadline when the caller names none (x-llmq-timeout-ms); callers may ask for
    #: up to max_timeout_ms (the gateway's own cap still applies).
    default_timeout_ms: int = 60_000
    max_timeout_ms: int = 600_000
    #: The longest a request waits for Kafka to take it (its partition's leader to acknowledge
    #: the write; shorter when the request's deadline is nearer). Past it the request is
    #: withdrawn and the caller gets 503 with Retry-After: while a leader moves or the cluster
    #: restarts, a caller retries rather than holds a connection on a write that may never land.
    submit_timeout_ms: int = 10_000
    #: max_tokens of a request whose body names none.
    default_max_tokens: int = 256
    #: POST /v1/requests waits this long for the gateway's word (QUEUED with position and ETA,
    #: or a refusal answered with its status at once) before it answers 202 without it.
    accept_wait_ms: int = 2_000
    #: linger.ms of the process's producer: requests wait this long to be sent together.
    producer_linger_ms: int = 1
    #: On SIGTERM: stop accepting, let requests in flight finish for this long, then answer 503.
    shutdown_grace_s: float = 10.0
    #: Requests waiting for their answers at once; beyond it, 429 overloaded.
    max_inflight: int = 10_000
    #: Largest request body accepted.
    max_body_bytes: int = 4 * 1024 * 1024
    #: POST /v1/requests: how long (and how many) answers are kept for GET /v1/requests/{id}.
    result_ttl_s: float = 3_600.0
    result_max: int = 100_000
    #: A comment line on an open event stream this often, so proxies keep it open.
    stream_heartbeat_s: float = 15.0
    #: One log line per HTTP request (off: logs stay quiet under load).
    access_log: bool = False

    def reply_partition_list(self) -> list[int] | None:
        return parse_partitions("serve.reply_partitions", self.reply_partitions)

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError("serve.port", f"must be a TCP port, got {self.port}")
        self.reply_partition_list()
        for key in ("default_max_tokens", "default_timeout_ms", "max_timeout_ms", "submit_timeout_ms", "max_inflight", "max_body_bytes", "result_ttl_s",
                    "result_max", "stream_heartbeat_s"):
            positive(f"serve.{key}", getattr(self, key))
        if self.default_timeout_ms > self.max_timeout_ms:
            raise ConfigError("serve.default_timeout_ms", "must be <= serve.max_timeout_ms")
        if self.accept_wait_ms < 0 or self.producer_linger_ms < 0:
            raise ConfigError("serve.accept_wait_ms", "accept_wait_ms and producer_linger_ms must be >= 0")
        if self.shutdown_grace_s < 0:
            raise ConfigError("serve.shutdown_grace_s", "must be >= 0")
