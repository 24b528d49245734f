"""The OpenAI chat-completions wire format, with no I/O: request bodies, answers, SSE, errors.

What a server says back is quoted in error messages only after it is cut down to one
short line with anything that looks like a filesystem path taken out: servers put
tracebacks in their error bodies (llama-cpp-python's 500s do), and a FAILED answer
goes back to a tenant.
"""

from __future__ import annotations

import json
import re
from email.utils import parsedate_to_datetime
from typing import Any, Iterable, Mapping

from pipeline.models import Request
from pipeline.policy.tokens import estimate_tokens
from pipeline.worker.backends.base import Completion, Piece, Usage

#: Request fields a later schema revision adds; sent when the request has them and they are set.
SAMPLING_FIELDS = ("temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty")
MAX_REASON_CHARS = 200
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@+~-]+){2,}[\\/]?")
_SPACE = re.compile(r"\s+")


class WireError(Exception):
    """A 200 answer whose body is not what the protocol says (or an error event in a stream)."""

    def __init__(self, reason: str, retriable: bool = False):
        self.retriable = retriable
        super().__init__(reason)


def messages_of(request: Request) -> list[dict[str, Any]]:
    """The request's ``messages`` when it has some, else one user message holding its prompt."""
    messages = getattr(request, "messages", None)
    if not messages:
        return [{"role": "user", "content": request.prompt}]
    out = []
    for m in messages:
        if isinstance(m, Mapping):
            out.append({k: v for k, v in m.items() if v is not None})
        else:  # a record object with role/content attributes
            entry = {"role": m.role, "content": m.content}
            name = getattr(m, "name", None)
            if name:
                entry["name"] = name
            out.append(entry)
    return out


def chat_body(request: Request, *, stream: bool, defaults: Mapping[str, Any] | None = None,
              model: str | None = None) -> dict[str, Any]:
    """``model``: the name the server knows the request's model by (an alias resolved)."""
    body: dict[str, Any] = dict(defaults or {})
    for name in SAMPLING_FIELDS:
        value = getattr(request, name, None)
        if value is not None and value != []:
            body[name] = value
    body["model"] = model or request.model
    body["max_tokens"] = request.max_tokens
    body["messages"] = messages_of(request)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def prompt_token_estimate(body: Mapping[str, Any]) -> int:
    text = []
    for m in body.get("messages") or ():
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        text.append(f"{m.get('role', '')}: {content or ''}")
    return estimate_tokens("\n".join(text))


def completion_from_json(data: Any, request: Request) -> Completion:
    """A whole (non-streamed) chat completion; raises :class:`WireError` when it is not one."""
    try:
        choice = data["choices"][0]
        message = choice.get("message") or {}
        output = message.get("content")
        if output is None:
            output = choice.get("text") or ""
        usage = data.get("usage") or {}
        estimated = "completion_tokens" not in usage
        prompt_tokens = int(usage.get("prompt_tokens", 0))
        completion_tokens = int(usage.get("completion_tokens", 0)) if not estimated else estimate_tokens(output)
        # The name the caller asked for, not the server's (an alias stays the caller's name).
        return Completion(str(output), prompt_tokens, completion_tokens, request.model,
                          finish_reason=choice.get("finish_reason"), usage_estimated=estimated)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise WireError(f"unexpected response body ({type(exc).__name__}): {quote(_dump(data))}") from None


class StreamAssembler:
    """Turns the ``data:`` payloads of an SSE stream into :class:`Piece` s.

    :meth:`feed` takes one event's data and returns the chunk it carries (or None);
    :meth:`finish` returns the closing chunk with ``finish_reason`` and usage (the
    server's, else an estimate: one token per content chunk, as servers send them).
    """

    def __init__(self, prompt_tokens_estimate: int):
        self.prompt_estimate = prompt_tokens_estimate
        self.count = 0
        self.events = 0
        self.content_chunks = 0
        self.finish_reason: str | None = None
        self.usage: Mapping[str, Any] | None = None
        self.model: str | None = None
        self.done = False

    def feed(self, data: str) -> Piece | None:
        self.events += 1
        if data.strip() == "[DONE]":
            self.done = True
            return None
        try:
            event = json.loads(data)
        except ValueError:
            raise WireError(f"unexpected stream event: {quote(data)}") from None
        if not isinstance(event, dict):
            raise WireError(f"unexpected stream event: {quote(data)}")
        if "error" in event:
            err = event["error"]
            code = err.get("code") if isinstance(err, dict) else None
            retriable = not (isinstance(code, int) and 400 <= code < 500)
            raise WireError(f"the server failed mid-stream: {error_detail(event)}", retriable=retriable)
        if event.get("usage"):
            self.usage = event["usage"]
        if event.get("model"):
            self.model = str(event["model"])
        text = ""
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if piece:
                text += piece
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if not text:
            return None
        self.content_chunks += 1
        chunk = Piece(self.count, text)
        self.count += 1
        return chunk

    @property
    def complete(self) -> bool:
        """Whether the stream ended as the protocol ends one (not cut off half-way)."""
        return self.done or self.finish_reason is not None

    def finish(self) -> Piece:
        usage = self.usage or {}
        if "completion_tokens" in usage:
            final = Usage(int(usage.get("prompt_tokens", 0)), int(usage["completion_tokens"]))
        else:
            final = Usage(int(usage.get("prompt_tokens", self.prompt_estimate)), self.content_chunks, estimated=True)
        chunk = Piece(self.count, "", self.finish_reason, final)
        self.count += 1
        return chunk


def sse_events(lines: Iterable[str]):
    """The data of each server-sent event in ``lines`` (a helper for tests and sync callers)."""
    parser = SseParser()
    for line in lines:
        data = parser.line(line)
        if data is not None:
            yield data
    tail = parser.end()
    if tail is not None:
        yield tail


class SseParser:
    """Server-sent events, line by line: ``data:`` lines up to a blank line make one event."""

    #: The longest line kept while waiting for its end: a server that never ends one is broken.
    MAX_LINE_BYTES = 1 << 20

    def __init__(self):
        self._data: list[str] = []
        self._partial = b""

    def feed(self, data: bytes) -> list[str]:
        """The events completed by ``data``, a piece of the body as it came off the socket.

        One read often holds a whole event: splitting it here costs the event loop one await
        per read, where reading line by line costs one (and a timeout) per line.
        """
        lines = (self._partial + data).split(b"\n") if self._partial else data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > self.MAX_LINE_BYTES:
            raise WireError(f"an event-stream line longer than {self.MAX_LINE_BYTES} bytes")
        events = []
        for raw in lines:
            # "\n" never occurs inside a UTF-8 sequence, so a whole line decodes on its own.
            event = self.line(raw.decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> str | None:
        """The body ended: its last line, if it had no newline, and the event it ends."""
        if self._partial:  # not blank (else it would have ended in a newline): it ends nothing itself
            partial, self._partial = self._partial, b""
            self.line(partial.decode("utf-8", "replace"))
        return self.end()

    def line(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.end()
        if line.startswith(":"):  # a comment (keep-alive pings)
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def end(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


def error_detail(payload: Any) -> str:
    """The message of an OpenAI-style error body (or of whatever the server sent), quoted safely."""
    message: Any = payload
    if isinstance(payload, dict):
        message = payload.get("error", payload.get("message", payload.get("detail", payload)))
        if isinstance(message, dict):
            message = message.get("message", message.get("detail", message))
    if not isinstance(message, str):
        message = _dump(message)
    return quote(message)


def error_reason(status: int, body: bytes | str) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        detail = error_detail(json.loads(text))
    except ValueError:
        detail = quote(text)
    return f"HTTP {status}: {detail}" if detail else f"HTTP {status}"


def quote(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """One line of at most ``limit`` characters with file paths replaced by ``<path>``."""
    first = text.strip().split("\n", 1)[0]
    first = _SPACE.sub(" ", _PATH.sub("<path>", first)).strip()
    return first if len(first) <= limit else first[: limit - 1] + "…"


def retry_after_s(value: str | None, now_epoch: float) -> float | None:
    """``Retry-After`` in seconds: delta-seconds or an HTTP date; None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - now_epoch)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _dump(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        return str(value)
