"""Token-bucket rate limits per tenant (and per tenant × model): requests AND tokens. Pure, no I/O.

Each limit is a pair of buckets kept the GCRA way (as redis-cell and throttled keep them): one
number per bucket, the *theoretical arrival time* (TAT), the moment the bucket would be full
again. A request costs one emission interval of the request bucket (``window_ms / requests``)
and ``tokens`` emission intervals of the token bucket (``window_ms / tokens``); it is admitted
when, after paying, neither bucket is more than its burst ahead of now. Consequences:

* over any interval of length L, a limit admits at most ``burst + requests × L / window_ms``
  requests (and the same for tokens): there is no window edge to burst across;
* a refused request changes nothing, and its ``retry_after_ms`` is exact: the moment the
  bucket that refused has room for it;
* the state of a tenant is a handful of floats, so it fits one table record.

A limit whose ``over`` is "delay" *shapes* rather than refuses: a request that does not fit now
is charged all the same and admitted with ``delay_ms``, the time at which the bucket has room
for it (its conformance time, as a GCRA shaper computes it), provided that is no later than
``max_delay_ms``. Successive delayed requests get successive times, one emission interval
apart, so a tenant's requests start at no more than its rate, in order, and a burst is spread
instead of refused.

The limits themselves are settings (:class:`pipeline.config.gateway.RateLimitSettings`).
Token costs are an estimate at admission (prompt estimate + ``max_tokens``); :func:`settle`
corrects the token bucket by the difference once the response reports the real usage.
"""

from __future__ import annotations

from typing import MutableMapping, NamedTuple

from pipeline.config.gateway import RateLimitSettings as RateLimit

_US = "\x1f"


def limit_key(limit: RateLimit, model: str) -> str:
    """Where ``limit``'s buckets live in a tenant's state."""
    return limit.name if limit.scope == "tenant" else f"{limit.name}{_US}{model}"


def describe(limit: RateLimit) -> str:
    parts = []
    if limit.requests:
        parts.append(f"{limit.requests} requests")
    if limit.tokens:
        parts.append(f"{limit.tokens} tokens")
    return f"{' and '.join(parts)} per {limit.window_ms} ms"


class RateDecision(NamedTuple):
    admitted: bool
    limit: str = ""
    #: When the bucket that refused has room again (0 when admitted, or when it never will).
    retry_after_ms: int = 0
    detail: str = ""
    #: Admitted under a "delay" limit: how long after ``now_ms`` it may start (0: at once).
    delay_ms: float = 0.0


ADMIT = RateDecision(True)

#: A tenant's buckets: limit key → [request TAT, token TAT] (epoch ms, floats).
Buckets = MutableMapping[str, list]


def admit(buckets: Buckets, limits: list[RateLimit], model: str, tokens: int, now_ms: float,
          max_delay_ms: float = 0.0, clock_ms: float | None = None) -> RateDecision:
    """Admit and charge every limit, or refuse (charging nothing) naming the limit that waits longest.

    ``now_ms`` is the moment the request is judged at: its arrival. Judged at its own arrival
    whatever order requests are read in, a limit admits at most ``burst + rate x L`` over any
    interval L of arrivals (each admission moves a TAT on by an interval, and needs it within the
    burst of its own arrival). ``clock_ms``, the latest arrival the buckets were charged at, is
    where a refusal's ``retry_after_ms`` counts from: a request read late is told how long from
    now, not from its arrival.

    A request over only "delay" limits, by no more than ``max_delay_ms``, is admitted and charged
    with the wait as ``delay_ms``."""
    since = max(0.0, clock_ms - now_ms) if clock_ms is not None else 0.0
    charges = []
    worst: RateDecision | None = None
    delay = 0.0
    for limit in limits:
        key = limit_key(limit, model)
        tat_requests, tat_tokens = buckets.get(key) or (now_ms, now_ms)
        new_requests, new_tokens = tat_requests, tat_tokens
        wait = 0.0
        over = ""
        if limit.requests:
            interval = limit.window_ms / limit.requests
            new_requests = max(tat_requests, now_ms) + interval
            ahead = new_requests - now_ms - limit.request_burst * interval
            if ahead > 0:
                wait, over = ahead, f"{describe(limit)}, burst {limit.request_burst} requests"
        if limit.tokens:
            if tokens > limit.tokens_burst:
                # Never fits: retrying cannot help, so no retry-after.
                return RateDecision(False, limit.name, 0, f"{tokens} tokens exceed the {limit.tokens_burst}-token "
                                                           f"burst of {describe(limit)}")
            interval = limit.window_ms / limit.tokens
            new_tokens = max(tat_tokens, now_ms) + tokens * interval
            ahead = new_tokens - now_ms - limit.tokens_burst * interval
            if ahead > wait:
                wait, over = ahead, f"{describe(limit)}, burst {limit.tokens_burst} tokens ({tokens} asked)"
        if over:
            if limit.over == "delay" and wait <= max_delay_ms:
                delay = max(delay, wait)
            else:
                retry = max(1, int(wait - since + 0.999))
                if worst is None or retry > worst.retry_after_ms:
                    worst = RateDecision(False, limit.name, retry, over)
        charges.append((key, new_requests, new_tokens))
    if worst is not None:
        return worst
    for key, new_requests, new_tokens in charges:
        buckets[key] = [new_requests, new_tokens]
    return RateDecision(True, delay_ms=delay) if delay else ADMIT


def charge(buckets: Buckets, limits: list[RateLimit], model: str, tokens: int, now_ms: float) -> None:
    """Charge every limit whatever room it has: the effect of an admission decided before (a
    request read again after a crash), brought back into the state it was decided on."""
    for limit in limits:
        key = limit_key(limit, model)
        tat_requests, tat_tokens = buckets.get(key) or (now_ms, now_ms)
        if limit.requests:
            tat_requests = max(tat_requests, now_ms) + limit.window_ms / limit.requests
        if limit.tokens:
            tat_tokens = max(tat_tokens, now_ms) + tokens * limit.window_ms / limit.tokens
        buckets[key] = [tat_requests, tat_tokens]


def settle(buckets: Buckets, limits: list[RateLimit], model: str, delta_tokens: int, now_ms: float) -> None:
    """Correct the token buckets by ``delta_tokens`` (used − charged): a refund moves the TAT back,
    never below now (a bucket cannot be fuller than full); an overrun moves it on."""
    if not delta_tokens:
        return
    for limit in limits:
        if not limit.tokens:
            continue
        entry = buckets.get(limit_key(limit, model))
        if entry is None:
            continue
        moved = entry[1] + delta_tokens * limit.window_ms / limit.tokens
        entry[1] = moved if delta_tokens > 0 else max(moved, now_ms)


def idle(buckets: Buckets, now_ms: float) -> bool:
    """Whether every bucket is full again (its state can be forgotten without changing anything)."""
    return all(tat_requests <= now_ms and tat_tokens <= now_ms for tat_requests, tat_tokens in buckets.values())
