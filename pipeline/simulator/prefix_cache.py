"""The simulator's prefix cache, as vLLM's automatic prefix caching keeps one. Pure, no I/O.

* A prompt is cut into blocks of ``BLOCK_TOKENS`` tokens; only full blocks are cached. A
  block's hash chains its parent's, so a block matches only after the same whole prefix.
* A request joining the batch reuses the longest run of cached blocks at its prompt's start
  (its prefill skips them) and, when even its last block is cached, recomputes that one: the
  model needs at least one prompt token to produce the first output token, as vLLM does.
* Blocks held by running requests are never evicted. A finished request's blocks stay cached
  as *free* blocks, least recently used first in line for eviction when the KV cache needs
  their room (``room_blocks``: what the running requests leave).
* vLLM counts cached blocks that no request holds as free in ``kv_cache_usage_perc``; so does
  :attr:`PrefixCache.free_cached` feed the engine's reading only when asked to count them
  (a server that reads full while idle, for tests).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

BLOCK_TOKENS = 16
#: The simulator's tokenizer takes about four characters per token (text.count_prompt_tokens).
CHARS_PER_TOKEN = 4
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN


def block_hashes(prompt: str) -> tuple[int, ...]:
    """The chained hashes of the full blocks of ``prompt`` as the simulator tokenizes it."""
    out = []
    parent = 0
    for start in range(0, len(prompt) - BLOCK_CHARS + 1, BLOCK_CHARS):
        parent = hash((parent, prompt[start:start + BLOCK_CHARS]))
        out.append(parent)
    return tuple(out)


def reusable_blocks(matched: int, prompt_tokens: int) -> int:
    """Of ``matched`` cached blocks at a prompt's start, those its prefill may skip (not the
    last prompt token's block: something must be computed to sample the first output token)."""
    if matched * BLOCK_TOKENS >= prompt_tokens:
        matched = max(0, (prompt_tokens - 1) // BLOCK_TOKENS)
    return matched


class PrefixCache:
    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        #: Blocks some running request holds: hash → how many hold it.
        self.held: dict[int, int] = {}
        #: Cached blocks nobody holds, least recently used first.
        self.free: OrderedDict[int, None] = OrderedDict()
        self.hits = 0  # prompt tokens served from the cache
        self.queries = 0  # prompt tokens looked up
        self.evicted = 0

    def __contains__(self, block: int) -> bool:
        return block in self.held or block in self.free

    @property
    def free_cached(self) -> int:
        return len(self.free)

    def match(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` (a prompt's, in order) are cached, from the start."""
        n = 0
        for block in blocks:
            if block not in self.held and block not in self.free:
                break
            n += 1
        return n

    def acquire(self, blocks: tuple[int, ...], prompt_tokens: int) -> int:
        """A joining request takes its prompt's blocks (cached or now computed); returns the
        prompt tokens it found cached."""
        cached = reusable_blocks(self.match(blocks), prompt_tokens) * BLOCK_TOKENS
        self.queries += prompt_tokens
        self.hits += cached
        held, free = self.held, self.free
        for block in blocks:
            if block in free:
                del free[block]
            held[block] = held.get(block, 0) + 1
        return cached

    def release(self, blocks: tuple[int, ...]) -> None:
        """A request left the batch: blocks nobody else holds become free, most recent last."""
        held, free = self.held, self.free
        for block in blocks:
            count = held.get(block, 0) - 1
            if count > 0:
                held[block] = count
            elif count == 0:
                del held[block]
                free[block] = None
                free.move_to_end(block)

    def trim(self, room_blocks: int) -> None:
        """Evict least recently used free blocks until they fit in ``room_blocks``."""
        free = self.free
        while len(free) > max(0, room_blocks):
            free.popitem(last=False)
            self.evicted += 1

    def clear(self) -> None:
        self.free.clear()
