"""The chaos harness's processes and faults.

* :class:`Supervised`: an llmq process (gateway, worker, serve) restarted when it exits by itself,
  as systemd or Kubernetes would; each such exit is counted.
* :func:`fault_plan`: which faults, when (fractions of the run), spaced so that each one's recovery
  overlaps the next one's rather than the same instant; :func:`soak_plan`: one a minute, for a
  soak (``bench/chaos.py --soak MINUTES``).
* :class:`Faults`: injects them on a :class:`~pipeline.cluster.LocalCluster` and the pool:

  - ``leader:<role>``: SIGKILL the node leading partition 0 of the request, dispatch or response
    topic (NORMAL band), with writes in flight; started again after ``down_s``;
  - ``freeze``: SIGSTOP a node for longer than the brokers' session with the controller (the
    cluster fences it and moves its leaders), then SIGCONT;
  - ``cluster-restart``: every node down at once, then up;
  - ``worker-kill`` / ``worker-stop``: SIGKILL a worker (restarted at once), SIGSTOP one for longer
    than the consumer session (a zombie whose late work must not count twice).
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.cluster import LocalCluster
from pipeline.config import Settings
from pipeline.models import Priority

CLUSTER_FAULTS = ["leader:requests", "leader:dispatch", "leader:responses", "freeze", "cluster-restart"]
WORKER_FAULTS = ["worker-kill", "worker-stop"]


@dataclass
class Supervised:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    unexpected_exits: list[int] = field(default_factory=list)
    stopped: bool = False

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')}\n")
            log.flush()
            self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.log_path.parent)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def check(self, say) -> None:
        if self.proc.poll() is not None and not self.stopped:
            self.unexpected_exits.append(self.proc.returncode)
            say(f"  {self.name} exited by itself (rc {self.proc.returncode}); restarting it")
            self.start()

    def stop(self, timeout: float = 60.0):
        self.stopped = True
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
            return f"killed after {timeout:.0f} s"


def fault_plan(rng: random.Random, kinds: list[str], first: float = 0.05, last: float = 0.85) -> list[tuple[float, str]]:
    """Each fault at a random point of its own slot between ``first`` and ``last`` (fractions of
    the requests written), in random order: spread over the run, never past its end."""
    kinds = list(kinds)
    rng.shuffle(kinds)
    slot = (last - first) / len(kinds)
    return [(first + i * slot + rng.uniform(0.2, 0.8) * slot, kind) for i, kind in enumerate(kinds)]


#: The longest soak ``soak_plan`` schedules: a day, so that a mistyped figure cannot run for ever.
MAX_SOAK_MINUTES = 24 * 60
#: Where in its minute a soak's fault starts: early enough that the slowest fault (a leader
#: down for its ``down_s`` and its successor found) mostly ends within the minute.
SOAK_START_S = (5.0, 25.0)


def soak_plan(rng: random.Random, minutes: int, kinds: list[str]) -> list[tuple[float, str]]:
    """One fault a minute for ``minutes`` minutes, as ``fault_plan`` gives them (fractions of the
    run, in order): minute ``i``'s fault starts between ``SOAK_START_S`` seconds into it, and the
    kinds come round in decks, each deck every kind once in a random order, so that a soak of
    ``len(kinds)`` minutes or more injects every kind."""
    if not 1 <= minutes <= MAX_SOAK_MINUTES:
        raise ValueError(f"a soak runs 1-{MAX_SOAK_MINUTES} minutes, not {minutes}")
    plan, deck = [], []
    total_s = minutes * 60.0
    for minute in range(minutes):
        if not deck:
            deck = list(kinds)
            rng.shuffle(deck)
        plan.append(((minute * 60.0 + rng.uniform(*SOAK_START_S)) / total_s, deck.pop()))
    return plan


class Faults:
    def __init__(self, cluster: LocalCluster, settings: Settings, workers: list[Supervised], rng: random.Random,
                 say, *, down_s: float, freeze_s: float, worker_stop_s: float):
        self.cluster, self.settings, self.workers, self.rng, self.say = cluster, settings, workers, rng, say
        self.down_s, self.freeze_s, self.worker_stop_s = down_s, freeze_s, worker_stop_s

    def topic_of(self, role: str) -> str:
        t = self.settings.topics
        return {"requests": t.request_topic(Priority.NORMAL), "dispatch": t.dispatch_topic(Priority.NORMAL),
                "responses": t.responses}[role]

    def inject(self, kind: str) -> dict:
        """Inject ``kind`` and return once the cluster (or pool) is whole again; what happened."""
        started = time.monotonic()
        if kind.startswith("leader:"):
            topic = self.topic_of(kind.split(":", 1)[1])
            node = self.cluster.leader_of(topic, 0)
            self.say(f"SIGKILL node {node}, leader of {topic}[0]")
            self.cluster.signal(node, signal.SIGKILL)
            time.sleep(0.5)
            successor = self._leader_after(topic, node)
            time.sleep(max(0.0, self.down_s - (time.monotonic() - started)))
            self.cluster.start_node(node)
            event = {"fault": "SIGKILL partition leader", "topic": topic, "node": node, "new_leader": successor[0],
                     "leader_moved_after_s": successor[1]}
        elif kind == "freeze":
            node = self.rng.choice(list(self.cluster.nodes))
            self.say(f"SIGSTOP node {node} for {self.freeze_s:.0f} s")
            self.cluster.signal(node, signal.SIGSTOP)
            time.sleep(self.freeze_s)
            self.cluster.signal(node, signal.SIGCONT)
            event = {"fault": "SIGSTOP broker", "node": node, "stopped_s": self.freeze_s}
        elif kind == "cluster-restart":
            self.say("whole cluster down")
            self.cluster.down()
            time.sleep(3)
            self.cluster.up()
            event = {"fault": "cluster restart"}
        elif kind == "worker-kill":
            victim = self.rng.choice(self.workers)
            self.say(f"SIGKILL {victim.name}")
            victim.stopped = True
            victim.signal(signal.SIGKILL)
            victim.proc.wait(10)
            victim.stopped = False
            victim.start()
            event = {"fault": "SIGKILL worker", "worker": victim.name}
        elif kind == "worker-stop":
            victim = self.rng.choice(self.workers)
            self.say(f"SIGSTOP {victim.name} for {self.worker_stop_s:.0f} s")
            victim.signal(signal.SIGSTOP)
            time.sleep(self.worker_stop_s)
            victim.signal(signal.SIGCONT)
            event = {"fault": "SIGSTOP worker", "worker": victim.name, "stopped_s": self.worker_stop_s}
        else:
            raise ValueError(kind)
        event["kind"] = kind
        event["took_s"] = round(time.monotonic() - started, 1)
        return event

    def _leader_after(self, topic: str, dead: int, timeout: float = 30.0) -> tuple[int, float | None]:
        """The partition's next leader and how long after the kill the metadata named it."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            try:
                leader = self.cluster.leader_of(topic, 0, timeout=5)
            except Exception:  # noqa: BLE001 (metadata while a node is gone: ask again)
                leader = -1
            if leader not in (-1, dead):
                return leader, round(time.monotonic() - started + 0.5, 1)
            time.sleep(0.2)
        return -1, None
