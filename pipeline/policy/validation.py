"""Request validation: pure, no I/O. Used by workers (gateway-less mode) and the gateway.

Returns the rejection reason (``invalid_request: ...``, naming the field) or None.
Headers never reach this code: tenant and priority come only from the decoded,
schema-checked body. Reasons go back to the tenant and into logs, so they never quote
the sender's text back (a role or a topic name may hold anything), only numbers.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Mapping

from pipeline.config.topics import TopicSettings
from pipeline.models import Request

MAX_TENANT_ID_CHARS = 256
MAX_TOKENS_LIMIT = 1_000_000
# C0/C1 controls, and Unicode format/separator characters that reorder or hide text
# (bidi overrides, zero-width, line/paragraph separators, BOM).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")
MAX_TRACE_ID_CHARS = 128
_TRACE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,%d}" % MAX_TRACE_ID_CHARS)
#: How far in the future a client's clock may put created_at before the request is refused.
MAX_CLOCK_SKEW_MS = 5 * 60 * 1000
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_UUID_MATCH = _UUID.fullmatch

# -- revision 4: the OpenAI request shape --------------------------------------------------------
#: The chat roles OpenAI's API knows; checked here, not by the schema, so a new one needs no
#: schema revision.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
_CHAT_ROLES = frozenset(CHAT_ROLES)
#: The codec's default ``SerdeLimits.max_messages``: a deployment that raises that cap still
#: gets no more than this.
MAX_MESSAGES = 256
#: The characters of a conversation (each message's content, and all of them together): the
#: default prompt cap, since the prompt of a request built from messages is their rendering.
MAX_CONVERSATION_CHARS = 262_144
_MESSAGE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's pattern for a participant name
MAX_STOP_SEQUENCES = 4  # what OpenAI's API accepts
MAX_STOP_CHARS = 64
MAX_USER_CHARS = 256
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.0, 2.0
#: Kafka's own rule for topic names (legal characters, at most 249, not "." or "..").
MAX_TOPIC_NAME_CHARS = 249
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,%d}" % MAX_TOPIC_NAME_CHARS)


def _number(value) -> bool:
    # bool is an int to Python, not a temperature to anyone.
    return type(value) in (int, float) and math.isfinite(value)


def _messages_problem(messages: list) -> str | None:
    if len(messages) > MAX_MESSAGES:
        return f"invalid_request: messages has {len(messages)} entries, more than {MAX_MESSAGES}"
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            return f"invalid_request: messages[{i}] is not a message (role, content, name)"
        if m.get("role") not in _CHAT_ROLES:
            return f"invalid_request: messages[{i}].role must be one of {', '.join(CHAT_ROLES)}"
        content = m.get("content")
        if type(content) is not str:
            return f"invalid_request: messages[{i}].content must be a string"
        if len(content) > MAX_CONVERSATION_CHARS:
            return f"invalid_request: messages[{i}].content is longer than {MAX_CONVERSATION_CHARS} characters"
        total += len(content)
        name = m.get("name")
        if name is not None and (type(name) is not str or _MESSAGE_NAME.fullmatch(name) is None):
            return f"invalid_request: messages[{i}].name must be 1-64 characters of A-Z a-z 0-9 _ -"
    if total > MAX_CONVERSATION_CHARS:
        return f"invalid_request: messages hold {total} characters of content, more than {MAX_CONVERSATION_CHARS}"
    return None


def _stop_problem(stop: list) -> str | None:
    if len(stop) > MAX_STOP_SEQUENCES:
        return f"invalid_request: stop has {len(stop)} sequences, more than {MAX_STOP_SEQUENCES}"
    for i, s in enumerate(stop):
        if type(s) is not str or not 1 <= len(s) <= MAX_STOP_CHARS:
            return f"invalid_request: stop[{i}] must be a string of 1-{MAX_STOP_CHARS} characters"
    return None


@functools.lru_cache(maxsize=16)
def own_topics(prefix: str) -> frozenset[str]:
    """The pipeline's topics under ``prefix`` that no answer may be written to: its inputs
    (requests, admitted requests, cancellations), its dead letters, the shared chunks and the
    receipts. The responses topic is the default answer topic, so naming it is fine."""
    t = TopicSettings(prefix=prefix)
    return frozenset((*t.request_topics, *t.dispatch_topics, t.dlq, t.cancellations, t.chunks, t.receipts))


@functools.lru_cache(maxsize=1024)
def _reply_to_problem(reply_to: str, prefix: str | None) -> str | None:
    # Cached: a front door names the same few reply topics request after request.
    if _TOPIC_NAME.fullmatch(reply_to) is None or reply_to in (".", ".."):
        return (f"invalid_request: reply_to must be a Kafka topic name: 1-{MAX_TOPIC_NAME_CHARS} characters "
                "of A-Z a-z 0-9 . _ -")
    if prefix is not None:
        if not reply_to.startswith(prefix + "."):
            return f"invalid_request: reply_to must be a topic under the pipeline's prefix ({prefix}.*)"
        if reply_to in own_topics(prefix):
            return ("invalid_request: reply_to names one of the pipeline's own request, dispatch, dead-letter, "
                    "cancellation or chunk topics")
    return None


def _openai_problem(req: Request, topics_prefix: str | None) -> str | None:
    """The revision 4 fields; each check costs nothing while its field has its default."""
    if req.messages:
        problem = _messages_problem(req.messages)
        if problem is not None:
            return problem
    t = req.temperature
    if t is not None and not (_number(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        return f"invalid_request: temperature must be a number from 0 to 2 (got {t!r:.20})"
    p = req.top_p
    if p is not None and not (_number(p) and 0.0 < p <= 1.0):
        return f"invalid_request: top_p must be a number above 0, at most 1 (got {p!r:.20})"
    if req.stop:
        problem = _stop_problem(req.stop)
        if problem is not None:
            return problem
    user = req.user
    if user is not None and (type(user) is not str or not user or len(user) > MAX_USER_CHARS
                             or _CONTROL.search(user)):
        return f"invalid_request: user must be 1-{MAX_USER_CHARS} characters without control characters"
    rp = req.reply_partition
    if rp is not None and (type(rp) is not int or rp < 0):
        return f"invalid_request: reply_partition must be >= 0 (got {rp!r:.20})"
    if req.reply_to is not None:
        if type(req.reply_to) is not str:
            return "invalid_request: reply_to must be a Kafka topic name"
        return _reply_to_problem(req.reply_to, topics_prefix)
    return None


@functools.lru_cache(maxsize=4096)
def _tenant_problem(tenant: str) -> str | None:
    # Cached: the same tenants send request after request.
    if not tenant or not tenant.strip():
        return "invalid_request: tenant_id is empty"
    if len(tenant) > MAX_TENANT_ID_CHARS:
        return f"invalid_request: tenant_id is longer than {MAX_TENANT_ID_CHARS} characters"
    if _CONTROL.search(tenant):
        return "invalid_request: tenant_id contains control characters"
    return None


def validate_request(req: Request, now_ms: int | None = None, topics_prefix: str | None = None) -> str | None:
    """The reason to refuse ``req``, or None.

    ``now_ms`` enables the clock-skew check of ``created_at``; ``topics_prefix`` (the
    configured ``topics.prefix``) the check that ``reply_to`` is one of this pipeline's
    topics and none of its inputs. Without them those checks are skipped.
    """
    problem = _tenant_problem(req.tenant_id)
    if problem is not None:
        return problem
    if not req.prompt:
        return "invalid_request: prompt is empty"
    if req.max_tokens <= 0:
        return f"invalid_request: max_tokens must be > 0 (got {req.max_tokens})"
    if req.max_tokens > MAX_TOKENS_LIMIT:
        return f"invalid_request: max_tokens must be <= {MAX_TOKENS_LIMIT} (got {req.max_tokens})"
    if req.timeout_ms <= 0:
        return f"invalid_request: timeout_ms must be > 0 (got {req.timeout_ms})"
    if _UUID_MATCH(req.request_id) is None:
        return "invalid_request: request_id must be a UUID"
    if req.trace_id is not None and _TRACE_ID.fullmatch(req.trace_id) is None:
        return "invalid_request: trace_id must be 1-128 characters of A-Z a-z 0-9 . _ : -"
    if now_ms is not None and req.created_at > now_ms + MAX_CLOCK_SKEW_MS:
        return (f"invalid_request: created_at is {(req.created_at - now_ms) // 1000}s in the future "
                "(client clock skew?)")
    return _openai_problem(req, topics_prefix)
