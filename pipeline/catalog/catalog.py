"""Which model names are served, by whom, and what a request that names none runs on. Pure.

Each worker pool publishes one :class:`PoolModels`: the names its servers list on
``GET /v1/models`` (an explicit route's name counts as listed), the one a request naming no
model runs on, and the aliases its configuration maps. A :class:`ModelCatalog` is a snapshot of
every pool's list, with this process's own ``[models]`` settings over it.

A list that has not been republished within ``models.ttl_s`` no longer counts (its workers are
gone). A pool that cannot tell what its servers serve (the simulated model answers any name, a
server whose list could not be read) says ``any_model``: then nothing is refused by name, since
a worker of that pool may serve it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

from pipeline.config.models import ModelSettings
from pipeline.errors import ConfigError

#: Names shown per refusal at most (a pool may serve hundreds of LoRA adapters).
_SHOWN = 8


@dataclass(frozen=True)
class PoolModels:
    pool: str
    #: The names the pool's servers serve, in the order they list them.
    models: tuple[str, ...] = ()
    #: What a request that names no model runs on ("" when the pool cannot tell).
    default: str = ""
    #: The pool may serve names it did not list (see the module's docstring).
    any_model: bool = False
    aliases: Mapping[str, str] = field(default_factory=dict)
    #: When it was published (epoch ms).
    at_ms: int = 0

    def to_json(self) -> bytes:
        return json.dumps({"pool": self.pool, "models": list(self.models), "default": self.default,
                           "any_model": self.any_model, "aliases": dict(self.aliases), "at_ms": self.at_ms},
                          separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "PoolModels":
        try:
            data = json.loads(raw)
            models = tuple(str(m) for m in data.get("models") or ())
            aliases = {str(k): str(v) for k, v in (data.get("aliases") or {}).items()}
            return cls(str(data["pool"]), models, str(data.get("default") or ""), bool(data.get("any_model")),
                       aliases, int(data.get("at_ms") or 0))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError("models topic", f"a pool's model list does not parse: {exc}") from None

    def same_list(self, other: "PoolModels | None") -> bool:
        """Whether ``other`` says the same (so only its time would change)."""
        return other is not None and (self.pool, self.models, self.default, self.any_model, dict(self.aliases)) == \
            (other.pool, other.models, other.default, other.any_model, dict(other.aliases))


class ModelCatalog:
    def __init__(self, settings: ModelSettings, pools: Mapping[str, PoolModels] | None = None):
        self.settings = settings
        self.pools = dict(pools or {})

    def live(self, now_ms: int) -> list[PoolModels]:
        ttl_ms = self.settings.ttl_s * 1000
        return [p for p in self.pools.values() if now_ms - p.at_ms <= ttl_ms]

    def aliases(self, now_ms: int) -> dict[str, str]:
        """Public name → served name: the pools' own, this process's configuration over them."""
        out: dict[str, str] = {}
        for pool in self.live(now_ms):
            out.update(pool.aliases)
        out.update(self.settings.aliases)
        return out

    def resolve(self, model: str, now_ms: int) -> str:
        """The name the servers know ``model`` by."""
        return self.aliases(now_ms).get(model, model)

    def known(self, now_ms: int) -> bool:
        """Whether any pool has said what it serves (else nothing is refused by name)."""
        return bool(self.live(now_ms))

    def served(self, now_ms: int) -> list[str]:
        out: dict[str, None] = {}
        for pool in self.live(now_ms):
            out.update(dict.fromkeys(pool.models))
        return list(out)

    def names(self, now_ms: int) -> list[str]:
        """What /v1/models lists: the served names, then the aliases of served names."""
        served = self.served(now_ms)
        open_ = any(p.any_model for p in self.live(now_ms))
        aliases = [a for a, target in self.aliases(now_ms).items() if open_ or target in served]
        return list(dict.fromkeys(served + aliases))

    def default(self, now_ms: int) -> str:
        """The model of a request that names none ("" when nothing says: the worker decides)."""
        if self.settings.default:
            return self.settings.default
        for pool in sorted(self.live(now_ms), key=lambda p: p.pool):
            if pool.default:
                return pool.default
        return ""

    def refusal(self, model: str, now_ms: int) -> str | None:
        """Why a request for ``model`` cannot be served (``model_not_found: …``), or None.

        None also whenever the catalog cannot tell: refusing is off, no pool has published, or
        a pool may serve names it did not list."""
        if not model or not self.settings.refuse_unknown:
            return None
        live = self.live(now_ms)
        if not live or any(p.any_model for p in live):
            return None
        target = self.resolve(model, now_ms)
        for pool in live:
            if target in pool.models:
                return None
        names = self.names(now_ms)
        shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
        printable = "".join(c if c.isprintable() else "?" for c in model[:100])
        return f"model_not_found: no server serves model {printable!r} (served: {shown or 'none'})"
