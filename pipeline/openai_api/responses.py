"""The Responses API's request and response bodies: ``POST /v1/responses`` checked, a stored
response rendered as OpenAI's ``response`` object, its input items, and the model input of a
``previous_response_id`` chain. Pure, no I/O.

A field llmq cannot honour is refused with 400 naming it (``param``), never dropped: tools,
reasoning, ``include``, structured ``text.format``, ``truncation: auto``, conversations, prompts
(templates), non-text content. ``stream_options`` is accepted (it only asks for obfuscation
padding, which changes no content).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.openai_api.chat import number
from pipeline.openai_api.errors import bad_request
from pipeline.policy.service_tier import TIERS
from pipeline.responses.record import COMPLETED, INCOMPLETE, StoredResponse, message_id

_ACCEPTED = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "metadata",
                       "store", "stream", "stream_options", "background", "previous_response_id", "service_tier",
                       "prompt_cache_key", "text", "user", "safety_identifier", "truncation", "tools", "tool_choice",
                       "parallel_tool_calls", "include"})
_ROLES = ("user", "assistant", "system", "developer")
_MAX_METADATA = 16


@dataclass
class CreateParams:
    model: str
    input: list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    store: bool = True
    stream: bool = False
    background: bool = False
    previous_response_id: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    user: str | None = None


def _unsupported(param: str, why: str = "is not supported by llmq"):
    return bad_request(f"{param} {why}", param, "unsupported_parameter")


def _text_of(content: Any, param: str, role: str) -> list[dict[str, Any]]:
    """Content as text parts: ``input_text`` (``output_text`` in an assistant's)."""
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    if not isinstance(content, list) or not content:
        raise bad_request(f"{param} must be a string or a non-empty list of text parts", param)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise _unsupported(f"{param}[{j}]", "must be a text part (input_text or output_text): llmq carries "
                                                "text only")
        parts.append({"type": kind, "text": part["text"]})
    return parts


def parse_input(value: Any) -> list[dict[str, Any]]:
    """``input`` as message items without ids: a string is one user message."""
    if isinstance(value, str):
        if not value:
            raise bad_request("input must not be empty", "input")
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty list of message items", "input")
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be a message item", f"input[{i}]")
        if item.get("type", "message") != "message":
            raise _unsupported(f"input[{i}].type", f"{item.get('type')!r} is not supported (only message items)")
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"input[{i}].role must be one of {', '.join(_ROLES)}", f"input[{i}].role")
        extra = set(item) - {"type", "role", "content", "id", "status"}
        if extra:
            raise _unsupported(f"input[{i}].{sorted(extra)[0]}")
        items.append({"type": "message", "role": role, "content": _text_of(item.get("content"), f"input[{i}].content",
                                                                              role)})
    return items


def _string(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{key} must be a string", key)
    return value


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be true or false", key)
    return value


def parse_create(body: Any) -> CreateParams:
    """The checked body of ``POST /v1/responses``."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    for key in body:
        if key not in _ACCEPTED:
            raise _unsupported(key)
    if body.get("tools"):
        raise _unsupported("tools")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise _unsupported("tool_choice")
    if body.get("include"):
        raise _unsupported("include")
    if body.get("truncation") not in (None, "disabled"):
        raise _unsupported("truncation", "auto is not supported by llmq (a chain is sent whole)")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or \
                (fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text")):
            raise _unsupported("text.format", "other than text is not supported by llmq (no structured output yet)")
        if text.get("verbosity") not in (None, "medium"):
            raise _unsupported("text.verbosity")
    model = _string(body, "model") or ""
    if "input" not in body:
        raise bad_request("input is required", "input")
    items = parse_input(body["input"])
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0):
        raise bad_request("max_output_tokens must be a positive integer", "max_output_tokens")
    meta = body.get("metadata") or {}
    if not isinstance(meta, dict) or len(meta) > _MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in meta.items()):
        raise bad_request("metadata must be at most 16 string pairs (keys up to 64, values up to 512 characters)",
                          "metadata")
    tier = body.get("service_tier")
    if tier is not None and tier not in TIERS:
        raise bad_request(f"service_tier must be one of {', '.join(TIERS)}", "service_tier")
    params = CreateParams(model, items, _string(body, "instructions"), max_tokens, number(body, "temperature"),
                          number(body, "top_p"), dict(meta), _flag(body, "store", True), _flag(body, "stream", False),
                          _flag(body, "background", False), _string(body, "previous_response_id"), tier,
                          _string(body, "prompt_cache_key"), _string(body, "user") or _string(body, "safety_identifier"))
    if params.background and not params.store:
        raise bad_request("background responses must be stored (store: true)", "store")
    return params


# -- the model's input -------------------------------------------------------------------------


def _flat(item: dict[str, Any]) -> dict[str, str]:
    role = "system" if item["role"] == "developer" else item["role"]
    return {"role": role, "content": "".join(p["text"] for p in item["content"])}


def model_messages(chain: list[StoredResponse], items: list[dict[str, Any]],
                   instructions: str | None) -> list[dict[str, str]]:
    """The chat messages a turn runs on: the instructions (this turn's only, as OpenAI does), each
    earlier turn's input and output, oldest first, then this turn's input."""
    out = [{"role": "system", "content": instructions}] if instructions else []
    for turn in chain:
        out += [_flat(i) for i in turn.input]
        if turn.output_text:
            out.append({"role": "assistant", "content": turn.output_text})
    out += [_flat(i) for i in items]
    return out


def with_ids(response_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as stored: each with an id of its own."""
    return [{"id": message_id(response_id, n + 1), **item} for n, item in enumerate(items)]


# -- answers ---------------------------------------------------------------------------------------


def usage(rec: StoredResponse) -> dict[str, Any] | None:
    u = rec.usage
    if u is None:
        return None
    return {"input_tokens": u.get("input_tokens", 0),
            "input_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
            "output_tokens": u.get("output_tokens", 0), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.get("input_tokens", 0) + u.get("output_tokens", 0)}


def output_item(rec: StoredResponse, text: str | None = None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": message_id(rec.id), "type": "message", "status": status, "role": "assistant", "content": content}


def render(rec: StoredResponse, status: str | None = None) -> dict[str, Any]:
    """The ``response`` object of ``rec`` (``status`` overrides its own, for stream snapshots)."""
    status = status or rec.status
    ended = status in (COMPLETED, INCOMPLETE)
    output = [output_item(rec, rec.output_text or "", "completed" if status == COMPLETED else "incomplete")] \
        if ended and rec.output_text is not None else []
    return {
        "id": rec.id, "object": "response", "created_at": rec.created_at, "status": status,
        "background": rec.background, "error": rec.error if status not in ("queued", "in_progress") else None,
        "incomplete_details": {"reason": rec.incomplete_reason} if status == INCOMPLETE else None,
        "instructions": rec.instructions, "max_output_tokens": rec.max_output_tokens, "model": rec.model,
        "output": output, "parallel_tool_calls": False, "previous_response_id": rec.previous_response_id,
        "prompt_cache_key": rec.prompt_cache_key,
        "service_tier": rec.served_tier if ended or rec.served_tier else (rec.service_tier or "auto"),
        "store": rec.store, "temperature": rec.temperature, "text": {"format": {"type": "text"}},
        "tool_choice": "auto", "tools": [], "top_p": rec.top_p, "truncation": "disabled",
        "usage": usage(rec) if ended else None, "user": None, "metadata": dict(rec.metadata),
    }


def input_items_page(rec: StoredResponse, *, order: str = "desc", after: str | None = None,
                     limit: int = 20) -> dict[str, Any]:
    items = list(rec.input) if order == "asc" else list(reversed(rec.input))
    if after:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def finish(rec: StoredResponse, resp, served_tier: str, now_ms: int) -> StoredResponse:
    """``rec`` ended by the pipeline's terminal answer ``resp`` (a :class:`~pipeline.models.Response`)."""
    from dataclasses import replace

    from pipeline.models import Status
    from pipeline.openai_api.errors import reason_code

    out = replace(rec, served_tier=served_tier, updated_ms=now_ms, model=resp.model or rec.model)
    if resp.status is Status.COMPLETED:
        out.output_text = resp.output or ""
        out.finish_reason = resp.finish_reason or "stop"
        out.usage = {"input_tokens": resp.prompt_tokens, "output_tokens": resp.completion_tokens,
                     "cached_tokens": getattr(resp, "cached_tokens", 0) or 0}
        if out.finish_reason == "length":
            out.status, out.incomplete_reason = INCOMPLETE, "max_output_tokens"
        else:
            out.status = COMPLETED
    elif resp.status is Status.CANCELLED:
        out.status = "cancelled"
    else:
        reason = resp.reason or resp.status.value.lower()
        code = "expired" if resp.status is Status.EXPIRED else reason_code(reason) or "failed"
        out.status, out.error = "failed", {"code": code, "message": reason}
    return out
