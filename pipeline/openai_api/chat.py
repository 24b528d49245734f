"""OpenAI's request and response shapes, to and from llmq's records. Pure, no I/O.

Requests: the bodies of ``POST /v1/chat/completions`` (``messages``) and ``POST /v1/completions``
(``prompt``) become the fields of a :class:`~pipeline.models.Request`. What llmq cannot honour
and that would change the answer's shape (``n`` > 1, tools, functions, logprobs) is refused with
400; sampling knobs llmq does not carry (``seed``, penalties, ``logit_bias``,
``response_format``) are accepted and ignored, as many OpenAI-compatible servers do.
``prompt_cache_key`` is carried to the worker in the request's metadata (under
``llmq.prompt_cache_key``, no schema change), where it places requests that share it on the
same model server (docs/workers.md, "Routing by cache").

Answers: a COMPLETED :class:`~pipeline.models.Response` becomes a ``chat.completion`` or a
``text_completion``; :class:`~pipeline.models.Chunk` s become ``chat.completion.chunk`` /
``text_completion`` stream events. Ids are the request id with OpenAI's prefixes
(``chatcmpl-<uuid>``, ``cmpl-<uuid>``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pipeline.models import Chunk, Priority, Response
from pipeline.openai_api.errors import bad_request

CHAT = "chat"
COMPLETION = "completion"

#: Refused: they change what the answer looks like, and llmq cannot produce it.
_UNSUPPORTED = ("tools", "functions", "tool_choice", "function_call", "logprobs", "top_logprobs", "audio",
                "prediction")
_MAX_METADATA = 16
#: Where a request carries its prompt_cache_key (pipeline/worker/backends/affinity.py reads it).
CACHE_KEY_METADATA = "llmq.prompt_cache_key"
_MAX_CACHE_KEY = 1024


@dataclass
class Parsed:
    """A request body, checked: the fields it sets on the Request, and serve's own options."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    priority: Priority | None = None
    model: str = ""


def _text_content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content: only text parts are supported",
                                  f"messages[{index}].content")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        raise bad_request(f"messages[{index}].content is required", f"messages[{index}].content")
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts",
                      f"messages[{index}].content")


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a role and content", f"messages[{i}]")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad_request(f"messages[{i}]: {sorted(extra)[0]} is not supported (role, content and name are)",
                              f"messages[{i}]")
        msg = {"role": m["role"], "content": _text_content(m.get("content"), i)}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise bad_request(f"messages[{i}].name must be a string", f"messages[{i}].name")
            msg["name"] = m["name"]
        out.append(msg)
    return out


def number(body: dict, key: str) -> float | None:
    """``body[key]`` as a float (None when absent); 400 naming it when it is not a number."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{key} must be a number", key)
    return float(value)


def _metadata(body: dict) -> tuple[dict[str, str], Priority | None]:
    meta = body.get("metadata")
    if meta is None:
        return {}, None
    if not isinstance(meta, dict) or len(meta) > _MAX_METADATA:
        raise bad_request(f"metadata must be an object of at most {_MAX_METADATA} string values", "metadata")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad_request("metadata values must be strings", "metadata")
    meta = dict(meta)
    priority = meta.pop("priority", None)
    return meta, None if priority is None else parse_priority(priority, "metadata.priority")


def parse_priority(text: str, param: str) -> Priority:
    try:
        return Priority.parse(text)
    except ValueError:
        raise bad_request(f"{param} must be one of {', '.join(Priority.__members__)}", param) from None


def parse_body(body: Any, kind: str, default_max_tokens: int) -> Parsed:
    """The checked body of a chat (``CHAT``) or completion (``COMPLETION``) request. A body that
    names no model runs on the default model (pipeline/catalog/), as the servers list it."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, False, [], 0):
            raise bad_request(f"{key} is not supported by llmq", key, "unsupported_parameter")
    n = body.get("n")
    if n not in (None, 1):
        raise bad_request("n must be 1 (llmq answers once per request)", "n", "unsupported_parameter")
    model = body.get("model")
    if model is None:
        model = ""
    elif not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    fields: dict[str, Any] = {}
    if kind == CHAT:
        fields["messages"] = _messages(body)
        fields["prompt"] = None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("prompt must be a non-empty string (one prompt per request)", "prompt")
        fields["prompt"] = prompt
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise bad_request("max_tokens must be a positive integer", "max_tokens")
    fields["max_tokens"] = max_tokens
    for key in ("temperature", "top_p"):
        value = number(body, key)
        if value is not None:
            fields[key] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop must be a string or a list of strings", "stop")
        fields["stop"] = stop
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise bad_request("user must be a string", "user")
        fields["user"] = user
    meta, priority = _metadata(body)
    cache_key = body.get("prompt_cache_key")
    if cache_key is not None:
        if not isinstance(cache_key, str) or len(cache_key) > _MAX_CACHE_KEY:
            raise bad_request(f"prompt_cache_key must be a string of at most {_MAX_CACHE_KEY} characters",
                              "prompt_cache_key")
        if cache_key:
            meta[CACHE_KEY_METADATA] = cache_key
    if meta:
        fields["metadata"] = meta
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    return Parsed(kind, fields, stream, bool(options.get("include_usage")), priority, model)


# -- answers -------------------------------------------------------------------------------------


def completion_id(kind: str, request_id: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + request_id


def usage(resp: Response) -> dict[str, int]:
    return {"prompt_tokens": resp.prompt_tokens, "completion_tokens": resp.completion_tokens,
            "total_tokens": resp.prompt_tokens + resp.completion_tokens}


def render(kind: str, resp: Response, model: str) -> dict[str, Any]:
    """The body of a COMPLETED answer."""
    finish = resp.finish_reason or "stop"
    created = resp.finished_at // 1000
    if kind == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": resp.output or ""}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": resp.output or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": completion_id(kind, resp.request_id), "object": obj, "created": created,
            "model": resp.model or model, "choices": [choice], "usage": usage(resp), "system_fingerprint": None}


def chunk_event(kind: str, request_id: str, model: str, created: int, *, delta: str | None = None,
                finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
    if kind == CHAT:
        d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if delta:
            d["content"] = delta
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": completion_id(kind, request_id), "object": obj, "created": created, "model": model,
            "choices": [choice], "system_fingerprint": None}


def chunk_events(kind: str, chunk: Chunk, model: str, created: int) -> list[dict[str, Any]]:
    """A chunk as stream events: its text, and (the last one) its finish_reason in an event of
    its own when it carries text too, as OpenAI's streams end."""
    if not chunk.last:
        return [chunk_event(kind, chunk.request_id, model, created, delta=chunk.delta)] if chunk.delta else []
    out = []
    if chunk.delta:
        out.append(chunk_event(kind, chunk.request_id, model, created, delta=chunk.delta))
    out.append(chunk_event(kind, chunk.request_id, model, created, finish_reason=chunk.finish_reason))
    return out


def usage_event(kind: str, resp: Response, model: str, created: int) -> dict[str, Any]:
    event = chunk_event(kind, resp.request_id, resp.model or model, created)
    event["choices"] = []
    event["usage"] = usage(resp)
    return event


def sse(event: dict[str, Any] | str) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def status_name(resp: Response | None) -> str:
    return "submitted" if resp is None else resp.status.value.lower()


def models_list(models: list[str], created: int = 0) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": created, "owned_by": "llmq"}
                                       for m in models]}
