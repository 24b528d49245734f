"""Prefix affinity: the server of a model a call goes to is the one whose prefix cache most
likely holds its prompt's start, within load bounds. Pure: no I/O, times are passed in.

vLLM, SGLang and llama.cpp skip the prefill of a prompt prefix they still hold, and a chat or
agent loop resends its whole history every turn: routed without regard to that, a turn lands
on the server of the previous one about one time in N and pays its whole prefill again.

**Placement, the same on every worker.** A request's *anchor* is its ``prompt_cache_key``
when it has one, else the hash of its prompt up to the end of its first message that is not a
system message (a conversation's first turn, which every later turn resends), else of its
first ``anchor_blocks`` blocks. Servers are ranked by rendezvous hashing of (anchor, server
URL): every worker ranks alike, with no state shared, and a server that goes away moves only
its own anchors, each to its next-ranked server.

**An index of what each server was sent** (this worker's own memory, as llm-d's approximate
scorer keeps one): the prompt is cut into blocks (``block_chars`` characters at its start,
longer further in: :func:`block_ends`) whose CRC-32s chain (a block matches only after the
same whole prefix), and each server keeps an LRU of the
blocks routed to it, at most ``index_blocks``, entries older than ``ttl_s`` ignored. A
request's *match* on a server is the longest run of its blocks, from the start, found there;
it steers the choice only where it goes past the blocks many requests share (a conversation's
system prompt; a prompt's anchor), or a popular system prompt would draw every conversation
to the first server that got it, and workers whose indexes differ would disagree.
A server's answer saying it had fewer tokens cached than the index thought
(``usage.prompt_tokens_details.cached_tokens``) means it evicted what it was sent before:
the index forgets that server's entries as old as the missing block.

**The choice**, among the model's servers that are up and not excluded:

1. *Bounded loads* (consistent hashing with bounded loads, Mirrokni et al.): a server's load
   is the calls it has (llmq's in flight plus, from its metrics, its other clients' running
   and waiting); with ``m`` calls in all counting this one over ``n`` servers, a server may
   take it only while its load stays within ``max(ceil((1 + epsilon) * m / n), bound_floor)``.
   So no server holds more than (1 + ε) of its fair share (plus one call of rounding) while
   another has room, except at so low a load that ``bound_floor`` calls are more: a handful of
   calls on one server of several costs nobody a slot, where spilling a conversation off its
   server costs it its cache.
2. Of those with a free pacing slot, the one with the longest match (at least
   ``min_match_blocks``), ties and no match going to the best-ranked: the placement.
3. A request whose wanted server has no free slot (or one more call would put it over its
   bound, but it is within once one of its calls ends) while it holds the
   prefix (a match, or a conversation's later turn, or a ``prompt_cache_key``) waits for it
   up to ``wait_s`` (its slot frees within a call's time over its slots), instead of
   recomputing its prefix elsewhere; then it goes to the best other. A one-off prompt never
   waits.
4. No server with both a free slot and room under its bound: the least loaded with a free
   slot; none with a free slot: the least loaded (the caller waits for its slot).
"""

from __future__ import annotations

import functools
import math
import zlib
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

#: The key under which serve carries a request's ``prompt_cache_key`` in its metadata.
CACHE_KEY = "llmq.prompt_cache_key"

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class AffinityConfig:
    #: False: today's spreading (a free slot, fewest in flight), no index kept.
    enabled: bool = True
    #: Characters per hashed block (about 64 tokens of English at 4 characters a token).
    block_chars: int = 256
    #: Blocks a prompt-only request's anchor covers (its start identifies it).
    anchor_blocks: int = 4
    #: Blocks of one prompt hashed at most (the rest of a very long prompt is not indexed).
    max_blocks: int = 512
    #: The load bound's slack: no server above (1 + epsilon) of its fair share...
    epsilon: float = 0.25
    #: ...except that a server may always hold this many calls (the bound at low load).
    bound_floor: int = 4
    #: Index entries kept per server (LRU), and how long one counts.
    index_blocks: int = 65536
    ttl_s: float = 120.0
    #: A match that goes fewer blocks than this past the shared ones does not steer the choice.
    min_match_blocks: int = 1
    #: How long a request whose prefix a busy server holds may wait for that server's slot.
    wait_s: float = 0.25

    def __post_init__(self):
        if self.block_chars < 16 or self.anchor_blocks < 1 or self.max_blocks < 1:
            raise ValueError("affinity block_chars must be at least 16, anchor_blocks and max_blocks at least 1")
        if self.epsilon <= 0 or self.bound_floor < 1 or self.index_blocks < 1 or self.ttl_s <= 0 or self.wait_s < 0:
            raise ValueError("affinity epsilon, index_blocks and ttl_s must be positive, wait_s not negative")


@dataclass(slots=True)
class PromptKey:
    """What the choice needs of a request's prompt."""

    blocks: list[int]
    anchor: int
    #: Leading blocks other requests share (its system messages, or a prompt's anchor blocks):
    #: a match no longer than this says nothing of where this request's own prefix is.
    shared: int
    #: A later turn of a conversation, or one a caller keyed: its prefix is worth waiting for.
    continued: bool
    chars: int


@dataclass(slots=True)
class Choice:
    server: Hashable | None  # None: wait for ``wanted``'s slot
    reason: str  # "prefix", "home", "spill", "least_loaded", "deferred"
    matched: int = 0  # blocks of the prompt the index says the server holds
    seen_at: float | None = None  # when the deepest of them was last sent there


#: Blocks of ``block_chars`` at a prompt's start; past them each block is this many times longer
#: than the one before, up to ``_MAX_GROWTH`` times. Block ends depend on position only, so
#: prompts that share a prefix share its blocks; a long prompt costs fewer hashes, and a match
#: deep into it is known to a coarser grain, which costs nothing a routing decision needs.
_FINE_BLOCKS, _GROWTH_EVERY, _MAX_GROWTH = 32, 16, 16


@functools.lru_cache(maxsize=8)
def block_ends(block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """Where a prompt's blocks end (in bytes of its UTF-8 text)."""
    ends, end, size = [], 0, block_chars
    for i in range(max_blocks):
        if i >= _FINE_BLOCKS and (i - _FINE_BLOCKS) % _GROWTH_EVERY == 0 and size < block_chars * _MAX_GROWTH:
            size *= 2
        end += size
        ends.append(end)
    return tuple(ends)


def _role_and_content(m: Any) -> tuple[str, str]:
    if type(m) is dict:
        return m.get("role") or "", m.get("content") or ""
    if isinstance(m, Mapping):
        return str(m.get("role") or ""), str(m.get("content") or "")
    return str(getattr(m, "role", "") or ""), str(getattr(m, "content", "") or "")


def prompt_key(request: Any, config: AffinityConfig) -> PromptKey:
    """The blocks and anchor of ``request``'s prompt, as its server will see it (its messages in
    order, or its prompt), under its model (a server's cache is per model)."""
    model = zlib.crc32(str(getattr(request, "model", "") or "").encode())
    messages = getattr(request, "messages", None)
    anchor_end = None
    system_end = 0
    continued = False
    if messages:
        parts = []
        length = 0
        for i, m in enumerate(messages):
            role, content = _role_and_content(m)
            part = f"{role}\n{content}\n"
            parts.append(part)
            length += len(part)
            if anchor_end is None:
                if role != "system":
                    anchor_end = length
                else:
                    system_end = length
            if role == "assistant" and i < len(messages) - 1:
                continued = True
        text = "".join(parts)
    else:
        text = str(getattr(request, "prompt", "") or "")
    ascii_text = text.isascii()
    data = text.encode("utf-8", "surrogatepass")
    size = config.block_chars
    ends = block_ends(size, config.max_blocks)
    if anchor_end is None:
        anchor_end = size * config.anchor_blocks
        shared = config.anchor_blocks
    else:
        if not ascii_text:
            system_end = len(text[:system_end].encode("utf-8", "surrogatepass"))
            anchor_end = len(text[:anchor_end].encode("utf-8", "surrogatepass"))
        shared = bisect_right(ends, system_end)
    blocks = []
    append = blocks.append
    crc = model
    crc32 = zlib.crc32
    start = 0
    for i in range(bisect_right(ends, len(data))):
        end = ends[i]
        crc = crc32(data[start:end], crc)
        append(crc | (i << 32))
        start = end
    anchor = crc32(data[:anchor_end], model)
    metadata = getattr(request, "metadata", None)
    key = metadata.get(CACHE_KEY) if metadata else None
    if key:
        anchor = crc32(key.encode("utf-8", "surrogatepass"), model ^ 0x5A5A5A5A)
        continued = True
    return PromptKey(blocks, anchor, shared, continued, len(text))


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit value of ``x``, the same in every process."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class PrefixAffinity:
    """The index and the choice (one per backend; used by one event loop, no locks)."""

    def __init__(self, config: AffinityConfig = AffinityConfig(), name: Callable[[Hashable], str] = str):
        self.config = config
        self._name = name
        self._seed: dict[Hashable, int] = {}
        self._index: dict[Hashable, OrderedDict[int, float]] = {}
        #: Requests waiting for a busy server: request id → (since when, which server).
        self._deferred: OrderedDict[str, tuple[float, Hashable]] = OrderedDict()

    def waiting_for(self, request_id: str, now: float) -> Hashable | None:
        """The server ``request_id`` still waits for (its wait not over), or None: lets a caller
        that asks again before that server has a slot answer without a new choice."""
        entry = self._deferred.get(request_id)
        if entry is None or now - entry[0] >= self.config.wait_s:
            return None
        return entry[1]

    # -- the index -----------------------------------------------------------------------
    def _blocks_of(self, server: Hashable) -> OrderedDict[int, float]:
        index = self._index.get(server)
        if index is None:
            index = self._index[server] = OrderedDict()
        return index

    def match(self, server: Hashable, blocks: Sequence[int], now: float) -> tuple[int, float | None]:
        """(blocks of the prompt's start the server was sent within ttl_s, when the deepest was)."""
        index = self._index.get(server)
        if not index or not blocks:
            return 0, None
        oldest = now - self.config.ttl_s
        get = index.get
        # Blocks are recorded deepest first (below), so a server's entries for one prompt go
        # from the start: a binary search for the last one found.
        lo, hi = 0, len(blocks)
        while lo < hi:
            mid = (lo + hi) // 2
            at = get(blocks[mid])
            if at is not None and at >= oldest:
                lo = mid + 1
            else:
                hi = mid
        return lo, get(blocks[lo - 1]) if lo else None

    def record(self, server: Hashable, key: PromptKey, now: float) -> None:
        """``key``'s prompt went to ``server``: it will hold its blocks."""
        index = self._blocks_of(server)
        move = index.move_to_end
        # The deepest block first: the start of a prompt, which later prompts share, is the most
        # recent entry and the last to be evicted (as vLLM frees a request's blocks tail first).
        for block in reversed(key.blocks):
            index[block] = now
            move(block)
        limit = self.config.index_blocks
        oldest = now - self.config.ttl_s
        while index and (len(index) > limit or next(iter(index.values())) < oldest):
            index.popitem(last=False)

    def correct(self, server: Hashable, key: PromptKey, choice: Choice, cached_tokens: int | None,
                prompt_tokens: int) -> bool:
        """The server's answer says how many prompt tokens it had cached; fewer than the index
        expected (by more than a block) means it evicted what it was sent before the deepest
        matched block: forget those entries. Returns whether it corrected anything."""
        if cached_tokens is None or choice.matched <= 0 or choice.seen_at is None or prompt_tokens <= 0:
            return False
        chars_per_token = key.chars / prompt_tokens if prompt_tokens else 4.0
        held = int(cached_tokens * chars_per_token) // self.config.block_chars
        if held + 1 >= choice.matched:
            return False
        index = self._index.get(server)
        if not index:
            return False
        seen_at = choice.seen_at
        while index and next(iter(index.values())) <= seen_at:
            index.popitem(last=False)
        return True

    def forget(self, server: Hashable) -> None:
        """The server lost its cache (it restarted): nothing it was sent is there any more."""
        self._index.pop(server, None)

    def indexed(self, server: Hashable) -> int:
        return len(self._index.get(server, ()))

    # -- the choice ----------------------------------------------------------------------
    def rank(self, server: Hashable, anchor: int) -> int:
        seed = self._seed.get(server)
        if seed is None:
            seed = self._seed[server] = zlib.crc32(self._name(server).encode()) * 0x100000001
        return _mix(anchor ^ seed)

    def choose(self, key: PromptKey, servers: Sequence[Hashable], load: Callable[[Hashable], float],
               free: Callable[[Hashable], int], now: float, request_id: str = "") -> Choice:
        """The server for a call of ``key`` among ``servers`` (up, not excluded, at least one)."""
        cfg = self.config
        n = len(servers)
        loads = [load(s) for s in servers]
        frees = [free(s) > 0 for s in servers]
        cap = max(math.ceil((1.0 + cfg.epsilon) * (sum(loads) + 1.0) / n), cfg.bound_floor)
        # Taking it now must keep a server within the bound; waiting for a server is allowed while
        # it is within the bound once one of its calls ends (its slot frees, its load drops).
        within = [loads[i] + 1.0 <= cap for i in range(n)]
        within_later = [loads[i] <= cap for i in range(n)]
        blocks, min_match, shared = key.blocks, cfg.min_match_blocks, key.shared
        best = wanted = None
        best_score = wanted_score = None
        matches: list[tuple[int, float | None]] = []
        for i, server in enumerate(servers):
            m = self.match(server, blocks, now)
            matches.append(m)
            if not within_later[i]:
                continue
            score = (m[0] if m[0] - shared >= min_match else 0, self.rank(server, key.anchor))
            if wanted_score is None or score > wanted_score:
                wanted, wanted_score = i, score
            if within[i] and frees[i] and (best_score is None or score > best_score):
                best, best_score = i, score
        if wanted is not None and wanted != best and (wanted_score[0] > 0 or key.continued) and cfg.wait_s > 0:
            entry = self._deferred.get(request_id) if request_id else None
            first = entry[0] if entry is not None else None
            if request_id and entry is None:
                first = now
                if len(self._deferred) >= 4096:
                    self._deferred.popitem(last=False)
            if request_id:
                self._deferred[request_id] = (first, servers[wanted])
            if first is not None and now - first < cfg.wait_s:
                return Choice(None, "deferred", *matches[wanted])
        if request_id and self._deferred:
            self._deferred.pop(request_id, None)
        if best is not None:
            top = max(range(n), key=lambda i: self.rank(servers[i], key.anchor))
            reason = "prefix" if best_score[0] > 0 else ("home" if best == top else "spill")
            return Choice(servers[best], reason, *matches[best])
        with_slot = [i for i in range(n) if frees[i]] or range(n)
        i = min(with_slot, key=lambda i: loads[i])
        return Choice(servers[i], "least_loaded", *matches[i])
