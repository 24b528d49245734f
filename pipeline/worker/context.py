"""One worker's parts, made once and in the order they depend on each other.

As quixstreams' ``ProcessingContext`` does for its application, this holds what a worker's
parts share and hands each part the ones it uses, so the loop (loop.py) only drives them. It
does no I/O: a session's clients are made when the session starts and live in
:class:`~pipeline.worker.state.Session`.

The parts, bottom up: the bands' fair queues (scheduler.py), pausing (flow.py), getting bytes to the
broker (publisher.py), offsets and transactions (checkpoint.py), ids seen again (dedupe.py),
each request's one outcome (responder.py), streamed chunks (chunk_publisher.py), answers other
workers gave to copies dispatched again (earlier_answers.py); the
processor (processor.py), which runs requests through them, is made from this context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipeline.config import Settings, WorkerSettings
from pipeline.observability.metrics import WorkerMetrics
from pipeline.serde import Codec
from pipeline.worker.checkpoint import OffsetCheckpoint
from pipeline.worker.chunk_publisher import ChunkPublisher
from pipeline.worker.dedupe import RecentRequests
from pipeline.worker.earlier_answers import EarlierAnswers
from pipeline.worker.flow import Flow
from pipeline.worker.publisher import Publisher
from pipeline.worker.replies import ReplyTargets
from pipeline.worker.responder import Responder
from pipeline.worker.scheduler import Scheduler
from pipeline.worker.state import Session, WorkerStats


@dataclass(eq=False)
class WorkerContext:
    settings: Settings
    worker_id: str
    codec: Codec
    #: The request (or dispatch) topics this worker consumes.
    topics: list[str]
    stats: WorkerStats
    metrics: WorkerMetrics
    session: Session
    scheduler: Scheduler
    flow: Flow
    publisher: Publisher
    checkpoint: OffsetCheckpoint
    recent: RecentRequests
    responder: Responder
    chunks: ChunkPublisher
    earlier: EarlierAnswers

    @property
    def cfg(self) -> WorkerSettings:
        return self.settings.worker

    @classmethod
    def build(cls, settings: Settings, *, topics: list[str], codec: Codec, worker_id: str,
              metrics: WorkerMetrics, weights: Callable[[str], float] | None = None) -> "WorkerContext":
        cfg = settings.worker
        stats, session = WorkerStats(), Session()
        scheduler = Scheduler(settings, topics, stats, metrics, weights)
        publisher = Publisher(settings, codec, worker_id, session, ReplyTargets(settings, session), stats, metrics)
        checkpoint = OffsetCheckpoint(cfg, session, stats, metrics, publish=publisher.produce)
        recent = RecentRequests(cfg.dedupe_window, checkpoint.exactly_once)
        targets = publisher.targets
        earlier = EarlierAnswers(settings, worker_id, codec.decode_response, targets.partitions,
                                 cfg.look_back_max_records if cfg.dedupe_window else 0)
        return cls(settings=settings, worker_id=worker_id, codec=codec, topics=topics, stats=stats, metrics=metrics,
                   session=session, scheduler=scheduler, flow=Flow(cfg, session, scheduler), publisher=publisher,
                   checkpoint=checkpoint, recent=recent,
                   responder=Responder(settings, codec, worker_id, session, checkpoint, publisher, recent, stats,
                                       metrics),
                   chunks=ChunkPublisher(settings, codec, worker_id, session, checkpoint.exactly_once),
                   earlier=earlier)

    def reset(self) -> None:
        """A new session starts from the committed offsets: nothing taken is kept."""
        self.session.restart = False
        self.checkpoint.reset()
        self.scheduler.reset()
        self.flow.reset()
        self.recent.clear()
