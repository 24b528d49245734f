"""A simulated model: deterministic output and configurable latency, so the pipeline runs anywhere."""

from __future__ import annotations

import asyncio
import hashlib

from pipeline.models import Request
from pipeline.worker.backends.base import Completion, estimate_tokens

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
          "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa")


class SimulatedBackend:
    """Latency = ``latency_ms`` + ``ms_per_token`` × completion tokens.

    The output depends only on the request (model, prompt, max_tokens), so tests can
    check that a response belongs to its request.
    """

    name = "simulated"

    def __init__(self, latency_ms: float = 0.0, ms_per_token: float = 0.0, max_output_tokens: int = 16):
        self.latency_ms = latency_ms
        self.ms_per_token = ms_per_token
        self.max_output_tokens = max_output_tokens

    def _answer(self, request: Request) -> Completion:
        n = max(1, min(request.max_tokens, self.max_output_tokens))
        digest = hashlib.blake2b(f"{request.model}\0{request.prompt}".encode(), digest_size=16).digest()
        words = [_WORDS[digest[i % 16] % len(_WORDS)] for i in range(n)]
        return Completion(" ".join(words), estimate_tokens(request.prompt), n, request.model)

    def delay_s(self, request: Request) -> float:
        n = max(1, min(request.max_tokens, self.max_output_tokens))
        return (self.latency_ms + self.ms_per_token * n) / 1000.0

    def complete_now(self, request: Request) -> Completion | None:
        if self.latency_ms == 0 and self.ms_per_token == 0:
            return self._answer(request)
        return None

    async def complete(self, request: Request) -> Completion:
        await asyncio.sleep(self.delay_s(request))
        return self._answer(request)

    async def close(self) -> None:
        return None


def expected_output(request: Request, max_output_tokens: int = 16) -> str:
    """What the simulated model answers to ``request`` (for tests and demos)."""
    return SimulatedBackend(max_output_tokens=max_output_tokens)._answer(request).output
