"""What becomes of taken requests: decode, checks, the backend, the answer.

A chunk of requests goes through each stage in turn, the whole chunk at a time: each stage's
code and data stay warm in the CPU's caches, which makes a stage-by-stage pass markedly
cheaper than message by message. Its answers still leave in message order. A backend call
that does not answer at once (``complete_now``) runs as a task, answered when it ends; the
loop never waits for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from pipeline.errors import DecodeError, LimitExceeded
from pipeline.models import Request, now_ms
from pipeline.policy.validation import validate_request
from pipeline.worker.backends.base import Backend, CatalogedBackend, PacedBackend, StreamingBackend
from pipeline.worker.backends.routing import UnknownModelError
from pipeline.worker.chunk_publisher import stream_completion
from pipeline.worker.context import WorkerContext
from pipeline.worker.dedupe import IN_FLIGHT
from pipeline.worker.earlier_answers import dispatched_again, redelivered
from pipeline.worker.read_back import ReadBack
from pipeline.worker.records import Answered, Taken
from pipeline.worker.state import out_of_doubt

log = logging.getLogger(__name__)


class Processor:
    def __init__(self, ctx: WorkerContext, backend: Backend):
        self.cfg = ctx.cfg
        self.chunks = ctx.chunks
        self.topics_prefix = ctx.settings.topics.prefix  # reply_to must name a topic under it
        self.backend = backend  # see the setter: what the backend can do
        self.codec = ctx.codec
        self.session = ctx.session
        self._session_s = ctx.cfg.session_timeout_ms / 1000.0
        self.responder = ctx.responder
        self.scheduler = ctx.scheduler
        self.flow = ctx.flow
        self.recent = ctx.recent
        self.exactly_once = ctx.checkpoint.exactly_once
        self.earlier = ctx.earlier
        self.stats = ctx.stats
        self.metrics = ctx.metrics
        #: The backend calls running now: (tp, offset) → task.
        self.tasks: dict[tuple[tuple[str, int], int], asyncio.Task] = {}
        self._task_of: dict[str, tuple] = {}  # request id → key in tasks
        self._cancel_requested: set[tuple] = set()
        self._preempted: set[asyncio.Task] = set()
        #: The model of the last request put back this way (what a preemption must make room for).
        self.held_model: str | None = None
        self._held_rank = 0
        #: The messages the last :meth:`process` put back.
        self.put_back: list = []
        self._model_of: dict[tuple, str] = {}  # running call's key → its model
        #: First answers read back (copies dispatched again; records that may have been answered
        #: elsewhere, before they are answered EXPIRED or CANCELLED).
        self.read_back = ReadBack(ctx, self.tasks)

    @property
    def backend(self) -> Backend:
        return self._backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        # Its capabilities are looked up once here, not per request.
        self._backend = backend
        paced = backend if isinstance(backend, PacedBackend) else None
        self.room = paced.room if paced else None
        self._reserve = paced.reserve if paced else None
        self._release = paced.release if paced else None
        self._same_servers = paced.same_servers if paced else None
        self._streams = isinstance(backend, StreamingBackend)
        self._default_model = backend.default_model if isinstance(backend, CatalogedBackend) else str

    @property
    def releasing(self) -> int:
        """Preempted calls not ended yet: the backend slots they hold are about to be free."""
        return len(self._preempted)

    def reset(self) -> None:
        self.tasks.clear()
        self._task_of.clear()
        self._preempted.clear()
        self._model_of.clear()
        self.read_back.forget()

    # -- a chunk ---------------------------------------------------------------------------

    def decode(self, msg) -> Request | None:
        """A taken message's request, or None once it is answered here: REJECTED if it is over a
        size cap yet says who sent it (see Codec.decode_request), else dead-lettered."""
        value = msg.value()
        try:
            if not value:
                raise DecodeError("empty", "message has no value (empty or tombstone)")
            request = self.codec.decode_request(value)
            if not request.model:  # it names none: the model its servers serve by default
                request.model = self._default_model()
            return request
        except DecodeError as exc:
            stats = self.stats
            if not stats.consumed:
                stats.first_consumed_at = time.perf_counter()
            stats.consumed += 1
            tp = (msg.topic(), msg.partition())
            if isinstance(exc, LimitExceeded) and exc.request is not None:
                self.responder.reject(tp, msg.offset(), exc.request, exc.refusal)
            else:
                self.responder.dead_letter(msg, tp, msg.offset(), exc.reason, str(exc))
            return None

    def process(self, entries: list, max_start: int | None = None) -> int:
        """Run queued requests (the scheduler's :class:`~pipeline.policy.fair_queue.Waiting`
        entries, each holding its message and decoded request) through the checks, the backend
        and the answer, one stage at a time over the whole chunk. Returns how many were put back
        in their queues (listed in :attr:`put_back`): their model's servers had no room, or
        ``max_start`` calls had started already. They are taken again later, as they are.

        Every request still ends in exactly one outcome: a rejection, CANCELLED, EXPIRED,
        FAILED, a COMPLETED answer (``complete_now``), or a backend task. (Undecodable ones
        were dead-lettered when taken: :meth:`decode`.)
        """
        stats, responder = self.stats, self.responder
        if not stats.consumed:
            stats.first_consumed_at = time.perf_counter()
        stats.consumed += len(entries)
        started = now_ms()
        cancellations = self.session.cancellations
        seen, partial, prefix = self.recent.check, functools.partial, self.topics_prefix
        may_be_answered = self.read_back.may_be_answered
        # Answers go out in message order (a copy of a request answered in the same chunk is
        # given that answer): message by message, either a deferred answer (a callable) or a
        # Taken whose answer the backend stage fills in (or replaces by a FAILED one).
        outcomes: list = []
        runnable = []
        settling = []  # EXPIRED or CANCELLED once no first answer is found (read_back.py)
        for waiting in entries:
            msg, request = waiting.item
            tp, offset = (msg.topic(), msg.partition()), msg.offset()
            invalid = validate_request(request, started, prefix)
            if invalid is not None:
                outcomes.append(partial(responder.reject, tp, offset, request, invalid))
                continue
            first = seen(request.request_id, (tp, offset))
            if first is not None:
                # Decided when its turn to be answered comes: the first may be answered by then.
                # Exactly-once, a copy the gateway redelivered is not answered again: the first
                # answer is what read_committed readers see, once.
                again = not (self.exactly_once and first is not IN_FLIGHT and redelivered(msg.headers()))
                outcomes.append(partial(responder.duplicate, tp, offset, request,
                                        None if first is IN_FLIGHT else first, again))
                continue
            # EXPIRED and CANCELLED are statuses a first answer may contradict: a record that
            # may have been answered elsewhere looks for that answer first.
            if cancellations is not None:
                cancelled = cancellations.reason(request.request_id)
                if cancelled is not None:
                    answer = partial(responder.cancelled, tp, offset, request, started, cancelled)
                    if may_be_answered(msg, tp, request):
                        settling.append((answer, msg.headers()))
                    else:
                        outcomes.append(answer)
                    continue
            if request.created_at + request.timeout_ms <= started:
                answer = partial(responder.expire, tp, offset, request, started)
                if may_be_answered(msg, tp, request):
                    settling.append((answer, msg.headers()))
                else:
                    outcomes.append(answer)
                continue
            entry = Taken(msg, request, None, len(outcomes), waiting)
            outcomes.append(entry)
            runnable.append(entry)
        done = []
        self.put_back = []
        put_back = self._run(runnable, outcomes, done, started, max_start) if runnable else 0
        if len(done) == len(outcomes):
            if done:
                responder.completed_many(done, started)
        else:
            self._respond_in_order(outcomes, started)
        for answer, headers in settling:
            self.read_back.settle(answer, dispatched_again(headers))
        return put_back

    def _run(self, runnable: list, outcomes: list, done: list, started: int, max_start: int | None) -> int:
        """The backend stage: an answer now, or a call that runs as a task (once the backend
        has a slot for it; else the message goes back to its queue). Returns how many went back."""
        backend, responder = self.backend, self.responder
        complete_now, call_started = backend.complete_now, self.scheduler.call_started
        reserve = self._reserve
        create_task = None  # a loop is running only if some call does not answer at once
        waits: list = []
        back: list = []
        counts = self.scheduler.preempt_counts
        budget = max_start
        # A copy dispatched again that this worker has no memory of: its first answer is read
        # back before anything runs (earlier_answers.py), in a task like a backend call.
        look_back_on = self.earlier.enabled
        for entry in runnable:
            msg, request = entry.msg, entry.request
            tp, offset = (msg.topic(), msg.partition()), msg.offset()
            key = (tp, offset)
            slot = None
            look_back = (dispatched_again(msg.headers()) if look_back_on and request.admitted_at is not None
                         else None)
            try:
                completion = None if look_back is not None else complete_now(request)
                if completion is None:
                    if budget is not None and budget <= 0:
                        back.append(entry)
                        continue
                    if reserve is not None:
                        slot = reserve(request)
                        if slot is None:
                            back.append(entry)
                            continue
            except UnknownModelError:
                outcomes[entry.index] = functools.partial(responder.model_unavailable, tp, offset, request, started)
                continue
            except Exception as exc:  # answered FAILED in its place, like a failed backend call
                outcomes[entry.index] = functools.partial(responder.backend_failed, tp, offset, request, started,
                                                       exc, backend.name)
                continue
            # A preempted request's wait was observed when it first started: once per request.
            if not counts or key not in counts:
                waits.append(entry)
            if completion is not None:
                entry.answered = item = Answered(tp, offset, request, completion)
                done.append(item)
                if entry.waiting is not None:
                    self._served(entry.waiting, completion)
                continue
            if create_task is None:
                create_task = asyncio.get_running_loop().create_task
            if budget is not None:
                budget -= 1
            self.tasks[key] = task = create_task(self._call(tp, offset, request, started, slot, entry.waiting,
                                                            look_back))
            if slot is not None:
                # Released however the task ends, even cancelled before it ever ran.
                task.add_done_callback(functools.partial(self._release_slot, slot))
            self._task_of[request.request_id] = key
            self._model_of[key] = request.model
            call_started(key, entry.waiting, task, request.request_id)
        if waits:
            self.metrics.waited_many(waits, started)
        if back:
            self._put_back(back)
        return len(back)

    def _put_back(self, entries: list) -> None:
        """Requests whose model's servers have no free slot: back in their places in their
        queues (taken again, they are not counted again)."""
        put_back = self.scheduler.put_back
        for entry in reversed(entries):
            put_back(entry.waiting)
            self.put_back.append(entry.waiting)
        # The most urgent of them is the one a preemption would make room for.
        urgent = min(entries, key=lambda e: e.request.serving_priority.rank).request
        if self.held_model is None or urgent.serving_priority.rank < self._held_rank:
            self.held_model, self._held_rank = urgent.model, urgent.serving_priority.rank
        self.stats.consumed -= len(entries)

    def _release_slot(self, slot, task) -> None:
        self._release(slot)

    def _respond_in_order(self, outcomes: list, started: int) -> None:
        """The chunk's answers in message order: the deferred ones called, the runs of
        completed ones between them answered together."""
        completed_many = self.responder.completed_many
        run: list = []
        for item in outcomes:
            if callable(item):
                if run:
                    completed_many(run, started)
                    run = []
                item()
            elif item.answered is not None:
                run.append(item.answered)
        if run:
            completed_many(run, started)

    # -- backend calls -----------------------------------------------------------------------

    def _served(self, waiting, completion) -> None:
        """A request was served: its tenant's fair-queue counter learns the real usage."""
        cost = self.scheduler.settle(waiting, completion.prompt_tokens, completion.completion_tokens)
        self.metrics.served(waiting.tenant, self.scheduler.rank_of(waiting.partition[0]), cost)

    async def _call(self, tp, offset: int, request: Request, started: int, slot=None, waiting=None,
                    look_back: bytes | None = None) -> None:
        """``look_back``: why the gateway dispatched ``request`` again (see earlier_answers.py), or
        None for a first dispatch."""
        self.metrics.inflight_child.inc()
        t0 = time.perf_counter()
        key = (tp, offset)
        try:
            backend = self.backend
            completion = None
            if look_back is not None:
                if await self.read_back.answered_before(tp, offset, request, look_back):
                    return
                completion = backend.complete_now(request)
            if completion is None:
                if request.stream and self._streams and self.chunks is not None:
                    completion = await stream_completion(backend, request, slot, self.chunks, self.metrics,
                                                         lambda: self.scheduler.keep(key))
                else:
                    completion = await (backend.complete(request) if slot is None
                                        else backend.complete(request, slot))
            if self.session.in_doubt(time.monotonic(), self._session_s):
                # Finished across a freeze past the group session: answered only once the group
                # has said the partition is still ours (lost, this task is handed back first).
                await out_of_doubt(self.session, self._session_s)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me in self._preempted:  # back in its queue (preempted): no answer now
                return
            if key in self._cancel_requested:  # the client cancelled it: answer that
                self._cancel_requested.discard(key)
                self.responder.cancelled(tp, offset, request, started,
                                         self.session.cancellations.reason(request.request_id) or "cancelled")
                return
            # Handed back (shutdown or revocation): the offset stays uncommitted, so the
            # partition's next owner runs the request.
            raise
        except UnknownModelError:
            self.responder.model_unavailable(tp, offset, request, started)
        except Exception as exc:  # a backend bug must not lose the request
            self.responder.backend_failed(tp, offset, request, started, exc, self.backend.name)
        else:
            if waiting is not None:
                self._served(waiting, completion)
            self.responder.completed_many([Answered(tp, offset, request, completion)], started,
                                          time.perf_counter() - t0)
        finally:
            self.metrics.inflight_child.dec()
            me = asyncio.current_task()
            # A preempted call's key may already belong to its next run.
            if self.tasks.get(key) is me:
                del self.tasks[key]
                self._model_of.pop(key, None)
                if self._task_of.get(request.request_id) == key:
                    del self._task_of[request.request_id]
                self.scheduler.call_ended(key, me)
            self.flow.slot_freed()

    def cancel(self, request_id: str) -> None:
        """The client cancelled ``request_id``: if its call is running, stop it and answer CANCELLED."""
        key = self._task_of.get(request_id)
        task = self.tasks.get(key) if key is not None else None
        if task is not None and not task.done():
            self._cancel_requested.add(key)
            task.cancel()

    def preempt(self, for_model: str | None = None) -> bool:
        """Every slot is busy: give one running call's slot to a waiting request of a higher band
        (or of a tenant crowded out of its band). The call's message is back in its queue; it is
        answered once, when it runs again. ``for_model``: the waiting request needs a slot on
        that model's servers, so only a call holding one of those may give way."""
        accept = None
        if for_model is not None and self._same_servers is not None:
            same, model_of = self._same_servers, self._model_of
            accept = lambda key: key in model_of and same(for_model, model_of[key])  # noqa: E731
        victim = self.scheduler.preempt(accept)
        if victim is None:
            return False
        key, task, request_id = victim
        self.tasks.pop(key, None)
        self._model_of.pop(key, None)
        self._preempted.add(task)
        # Done, not only answered: a task cancelled before it ever ran runs none of its code.
        task.add_done_callback(self._preempted.discard)
        task.cancel()
        # It is taken again when it runs again: not a second request. Its id stays in flight, so
        # a copy arriving meanwhile waits for its answer.
        self.stats.consumed -= 1
        self._task_of.pop(request_id, None)
        return True

    def hand_back(self, partitions: set) -> None:
        """Cancel the calls of ``partitions`` without an answer: their offsets stay uncommitted."""
        self.read_back.forget(partitions)
        for key, task in list(self.tasks.items()):
            if key[0] in partitions:
                task.cancel()
                self.tasks.pop(key, None)
                self._model_of.pop(key, None)

    async def stop_all(self) -> None:
        """Cancel every running call and wait for them: what is unanswered is handed back."""
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
