"""Who is calling: ``Authorization: Bearer <key>`` → the tenant whose registry record holds the key's hash.

The key is hashed (SHA-256) and looked up in the live registry: a key added or revoked with
``llmq tenants set`` is honoured within about a second. No error echoes the key, not even
masked; nothing logs it. A disabled tenant's keys are refused like unknown ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from pipeline.models import Priority
from pipeline.openai_api.errors import ApiError
from pipeline.tenants.policy import cap_priority
from pipeline.tenants.record import TenantRecord


@dataclass(frozen=True)
class Caller:
    record: TenantRecord

    @property
    def tenant(self) -> str:
        return self.record.name

    def priority(self, asked: Priority) -> Priority:
        """The band it gets when it asks for ``asked``: capped at its record's max_priority."""
        return cap_priority(self.record, asked)

    def check_model(self, model: str) -> None:
        if not self.record.allows_model(model):
            raise ApiError(403, f"forbidden: model {model!r} is not allowed for this API key", "permission_error",
                           "model_not_allowed", "model")


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization")
    if not value:
        return None
    scheme, _, key = value.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


class Authenticator:
    def __init__(self, registry):
        self.registry = registry

    def caller(self, headers: Mapping[str, str]) -> Caller:
        key = bearer(headers)
        if key is None:
            raise ApiError(401, "no API key: send Authorization: Bearer <key>", "authentication_error",
                           "missing_api_key")
        record = self.registry.by_key(key)
        if record is None:
            raise ApiError(401, "invalid API key", "authentication_error", "invalid_api_key")
        return Caller(record)
