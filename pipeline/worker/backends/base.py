"""What a model backend is to the worker: the calls every backend answers, and the two
capabilities some have (streaming, and pacing their servers' slots), which the worker looks for
once, when it is given the backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, runtime_checkable

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


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    #: True when the server did not report usage and these are llmq's estimates.
    estimated: bool = False


@dataclass(slots=True, frozen=True)
class Piece:
    """One piece of a model's streamed answer. ``index`` counts from 0 in the order of arrival;
    the last piece of every stream has ``finish_reason`` and ``usage`` set (and often no text).
    (The worker publishes each as a ``pipeline.models.Chunk`` record.)"""

    index: int
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None

    @property
    def last(self) -> bool:
        return self.usage is not None


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


@runtime_checkable
class CatalogedBackend(Protocol):
    """A backend that can say which model names it serves (pipeline/catalog/)."""

    def default_model(self) -> str:
        """What a request that names no model runs on ("" when not known yet)."""

    async def served_models(self) -> tuple[list[str], str, bool]:
        """Read what its servers serve: the names requests may use, the default model, and
        whether it may serve names it did not list."""


@runtime_checkable
class StreamingBackend(Protocol):
    """A backend that can hand out an answer piece by piece (``"stream": true``)."""

    def stream(self, request: Request, reserved: Any = None) -> AsyncIterator[Piece]:
        """The answer's pieces as the model makes them, the last with ``usage``; closing the
        iterator stops the call."""


@runtime_checkable
class PacedBackend(Protocol):
    """A backend that knows how many calls its servers can start now: requests then wait in
    llmq's band queues, in priority order and preemptible, instead of in the servers' own
    first-come queues. A call takes a slot (``reserve``) before it starts, passed to
    ``complete``/``stream``, and gives it back (``release``) however it ends."""

    def room(self) -> int:
        """How many more calls the servers can start now."""

    def reserve(self, request: Request) -> Any | None:
        """A slot on a server of ``request``'s model, or None if all of them are full."""

    def release(self, slot: Any) -> None:
        """The call holding ``slot`` ended."""

    def same_servers(self, model: str, other: str) -> bool:
        """Whether calls for ``model`` and ``other`` take slots on the same servers."""
