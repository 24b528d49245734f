"""The one exception tree of llmq.

Every error the package raises on purpose derives from :class:`LlmqError`, so callers
can catch llmq failures without catching programming errors. Errors from
confluent-kafka and fastavro are wrapped with the context a user needs (which topic,
which request, which schema) and keep the original as ``__cause__``.
"""

from __future__ import annotations


class LlmqError(Exception):
    """Base class of every error llmq raises deliberately."""


class ConfigError(LlmqError):
    """A setting is missing or invalid; the message names the key."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"invalid configuration {key!r}: {problem}")


class BrokerError(LlmqError):
    """The local Kafka broker could not be fetched, formatted, started or stopped."""


class KafkaOperationError(LlmqError):
    """A Kafka client operation failed.

    ``kafka_error`` is the ``confluent_kafka.KafkaError`` (or ``None`` for errors
    raised by llmq itself, such as a delivery timeout).
    """

    def __init__(self, operation: str, detail: str, kafka_error=None):
        self.operation = operation
        self.kafka_error = kafka_error
        self.retriable = bool(kafka_error is not None and kafka_error.retriable())
        self.fatal = bool(kafka_error is not None and kafka_error.fatal())
        super().__init__(f"{operation} failed: {detail}")


class AuthenticationError(KafkaOperationError):
    """The broker refused the credentials (wrong user or password, or the wrong mechanism)."""


class TopicMismatchError(LlmqError):
    """An existing topic's layout differs from the configured one."""


class SerdeError(LlmqError):
    """Base class of encoding and decoding failures."""


class EncodeError(SerdeError):
    """A record could not be encoded against its schema."""

    @property
    def refusal(self) -> str:
        """The reason to answer its sender with (REJECTED, HTTP 400): what is wrong, the limit
        named when it is one, without the record's id."""
        return "invalid_request: " + str(self).split(": ", 1)[-1]


class DecodeError(SerdeError):
    """Bytes could not be decoded into a record.

    ``reason`` is a short machine-friendly code (``bad_magic``, ``unknown_fingerprint``,
    ``unknown_schema_id``, ``truncated``, ``too_large``, ``limit_exceeded``,
    ``malformed``, ``invalid_field``) used in DLQ headers and metrics.
    """

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


class LimitExceeded(DecodeError):
    """A field over its :class:`~pipeline.serde.limits.SerdeLimits` cap (reason ``limit_exceeded``).

    ``field`` is where it sits (``LLMRequest.prompt``, ``LLMRequest.messages[].content``,
    ``LLMRequest.metadata value``), ``size`` what the message claims for it in ``unit``
    (``bytes``, ``items`` or ``entries``), ``cap`` the most allowed and ``limit`` the name of
    the setting behind it.

    ``request`` is set by :meth:`~pipeline.serde.codec.Codec.decode_request` when the request
    is readable all the same (see there), so that it can be answered, REJECTED with
    :attr:`refusal`, rather than dead-lettered; None when it is not.
    """

    _SINGULAR = {"bytes": "byte", "items": "item", "entries": "entry"}

    def __init__(self, detail: str, *, field: str, size: int, unit: str, cap: int, limit: str):
        super().__init__("limit_exceeded", detail)
        self.field = field
        self.size = size
        self.unit = unit
        self.cap = cap
        self.limit = limit
        self.request = None

    @property
    def refusal(self) -> str:
        """The reason to answer with: ``invalid_request`` (a client error, HTTP 400), naming the
        field and the limit. Never a map key: that is the sender's text."""
        name = self.field.split(".", 1)[-1]
        over = f"over the {self.cap}-{self._SINGULAR.get(self.unit, self.unit)} limit ({self.limit})"
        if self.unit == "bytes":
            return f"invalid_request: {name} is {self.size} bytes, {over}"
        return f"invalid_request: {name} has {self.size} {self.unit}, {over}"


class SchemaNotFoundError(DecodeError):
    """The writer schema named by a fingerprint or registry id is unknown."""


class RequestTimeoutError(LlmqError):
    """No response arrived for a request within the caller's timeout."""

    def __init__(self, request_id: str, timeout_s: float):
        self.request_id = request_id
        super().__init__(f"no response for request {request_id} within {timeout_s:.1f}s")


class BackendError(LlmqError):
    """A model backend failed a call; ``retriable`` says whether another try may help."""

    def __init__(self, detail: str, retriable: bool = False):
        self.retriable = retriable
        super().__init__(detail)
