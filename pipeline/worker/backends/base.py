"""What a model backend is to the worker loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipeline.models import Request


@dataclass(slots=True)
class Completion:
    output: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    #: Why generation stopped ("stop", "length", ...), when the server said.
    finish_reason: str | None = None
    #: True when the server reported no usage and the token counts are llmq's estimates.
    usage_estimated: bool = False


class Backend(Protocol):
    name: str

    async def complete(self, request: Request) -> Completion:
        """Run one request; raise :class:`pipeline.errors.BackendError` on failure."""

    def complete_now(self, request: Request) -> Completion | None:
        """Answer without waiting when possible (cache hit, zero-latency simulation), else None.

        Lets the worker skip scheduling a task for work that needs no I/O.
        """

    async def close(self) -> None:
        """Release connections."""


def estimate_tokens(text: str) -> int:
    """A cheap prompt-token estimate (≈4 characters per token for English BPE vocabularies)."""
    return max(1, (len(text) + 3) // 4)
