"""A simulated model: deterministic output and configurable latency, so the pipeline runs anywhere."""

from __future__ import annotations

import asyncio
import zlib

from pipeline.models import Request
from pipeline.policy.tokens import estimate_tokens
from pipeline.worker.backends.base import Completion

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
          "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa")
_VARIANTS = 256
# A request may ask the simulated model for its own latency (fault injection: `make chaos`
# sends a call slower than max.poll.interval.ms). Capped, so a client cannot park a worker.
LATENCY_METADATA_KEY = "sim.latency_ms"
MAX_REQUESTED_LATENCY_MS = 600_000


def _sentence_prefixes(seed: int, length: int) -> tuple[str, ...]:
    words = [_WORDS[(seed * 7 + i * 13 + (seed >> 3) * i) % len(_WORDS)] for i in range(length)]
    return tuple(" ".join(words[:n]) for n in range(length + 1))


#: The names the simulated model lists; it answers any other name too.
SIMULATED_MODELS = ("sim-small", "sim-large")


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
        # Answers are precomputed word sequences picked by a checksum of the request:
        # deterministic across processes, and cheap enough not to distort benchmarks.
        self._answers = [_sentence_prefixes(i, max_output_tokens) for i in range(_VARIANTS)]
        self._model_crc: dict[str, int] = {}  # model name -> its CRC, the seed of the prompt's

    def answer(self, request: Request) -> Completion:
        """The answer ``request`` gets, at once: the same for the same model, prompt and max_tokens."""
        n = request.max_tokens
        if n > self.max_output_tokens:
            n = self.max_output_tokens
        elif n < 1:
            n = 1
        model = request.model or SIMULATED_MODELS[0]
        seed = self._model_crc.get(model)
        if seed is None:
            seed = zlib.crc32(model.encode())
            if len(self._model_crc) < 1024:
                self._model_crc[model] = seed
        prompt = request.prompt
        variant = zlib.crc32(prompt.encode(), seed) % _VARIANTS
        return Completion(self._answers[variant][n], estimate_tokens(prompt), n, model)

    def delay_s(self, request: Request) -> float:
        requested = _requested_latency_ms(request)
        if requested is not None:
            return requested / 1000.0
        n = max(1, min(request.max_tokens, self.max_output_tokens))
        return (self.latency_ms + self.ms_per_token * n) / 1000.0

    def complete_now(self, request: Request) -> Completion | None:
        if self.latency_ms == 0 and self.ms_per_token == 0 and LATENCY_METADATA_KEY not in request.metadata:
            return self.answer(request)
        return None

    async def complete(self, request: Request) -> Completion:
        await asyncio.sleep(self.delay_s(request))
        return self.answer(request)

    async def stream(self, request: Request):
        """The same answer word by word: the first after ``latency_ms``, each next one
        ``ms_per_token`` later (the whole stream takes what :meth:`complete` takes), then a
        last piece with the finish reason and usage, as the OpenAI backend's streams end."""
        from pipeline.worker.backends.base import Piece, Usage

        answer = self.answer(request)
        requested = _requested_latency_ms(request)
        words = answer.output.split(" ") if answer.output else []
        first_s = (requested if requested is not None else self.latency_ms) / 1000.0
        gap_s = 0.0 if requested is not None else self.ms_per_token / 1000.0
        for i, word in enumerate(words):
            await asyncio.sleep(first_s + gap_s if i == 0 else gap_s)
            yield Piece(i, word if i == 0 else " " + word)
        finish = "length" if answer.completion_tokens == request.max_tokens else "stop"
        yield Piece(len(words), "", finish, Usage(answer.prompt_tokens, answer.completion_tokens))

    def default_model(self) -> str:
        return SIMULATED_MODELS[0]

    async def served_models(self) -> tuple[list[str], str, bool]:
        """What it lists, its default, and that it answers any other name too."""
        return list(SIMULATED_MODELS), SIMULATED_MODELS[0], True

    async def close(self) -> None:
        return None


def _requested_latency_ms(request: Request) -> float | None:
    raw = request.metadata.get(LATENCY_METADATA_KEY) if request.metadata else None
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    if not value >= 0:  # also NaN
        return None
    return min(value, MAX_REQUESTED_LATENCY_MS)


def expected_output(request: Request, max_output_tokens: int = 16) -> str:
    """What the simulated model answers to ``request`` (for tests and demos)."""
    return SimulatedBackend(max_output_tokens=max_output_tokens).answer(request).output
