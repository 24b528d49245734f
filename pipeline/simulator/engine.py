"""The simulator's engine: a pure, clock-free model of vLLM's continuous-batching scheduler.

What it models (vLLM's documented behaviour, simplified):

* at most ``max_num_seqs`` sequences run at once; the others wait in one FCFS queue;
* continuous batching: the engine runs in steps, and a waiting request joins the running
  batch at the start of the next step when a slot (and KV cache for it) is free; a
  finished or aborted request leaves at the end of its step and frees its slot;
* a request's KV cache (prompt + max_tokens tokens) is reserved when it joins; a request
  that does not fit waits, even with a slot free (no preemption, unlike vLLM, which
  preempts and recomputes when decoding runs out of blocks);
* every step, each running sequence that has been prefilled emits one token; a joining
  request's prefill is done in its first step, which also emits its first token (vLLM's
  chunked prefill mixes prefill and decode in one step);
* automatic prefix caching (``prefix_caching``, on as in vLLM): a joiner's prefill skips the
  blocks of its prompt the cache still holds (:mod:`prefix_cache`: 16-token blocks, chained
  hashes, least recently used free blocks evicted), and ``prompt_tokens`` in the step's cost
  below are only its uncached ones.

Step duration, for a batch of ``B`` running sequences of which ``J`` join in this step::

    step_ms = ms_per_token * (1 + batch_slowdown * (B - 1))
              + sum over the J joiners of (ttft_ms + prefill_ms_per_token * prompt_tokens)

So the time per output token grows linearly with the batch (``batch_slowdown`` is the
extra cost of each further sequence, as memory-bandwidth-bound decoding of a larger
batch is slower per step), and a request's time to first token is its wait in the
queue plus the step it joins in: ``ttft_ms`` (plus its prompt) on top of the decode
step of the batch it joins, so it also grows with the batch. Joiners make the
running requests' step longer too, as a prefill does on a real engine.

The engine knows nothing of time or sockets: :meth:`Engine.step` takes the current
time (seconds, any clock) and returns how long the step lasts and what it produced; the
HTTP server sleeps that long and delivers the tokens, and the tests drive it by hand.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pipeline.simulator.prefix_cache import BLOCK_TOKENS, PrefixCache


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    ttft_ms: float = 20.0
    ms_per_token: float = 5.0
    batch_slowdown: float = 0.05
    prefill_ms_per_token: float = 0.0
    #: KV cache capacity in tokens (prompt + max_tokens reserved per running request).
    kv_cache_tokens: int = 16 * 4096
    max_model_len: int = 4096
    #: Reuse cached prompt blocks (vLLM's automatic prefix caching, on by default in vLLM).
    prefix_caching: bool = True
    #: Report cached blocks nobody holds as used in kv_cache_usage_perc (vLLM counts them as
    #: free): a cache that fills up then reads full while the server runs nothing. For tests.
    kv_usage_counts_cached: bool = False

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        for name in ("ttft_ms", "ms_per_token", "batch_slowdown", "prefill_ms_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.max_model_len < 2 or self.kv_cache_tokens < self.max_model_len:
            raise ValueError("kv_cache_tokens must hold at least one max_model_len sequence")

    def step_ms(self, batch: int, joiner_prompts: list[int] | tuple[int, ...] = ()) -> float:
        """The duration of a step with ``batch`` running sequences (joiners included)."""
        decode = self.ms_per_token * (1.0 + self.batch_slowdown * max(0, batch - 1)) if batch else 0.0
        return decode + sum(self.ttft_ms + self.prefill_ms_per_token * p for p in joiner_prompts)


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrived_at: float
    generated: int = 0
    joined_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False
    #: The chained hashes of the prompt's full blocks (prefix_cache.block_hashes).
    blocks: tuple[int, ...] = ()
    #: Prompt tokens found in the prefix cache when it joined.
    cached_tokens: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def done(self) -> bool:
        return self.generated >= self.max_tokens


@dataclass
class StepResult:
    """What one step did: ``tokens`` (sequence, index of the token it emitted), in batch order."""

    started_at: float
    duration_s: float
    joined: list[Sequence] = field(default_factory=list)
    tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)

    @property
    def ends_at(self) -> float:
        return self.started_at + self.duration_s


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv_used = 0
        self.steps = 0
        self.max_waiting_seen = 0
        self.max_running_seen = 0
        self.cache = PrefixCache(config.kv_cache_tokens // BLOCK_TOKENS) if config.prefix_caching else None

    # -- what the server reads ------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV cache in use, 0..1 (``vllm:kv_cache_usage_perc``)."""
        used = self.kv_used
        if self.config.kv_usage_counts_cached and self.cache is not None:
            used += self.cache.free_cached * BLOCK_TOKENS
        return min(1.0, used / self.config.kv_cache_tokens)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    # -- requests in and out -------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        if seq.kv_tokens > self.config.max_model_len:
            raise ValueError(f"prompt ({seq.prompt_tokens} tokens) plus max_tokens ({seq.max_tokens}) exceed "
                             f"the maximum context length of {self.config.max_model_len} tokens")
        if seq.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """The client went away: the sequence leaves the queue or the batch at once."""
        if seq.aborted or seq.finished_at is not None:
            return
        seq.aborted = True
        if seq in self.running:
            self.running.remove(seq)
            self._leave(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass

    # -- the scheduler ---------------------------------------------------------
    def _admit(self, now: float) -> list[Sequence]:
        joined = []
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            head = self.waiting[0]
            if self.kv_used + head.kv_tokens > cfg.kv_cache_tokens:
                break  # FCFS: the head waits for cache, and so does everyone behind it
            self.waiting.popleft()
            head.joined_at = now
            self.kv_used += head.kv_tokens
            if self.cache is not None:
                head.cached_tokens = self.cache.acquire(head.blocks, head.prompt_tokens)
            self.running.append(head)
            joined.append(head)
        if joined and self.cache is not None:
            self.cache.trim(self._room_blocks())
        return joined

    def _room_blocks(self) -> int:
        """Blocks the running requests leave for cached free ones."""
        return self.config.kv_cache_tokens // BLOCK_TOKENS - -(-self.kv_used // BLOCK_TOKENS)

    def _leave(self, seq: Sequence) -> None:
        self.kv_used -= seq.kv_tokens
        if self.cache is not None:
            self.cache.release(seq.blocks)
            self.cache.trim(self._room_blocks())

    def step(self, now: float) -> StepResult | None:
        """Plan the next step starting at ``now``; ``None`` when there is nothing to run.

        The tokens and finishes it reports happen at ``result.ends_at``; call
        :meth:`finish_step` then (a sequence aborted meanwhile is skipped).
        """
        joined = self._admit(now)
        # Queued for real: still waiting once the step took whom it could (a request that
        # arrived during a step waits for its end however free the slots are).
        self.max_waiting_seen = max(self.max_waiting_seen, len(self.waiting))
        if not self.running:
            return None
        self.steps += 1
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        uncached = [s.prompt_tokens - s.cached_tokens for s in joined]
        duration = self.config.step_ms(len(self.running), uncached) / 1000.0
        return StepResult(now, duration, joined, [(s, s.generated) for s in self.running])

    def finish_step(self, result: StepResult) -> StepResult:
        end = result.ends_at
        emitted = []
        for seq, index in result.tokens:
            if seq.aborted:
                continue
            seq.generated = index + 1
            if index == 0:
                seq.first_token_at = end
            emitted.append((seq, index))
            if seq.done:
                seq.finished_at = end
                result.finished.append(seq)
        result.tokens = emitted
        for seq in result.finished:
            self.running.remove(seq)
            self._leave(seq)
        return result

    def run_until_idle(self, now: float = 0.0, max_steps: int = 1_000_000) -> float:
        """Run every step back to back from ``now`` (for tests); returns the time it ends."""
        for _ in range(max_steps):
            result = self.step(now)
            if result is None:
                return now
            self.finish_step(result)
            now = result.ends_at
        raise RuntimeError("the engine did not go idle")
