"""[responses]: OpenAI's Responses API in ``llmq serve`` (pipeline/responses/, pipeline/serve/responses_api.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.fields import positive
from pipeline.errors import ConfigError
from pipeline.models import Priority


@dataclass
class ResponsesSettings:
    #: ``llmq serve`` answers /v1/responses and keeps stored responses in topics.stored_responses.
    enabled: bool = True
    #: The band of a response with ``background: true`` before its service_tier moves it: what
    #: interactive traffic (NORMAL) leaves. A foreground response starts from NORMAL (or the
    #: x-llmq-priority header), as chat does.
    background_priority: str = "LOW"
    #: A background response's deadline: past it the pipeline answers EXPIRED and the response
    #: is ``failed`` (code ``expired``). The gateway's own max_timeout_ms still applies.
    background_timeout_ms: int = 600_000
    #: service_tier "flex": when the gateway's first word is a queue ETA over this, or a
    #: refusal for load (queue_full, rate_limited, ...), the response is withdrawn and answered
    #: 429 resource_unavailable with Retry-After.
    flex_wait_ms: int = 30_000
    #: How long a flex response waits for the gateway's first word before it runs anyway.
    flex_word_wait_ms: int = 2_000
    #: previous_response_id chains: at most this many earlier responses make a turn's input;
    #: a longer chain is a 400 naming previous_response_id.
    max_chain: int = 100
    #: Each serve process looks for answers to background responses whose process went away
    #: (killed, restarted) this often, reading their reply partitions of the responses topic.
    recover_interval_s: float = 5.0
    #: A pending response is looked after by others once its record is this old and no task
    #: of this process waits for it.
    recover_after_s: float = 3.0

    def band(self) -> Priority:
        return Priority.parse(self.background_priority)

    def validate(self) -> None:
        for key in ("background_timeout_ms", "flex_wait_ms", "max_chain", "recover_interval_s", "recover_after_s"):
            positive(f"responses.{key}", getattr(self, key))
        if self.flex_word_wait_ms < 0:
            raise ConfigError("responses.flex_word_wait_ms", "must be >= 0")
        try:
            self.band()
        except ValueError:
            raise ConfigError("responses.background_priority", f"must be one of {', '.join(Priority.__members__)}") \
                from None
