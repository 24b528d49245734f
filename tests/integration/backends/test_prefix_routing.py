"""Routing by cache against real simulator servers over HTTP: a conversation's turns go to the
server holding its history (its answers say cached_tokens), two backends that share nothing place
it alike, and when its server dies its conversations move to the others and are answered."""

from __future__ import annotations

import asyncio

from pipeline.models import Request
from pipeline.observability.metrics import RoutingSeries
from pipeline.simulator import EngineConfig, SimulatorConfig, SimulatorServer
from pipeline.worker.backends.openai_http import OpenAIBackend
from pipeline.worker.backends.routing import RoutingTable

SYSTEM = "You answer questions about the weather in great detail. " * 20


def _sims(n: int = 4) -> list[SimulatorServer]:
    engine = EngineConfig(max_num_seqs=8, ttft_ms=2, ms_per_token=1, prefill_ms_per_token=0.01)
    return [SimulatorServer(SimulatorConfig(engine=engine, output_tokens=8)) for _ in range(n)]


def _turn(conversation: int, turn: int) -> Request:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"conversation {conversation}: what about tomorrow? " * 8}]
    for t in range(1, turn):
        messages += [{"role": "assistant", "content": f"turn {t} answer " * 30},
                     {"role": "user", "content": f"and then, {t}?"}]
    return Request.new(f"tenant-{conversation % 3}", None, messages=messages, model="sim-small", max_tokens=8,
                       timeout_ms=30_000)


def _backend(sims, metrics) -> OpenAIBackend:
    return OpenAIBackend(routes=RoutingTable({"*": [s.base_url for s in sims]}), routing_metrics=metrics)



def test_turns_follow_their_history_and_two_backends_agree():
    async def go():
        sims = _sims()
        for s in sims:
            await s.start()
        one_metrics, two_metrics = RoutingSeries(), RoutingSeries()
        one, two = _backend(sims, one_metrics), _backend(sims, two_metrics)
        try:
            for turn in (1, 2, 3):
                # Alternate backends turn by turn: the second knows nothing of what the first sent.
                for c in range(12):
                    backend = one if (c + turn) % 2 else two
                    await backend.complete(_turn(c, turn))
            return ([s.engine.cache.hits / max(1, s.engine.cache.queries) for s in sims], [s.requests_seen for s in sims],
                    one_metrics, two_metrics)
        finally:
            await one.close()
            await two.close()
            for s in sims:
                await s.stop()

    ratios, seen, m1, m2 = asyncio.run(go())
    hits = sum(c.value for m in (m1, m2) for c in m.cached_prompt_tokens.children.values())
    prompt = sum(c.value for m in (m1, m2) for c in m.prompt_tokens.children.values())
    # Turns 2 and 3 find their whole history but its last block cached, from either backend.
    assert hits / prompt > 0.55, (ratios, seen)
    reasons = {k[1] for m in (m1, m2) for k in m.routes.children}
    assert reasons <= {"home", "prefix"}, reasons
    assert sum(seen) == 36 and max(seen) <= 36 / 4 * 2


def test_a_dead_servers_conversations_move_and_are_answered():
    async def go():
        sims = _sims()
        for s in sims:
            await s.start()
        metrics = RoutingSeries()
        backend = _backend(sims, metrics)
        try:
            for c in range(12):
                await backend.complete(_turn(c, 1))
            victim = max(sims, key=lambda s: s.requests_seen)
            moved = victim.requests_seen
            await victim.stop()
            answers = [await backend.complete(_turn(c, 2)) for c in range(12)]
            third = [await backend.complete(_turn(c, 3)) for c in range(12)]
            alive = [s for s in sims if s is not victim]
            return answers + third, moved, alive
        finally:
            await backend.close()
            for s in sims:
                await s.stop()

    answers, moved, alive = asyncio.run(go())
    assert all(a.output for a in answers)
    # The third turns of the moved conversations found the second turns' history where it went.
    hits = sum(s.engine.cache.hits for s in alive)
    assert moved >= 1 and hits > 0
