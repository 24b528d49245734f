"""Which model servers answer which model: a routing table with spreading and failover.

A table maps a model name to one or more OpenAI-compatible base URLs; ``"*"`` catches
every other model (one base URL for everything is the table ``{"*": [url]}``). A
degraded (smaller) model is just another name with its own servers. A model with no
route is refused before any HTTP call.

Names: a request's model goes through the aliases first (public name → the name the servers
know). The servers' own lists (``GET /v1/models``, read by :meth:`OpenAIBackend.served_models`)
narrow the catch-all route: a model no catch-all server lists is refused, like one with no
route, as long as every catch-all server's list is known. A request that names no model runs
on :meth:`RoutingTable.default_model`.

Spreading: the OpenAI backend chooses among a model's servers by prefix cache within a load
bound (:mod:`cache_routing`, :mod:`affinity`); :meth:`RoutingTable.pick` is the plain choice (a
free pacing slot and the fewest calls in flight, ties going round-robin). Failover: a server that failed a call is skipped by that
call's retries while the model has another one; a server that could not be reached is
avoided by every call for a cool-down that doubles while it keeps failing (and is still
tried when it is the only one left, since the cool-down is a guess).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Mapping, Sequence

from pipeline.config.fields import is_http_url, parse_routes
from pipeline.errors import BackendError

WILDCARD = "*"


class UnknownModelError(BackendError):
    """No server is configured for the request's model; retrying cannot help."""

    def __init__(self, model: str, known: Iterable[str]):
        self.model = model
        names = ", ".join(sorted(known)) or "none"
        super().__init__(f"unknown model {model!r}: no server is configured for it (configured: {names})",
                         retriable=False)


@dataclass(eq=False)
class Server:
    base_url: str
    models: list[str] = field(default_factory=list)
    down_until: float = 0.0
    consecutive_failures: int = 0
    #: The names it lists on /v1/models (None: not read, or it could not be read).
    served: tuple[str, ...] | None = None
    #: Whether its streams end with usage (None: not seen yet). Servers that leave it out
    #: (llama-cpp-python) are asked for whole answers by complete(), whose usage is real.
    stream_usage: bool | None = None

    @property
    def root_url(self) -> str:
        """The server's root (``/metrics`` lives there, not under ``/v1``)."""
        url = self.base_url
        return url[: -len("/v1")] if url.endswith("/v1") else url

    def __repr__(self) -> str:
        return f"Server({self.base_url!r})"


class RoutingTable:
    def __init__(self, routes: Mapping[str, Sequence[str] | str], *, cooldown_s: float = 1.0,
                 max_cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 aliases: Mapping[str, str] | None = None, default: str = ""):
        if not routes:
            raise ValueError("a routing table needs at least one route")
        #: Public name → the name the servers know it by.
        self.aliases = dict(aliases or {})
        #: The configured model of a request that names none ("" = the servers' first listed).
        self.default = default
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.clock = clock
        by_url: dict[str, Server] = {}
        self._routes: dict[str, list[Server]] = {}
        for model, urls in routes.items():
            if isinstance(urls, str):
                urls = [urls]
            servers = []
            for url in urls:
                url = url.strip().rstrip("/")
                if not is_http_url(url):
                    raise ValueError(f"route {model!r}: {url!r} is not an http:// or https:// URL")
                server = by_url.setdefault(url, Server(url))
                if server not in servers:
                    servers.append(server)
                    server.models.append(model)
            if not servers:
                raise ValueError(f"route {model!r} has no server")
            self._routes[model] = servers
        self.servers: list[Server] = list(by_url.values())
        self._turn: dict[str, int] = {}

    @classmethod
    def single(cls, base_url: str, **kwargs) -> "RoutingTable":
        """Every model to one server, as a single ``base_url`` always meant."""
        return cls({WILDCARD: [base_url]}, **kwargs)

    @classmethod
    def parse(cls, spec: str, **kwargs) -> "RoutingTable":
        """The table ``worker.openai_routes`` spells (pipeline.config.fields.parse_routes)."""
        return cls(parse_routes(spec), **kwargs)

    @property
    def models(self) -> list[str]:
        return [m for m in self._routes if m != WILDCARD]

    def served_name(self, model: str) -> str:
        """The name ``model`` has on its servers (what goes in the call's body)."""
        return self.aliases.get(model, model)

    def servers_for(self, model: str) -> list[Server]:
        servers = self._routes.get(model)
        if servers is None:
            name = self.served_name(model)
            servers = self._routes.get(name)
            if servers is None:
                servers = self._routes.get(WILDCARD)
                if servers is None:
                    raise UnknownModelError(model, self.models)
                servers = self._serving(servers, name, model)
        return servers

    def _serving(self, servers: list[Server], name: str, model: str) -> list[Server]:
        """The catch-all servers that may serve ``name``: those that list it, and those whose list
        is not known; none of them (every list known, none has it) → unknown."""
        if all(s.served is None for s in servers):
            return servers
        serving = [s for s in servers if s.served is None or name in s.served]
        if not serving:
            raise UnknownModelError(model, self.listed())
        return serving

    def listed(self) -> list[str]:
        """The names requests may use: explicit routes, what the catch-all servers list, the
        aliases of those."""
        names = dict.fromkeys(self.models)
        for server in self._routes.get(WILDCARD, ()):
            names.update(dict.fromkeys(server.served or ()))
        names.update(dict.fromkeys(a for a, target in self.aliases.items() if target in names))
        return list(names)

    @property
    def open_ended(self) -> bool:
        """Whether a name nobody listed may still be served (a catch-all server's list is unknown)."""
        return any(s.served is None for s in self._routes.get(WILDCARD, ()))

    def default_model(self) -> str:
        """What a request that names no model runs on: the configured default, else the first
        name a catch-all server lists, else the first explicit route ("" when none is known)."""
        if self.default:
            return self.default
        for server in self._routes.get(WILDCARD, ()):
            if server.served:
                return server.served[0]
        return self.models[0] if self.models else ""

    def pick(self, model: str, *, exclude: Collection[Server] = (),
             key: Callable[[Server], object] | None = None) -> Server | None:
        """The server for the next call of ``model``, or None when every one is excluded."""
        servers = self.servers_for(model)
        turn = self._turn.get(model, 0)
        self._turn[model] = turn + 1
        start = turn % len(servers)
        rotated = servers[start:] + servers[:start]
        pool = [s for s in rotated if s not in exclude]
        if not pool:
            return None
        now = self.clock()
        up = [s for s in pool if s.down_until <= now]
        if not up:
            return min(pool, key=lambda s: s.down_until)
        return min(up, key=key) if key is not None else up[0]

    def mark_failed(self, server: Server) -> None:
        """The server could not be reached: every call avoids it for a while."""
        server.consecutive_failures += 1
        backoff = self.cooldown_s * 2 ** min(server.consecutive_failures - 1, 16)
        server.down_until = self.clock() + min(self.max_cooldown_s, backoff)

    def hold(self, server: Server, seconds: float) -> None:
        """The server asked for a pause (Retry-After): avoid it that long, without counting a failure."""
        server.down_until = max(server.down_until, self.clock() + min(seconds, self.max_cooldown_s))

    def mark_ok(self, server: Server) -> None:
        server.consecutive_failures = 0
        server.down_until = 0.0

    def is_up(self, server: Server) -> bool:
        return server.down_until <= self.clock()
