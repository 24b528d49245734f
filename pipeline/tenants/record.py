"""One tenant's record: its tier, limits, caps, priorities, models, keys and signing rule.

The same table in the registry file (TOML), in ``[tenants.records]`` and, as JSON, in the
registry topic::

    [acme]
    tier = "enterprise"            # what the gateway's tier_offsets read; the request's own is ignored
    max_priority = "HIGH"          # the highest band it may ask for (higher asks are served here)
    models = ["sim-small"]         # [] or absent = every model
    weight = 2.0                   # its share against other tenants (for fair scheduling)
    key_hashes = ["sha256:…"]      # `llmq tenants set --key-file`; the keys themselves are never stored
    require_signature = false      # true: requests must carry llmq-signature (HMAC-SHA256)
    signing_secret = "env:ACME_SIGNING_SECRET"   # or file:NAME in [tenants] secrets_dir
    enabled = true                 # false: every request refused unauthorized, every key refused
    [acme.limits.per_second]       # replaces [gateway.limits] for this tenant (absent = those)
    window_ms = 1000
    requests = 50
    [acme.outstanding]             # replaces [gateway.tenant_outstanding] in the bands named
    NORMAL = 100
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from pipeline.config.fields import BAND_NAMES
from pipeline.config.gateway import RateLimitSettings, _limits
from pipeline.errors import ConfigError
from pipeline.models import Priority
from pipeline.policy.validation import _tenant_problem
from pipeline.tenants.keys import is_key_hash

_KEYS = ("tier", "max_priority", "models", "weight", "key_hashes", "require_signature", "signing_secret",
         "enabled", "limits", "outstanding", "updated_at")
#: Topic values carry this version; a reader refuses a version it does not know.
FORMAT = 1


@dataclass(frozen=True)
class TenantRecord:
    name: str
    tier: str = "standard"
    max_priority: Priority = Priority.CRITICAL
    models: tuple[str, ...] = ()
    weight: float = 1.0
    key_hashes: tuple[str, ...] = ()
    require_signature: bool = False
    signing_secret: str = ""
    enabled: bool = True
    #: None: the gateway's [gateway.limits] apply.
    limits: tuple[RateLimitSettings, ...] | None = None
    #: band → most requests outstanding there (0 = no cap); bands absent keep the gateway's.
    outstanding: Mapping[str, int] = field(default_factory=dict)
    updated_at: int = 0

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    def cap_priority(self, asked: Priority) -> Priority:
        return asked if asked.rank >= self.max_priority.rank else self.max_priority

    def to_dict(self) -> dict[str, Any]:
        return {"v": FORMAT, "tier": self.tier, "max_priority": self.max_priority.value, "models": list(self.models),
                "weight": self.weight, "key_hashes": list(self.key_hashes),
                "require_signature": self.require_signature, "signing_secret": self.signing_secret,
                "enabled": self.enabled,
                "limits": None if self.limits is None else {
                    lim.name: {"window_ms": lim.window_ms, "requests": lim.requests, "tokens": lim.tokens,
                               "scope": lim.scope, "burst": lim.burst, "token_burst": lim.token_burst}
                    for lim in self.limits},
                "outstanding": dict(self.outstanding), "updated_at": self.updated_at}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def evolve(self, **changes: Any) -> TenantRecord:
        return replace(self, **changes)


def _str_list(path: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(path, "must be a list of non-empty strings")
    return tuple(dict.fromkeys(value))


def parse_record(name: str, spec: Mapping[str, Any], path: str) -> TenantRecord:
    """A record from its table; ``ConfigError`` names the key at fault (never a secret's value)."""
    problem = _tenant_problem(name)
    if problem is not None:
        raise ConfigError(path, problem.removeprefix("invalid_request: ").replace("tenant_id", "tenant name"))
    if not isinstance(spec, Mapping):
        raise ConfigError(path, "must be a table")
    version = spec.get("v", FORMAT)
    if version != FORMAT:
        raise ConfigError(f"{path}.v", f"record format {version!r} is not known here (this llmq reads {FORMAT})")
    unknown = set(spec) - set(_KEYS) - {"v"}
    if unknown:
        raise ConfigError(f"{path}.{sorted(unknown)[0]}", f"unknown key (known: {', '.join(_KEYS)})")
    kw: dict[str, Any] = {"name": name}
    if "tier" in spec:
        if not isinstance(spec["tier"], str) or not spec["tier"].strip():
            raise ConfigError(f"{path}.tier", "must name a tier")
        kw["tier"] = spec["tier"].strip()
    if "max_priority" in spec:
        try:
            kw["max_priority"] = Priority.parse(spec["max_priority"])
        except ValueError:
            raise ConfigError(f"{path}.max_priority", f"unknown band (known: {BAND_NAMES})") from None
    if "models" in spec:
        kw["models"] = _str_list(f"{path}.models", spec["models"])
    if "weight" in spec:
        weight = spec["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1_000:
            raise ConfigError(f"{path}.weight", "must be a number above 0 (at most 1000)")
        kw["weight"] = float(weight)
    if "key_hashes" in spec:
        hashes = _str_list(f"{path}.key_hashes", spec["key_hashes"])
        if not all(is_key_hash(h) for h in hashes):
            raise ConfigError(f"{path}.key_hashes", "each must be sha256:<64 hex digits> (`llmq tenants set "
                                                    "--key-file` computes it; never store the key)")
        kw["key_hashes"] = hashes
    for key in ("require_signature", "enabled"):
        if key in spec:
            if not isinstance(spec[key], bool):
                raise ConfigError(f"{path}.{key}", "must be true or false")
            kw[key] = spec[key]
    if "signing_secret" in spec:
        ref = spec["signing_secret"]
        if not isinstance(ref, str) or (ref and not ref.startswith(("env:", "file:"))):
            raise ConfigError(f"{path}.signing_secret", "must be a reference, env:NAME or file:NAME (never the "
                                                        "secret itself)")
        kw["signing_secret"] = ref
    if kw.get("require_signature") and not kw.get("signing_secret"):
        raise ConfigError(f"{path}.signing_secret", "required with require_signature = true")
    if spec.get("limits") is not None:
        limits = _limits(f"{path}.limits", spec["limits"])
        if not limits:
            raise ConfigError(f"{path}.limits", "name at least one limit (leave it out for the gateway's)")
        kw["limits"] = tuple(limits)
    if "outstanding" in spec:
        table = spec["outstanding"]
        if not isinstance(table, Mapping):
            raise ConfigError(f"{path}.outstanding", "must be a table band → cap")
        caps = {}
        for band, cap in table.items():
            if band not in Priority.__members__:
                raise ConfigError(f"{path}.outstanding.{band}", f"unknown band (known: {BAND_NAMES})")
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
                raise ConfigError(f"{path}.outstanding.{band}", "must be an integer >= 0 (0 = no cap)")
            caps[band] = cap
        kw["outstanding"] = caps
    if "updated_at" in spec:
        if isinstance(spec["updated_at"], bool) or not isinstance(spec["updated_at"], int):
            raise ConfigError(f"{path}.updated_at", "must be epoch milliseconds")
        kw["updated_at"] = spec["updated_at"]
    return TenantRecord(**kw)


def parse_records(table: Any, path: str) -> dict[str, TenantRecord]:
    if not isinstance(table, Mapping):
        raise ConfigError(path, "must be a table of tenants")
    return {name: parse_record(str(name), spec, f"{path}.{name}") for name, spec in table.items()}


def from_json(name: str, value: bytes) -> TenantRecord:
    try:
        spec = json.loads(value)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"tenant {name}", f"not a JSON record ({type(exc).__name__})") from None
    return parse_record(name, spec, f"tenant {name}")
