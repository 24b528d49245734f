"""Windowed rate limits per tenant (and per tenant × model): requests AND tokens. Pure, no I/O.

Fixed (tumbling) windows aligned to the epoch, several at once (say per second and per
minute). A request is admitted only if every applicable limit has room for it, and only then
is it counted in all of them: no limit is ever exceeded, whatever the order of arrivals. A
rejection names the limit and says when that window has room again.

The counts live in a plain mapping ``(limit name, who, window start) → [requests, tokens]``, so
the Faust gateway can keep them in changelog-backed windowed tables (they survive a restart) and
benchmarks can use a dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import MutableMapping, NamedTuple


@dataclass(frozen=True)
class WindowLimit:
    """At most ``requests`` requests and ``tokens`` tokens per ``window_ms`` (0 = no such cap)."""

    name: str
    window_ms: int
    requests: int = 0
    tokens: int = 0
    #: "tenant" counts per tenant; "tenant_model" per tenant and model.
    scope: str = "tenant"

    def __post_init__(self):
        if self.window_ms <= 0:
            raise ValueError(f"limit {self.name}: window_ms must be > 0")
        if self.requests < 0 or self.tokens < 0 or (self.requests == 0 and self.tokens == 0):
            raise ValueError(f"limit {self.name}: set requests and/or tokens > 0")
        if self.scope not in ("tenant", "tenant_model"):
            raise ValueError(f"limit {self.name}: scope must be 'tenant' or 'tenant_model'")


class RateDecision(NamedTuple):
    admitted: bool
    limit: str = ""
    #: When the window that refused has room again (0 when admitted).
    retry_after_ms: int = 0
    detail: str = ""


ADMIT = RateDecision(True)


def window_start(now_ms: int, window_ms: int) -> int:
    return now_ms - now_ms % window_ms


def counter_key(limit: WindowLimit, tenant: str, model: str, start_ms: int) -> tuple[str, str, int]:
    """(limit name, who, window start); who is the tenant, or ``tenant<US>model``."""
    who = tenant if limit.scope == "tenant" else f"{tenant}\x1f{model}"
    return limit.name, who, start_ms


class RateLimiter:
    """Checks and counts requests against ``limits`` for each tenant.

    ``limits_for(tenant)`` returns the limits of one tenant (per-tenant overrides, else the
    defaults); counts are kept in ``counts`` (any mutable mapping).
    """

    def __init__(self, default_limits: list[WindowLimit],
                 tenant_limits: dict[str, list[WindowLimit]] | None = None,
                 counts: MutableMapping[str, list[int]] | None = None):
        self.default_limits = list(default_limits)
        self.tenant_limits = dict(tenant_limits or {})
        self.counts: MutableMapping[str, list[int]] = {} if counts is None else counts
        # A mapping that keeps each limit's counts apart (the gateway's tables) hands out the
        # part of one limit (``for_limit(name)``): one lookup fewer per limit and decision.
        self._counts_of: dict[str, MutableMapping] = {}

    def limits_for(self, tenant: str) -> list[WindowLimit]:
        return self.tenant_limits.get(tenant, self.default_limits)

    def admit(self, tenant: str, model: str, tokens: int, now_ms: int) -> RateDecision:
        """Admit and count, or refuse (counting nothing) with the limit and its retry-after."""
        limits = self.limits_for(tenant)
        counted = []  # (counts, key, what it holds now): counted only if every limit has room
        worst: RateDecision | None = None
        counts_of = self._counts_of
        for limit in limits:
            try:
                counts = counts_of[limit.name]
            except KeyError:
                for_limit = getattr(self.counts, "for_limit", None)
                counts = counts_of[limit.name] = self.counts if for_limit is None else for_limit(limit.name)
            window = limit.window_ms
            start = now_ms - now_ms % window
            key = (limit.name, tenant if limit.scope == "tenant" else f"{tenant}\x1f{model}", start)
            used = counts.get(key) or (0, 0)
            over = None
            if limit.requests and used[0] + 1 > limit.requests:
                over = f"{used[0]}/{limit.requests} requests"
            elif limit.tokens and used[1] + tokens > limit.tokens:
                if tokens > limit.tokens:
                    # Never fits: retrying cannot help, so no retry-after.
                    return RateDecision(False, limit.name, 0,
                                        f"{tokens} tokens exceed the {limit.tokens}-token limit per window")
                over = f"{used[1]}+{tokens}/{limit.tokens} tokens"
            if over is not None:
                retry = start + limit.window_ms - now_ms
                if worst is None or retry > worst.retry_after_ms:
                    worst = RateDecision(False, limit.name, retry, f"{over} in the {limit.window_ms} ms window")
            counted.append((counts, key, used))
        if worst is not None:
            return worst
        for counts, key, used in counted:
            counts[key] = [used[0] + 1, used[1] + tokens]
        return ADMIT

    def expire(self, now_ms: int) -> int:
        """Drop counters of windows that have ended; returns how many."""
        longest = {lim.name: lim.window_ms for lims in [self.default_limits, *self.tenant_limits.values()]
                   for lim in lims}
        dead = [k for k in list(self.counts) if k[2] + longest.get(k[0], 0) <= now_ms]
        for k in dead:
            del self.counts[k]
        return len(dead)
