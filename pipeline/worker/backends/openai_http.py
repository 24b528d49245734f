"""An OpenAI-compatible chat-completions backend (OpenAI, vLLM, TGI, llama.cpp server, ...).

One pooled HTTP/1.1 client per worker; each call has a timeout that never outlives the
request's own deadline. 429 and 5xx answers, timeouts and connection errors are retried
with exponential backoff and jitter (honouring ``Retry-After``); anything else, or the last
failed attempt, raises :class:`BackendError` and the worker answers FAILED with the reason.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from pipeline.errors import BackendError
from pipeline.models import Request
from pipeline.worker.backends.base import Completion

_RETRIABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class OpenAIBackend:
    name = "openai"

    def __init__(self, base_url: str, api_key: str = "", *, timeout_s: float = 60.0, max_attempts: int = 3,
                 backoff_s: float = 0.5, max_connections: int = 64):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = backoff_s
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))

    def complete_now(self, request: Request) -> Completion | None:
        return None

    async def complete(self, request: Request) -> Completion:
        body = {"model": request.model, "max_tokens": request.max_tokens,
                "messages": [{"role": "user", "content": request.prompt}]}
        deadline = (request.created_at + request.timeout_ms) / 1000.0
        last: BackendError | None = None
        for attempt in range(1, self.max_attempts + 1):
            remaining = deadline - time.time()
            if remaining <= 0:
                break
            wait = None
            try:
                resp = await self._client.post("/chat/completions", json=body,
                                               timeout=min(self.timeout_s, remaining))
            except httpx.TimeoutException:
                last = BackendError(f"timed out after {min(self.timeout_s, remaining):.1f}s", retriable=True)
            except httpx.TransportError as exc:
                last = BackendError(f"connection error: {type(exc).__name__}: {exc}", retriable=True)
            else:
                if resp.status_code == 200:
                    return self._parse(resp, request)
                detail = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.status_code not in _RETRIABLE_STATUS:
                    raise BackendError(detail, retriable=False)
                last = BackendError(detail, retriable=True)
                wait = _retry_after(resp)
            if attempt < self.max_attempts:
                backoff = self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
                await asyncio.sleep(min(wait if wait is not None else backoff, 30.0, max(0.0, deadline - time.time())))
        if last is None:
            raise BackendError("the request's deadline passed before the model answered", retriable=False)
        raise BackendError(f"{last} (after {attempt} attempt{'s' if attempt > 1 else ''})", retriable=False)

    @staticmethod
    def _parse(resp: httpx.Response, request: Request) -> Completion:
        try:
            data = resp.json()
            output = data["choices"][0]["message"]["content"] or ""
            usage = data.get("usage") or {}
            return Completion(output, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)),
                              str(data.get("model") or request.model))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise BackendError(f"unexpected response body ({type(exc).__name__}): {resp.text[:200]}") from None

    async def close(self) -> None:
        await self._client.aclose()


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
