"""A local replicated Kafka cluster: ``nodes`` KRaft nodes on one machine, for tests, the fault
harness and users who want to see a leader die.

Each node is a :class:`~pipeline.broker.LocalBroker` (broker and controller in one JVM) with its
own client port, controller port and data dir; they share one cluster id and a static controller
quorum. Topics get replication factor ``nodes`` and ``min.insync.replicas`` a majority
(:func:`~pipeline.config.topics.min_insync_replicas`), internal topics likewise.

Layout of the data dir::

    cluster.json     node ids, client and controller ports, the cluster id (fixed at first start)
    node-1/ …        each node's data dir (see pipeline/broker.py)
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.broker import BrokerStatus, LocalBroker, NodeRole, lasting_ports, new_cluster_id, port_in_use
from pipeline.config import DEFAULT_JVM_OPTIONS
from pipeline.errors import BrokerError

LAYOUT = "cluster.json"


@dataclass
class ClusterStatus:
    nodes: dict[int, BrokerStatus]
    #: Brokers the cluster's metadata lists (a frozen or dead node drops out after its session).
    registered: list[int]

    @property
    def running(self) -> bool:
        return bool(self.nodes) and all(s.running for s in self.nodes.values()) and len(self.registered) == len(self.nodes)

    @property
    def bootstrap(self) -> str:
        return ",".join(s.bootstrap for s in self.nodes.values())


class LocalCluster:
    def __init__(self, nodes: int = 3, port: int = 9092, data_dir: str | os.PathLike = ".llmq/kafka", *,
                 kafka_version: str = "4.4.0", heap: str = "512m", cache_dir: str = "", progress=print,
                 jvm_options: str = DEFAULT_JVM_OPTIONS):
        if nodes < 2:
            raise BrokerError("a cluster needs at least 2 nodes (one node: `llmq broker up` without --nodes)")
        self.data_dir = Path(data_dir).resolve()
        self.progress = progress
        self._broker_args = dict(kafka_version=kafka_version, heap=heap, cache_dir=cache_dir, progress=progress,
                                 jvm_options=jvm_options)
        self.layout = self._layout(nodes, port)
        self.nodes: dict[int, LocalBroker] = {}
        voters = ",".join(f"{n['node_id']}@127.0.0.1:{n['controller_port']}" for n in self.layout["nodes"])
        replicas = len(self.layout["nodes"])
        for n in self.layout["nodes"]:
            role = NodeRole(n["node_id"], voters, n["controller_port"], self.layout["cluster_id"], replicas)
            self.nodes[n["node_id"]] = LocalBroker(n["port"], self.data_dir / f"node-{n['node_id']}", node=role,
                                                   **self._broker_args)

    @staticmethod
    def exists(data_dir: str | os.PathLike) -> bool:
        """Whether ``data_dir`` holds a cluster (its layout is written at the first start)."""
        return (Path(data_dir) / LAYOUT).exists()

    @classmethod
    def at(cls, data_dir: str | os.PathLike, **kwargs) -> "LocalCluster":
        """The cluster in ``data_dir``, as it was laid out (node count and ports)."""
        layout = json.loads((Path(data_dir) / LAYOUT).read_text())
        return cls(len(layout["nodes"]), layout["nodes"][0]["port"], data_dir, **kwargs)

    def _layout(self, nodes: int, port: int) -> dict:
        path = self.data_dir / LAYOUT
        if path.exists():
            layout = json.loads(path.read_text())
            if len(layout["nodes"]) != nodes:
                raise BrokerError(f"{self.data_dir} holds a {len(layout['nodes'])}-node cluster; use that many "
                                  f"--nodes, or another --data-dir")
            return layout
        if (self.data_dir / "data" / "meta.properties").exists():
            raise BrokerError(f"{self.data_dir} holds a single broker; use another --data-dir for a cluster")
        taken = {port + i for i in range(nodes)}
        entries = [{"node_id": i + 1, "port": port + i, "controller_port": _spare_port(taken)} for i in range(nodes)]
        layout = {"cluster_id": new_cluster_id(), "nodes": entries}
        self.data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(layout, indent=2) + "\n")
        return layout

    # -- what clients need -------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        return ",".join(b.bootstrap for b in self.nodes.values())

    @property
    def replication_factor(self) -> int:
        return len(self.nodes)

    def client_env(self) -> dict[str, str]:
        """LLMQ_* environment for an llmq process on this cluster: every node as bootstrap, and
        topics replicated to all of them."""
        return {"LLMQ_BOOTSTRAP": self.bootstrap, "LLMQ_TOPICS__REPLICATION_FACTOR": str(self.replication_factor)}

    # -- up, status, down --------------------------------------------------------------------

    def up(self, timeout: float = 120.0) -> ClusterStatus:
        """Start every node that is not running, then wait until each answers and the metadata
        lists them all. A node alone cannot answer: the controllers need a quorum first."""
        for broker in self.nodes.values():
            broker.up(timeout, wait=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st.running:
                return st
            dead = [i for i, b in self.nodes.items() if b.pid() is None]
            if dead:
                logs = "\n".join(f"node {i}: {self.nodes[i].log_file}" for i in dead)
                self.down()
                raise BrokerError(f"cluster node(s) {dead} exited while starting; see\n{logs}")
            time.sleep(0.5)
        raise BrokerError(f"the cluster did not come up within {timeout:.0f} s: {self.status()}")

    def start_node(self, node_id: int, timeout: float = 90.0) -> BrokerStatus:
        """Start one node again (after a kill) and wait until it answers."""
        return self.nodes[node_id].up(timeout)

    def status(self) -> ClusterStatus:
        nodes = {i: b.status() for i, b in self.nodes.items()}
        return ClusterStatus(nodes, self.registered() if any(s.running for s in nodes.values()) else [])

    def registered(self, timeout: float = 3.0) -> list[int]:
        from confluent_kafka.admin import AdminClient

        from pipeline.broker import _SILENT

        if not any(port_in_use(b.port) for b in self.nodes.values()):
            return []
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0, "logger": _SILENT})
        try:
            return sorted(admin.list_topics(timeout=timeout).brokers)
        except Exception:
            return []

    def down(self, timeout: float = 30.0) -> bool:
        """Stop every node at once (each SIGTERM, then SIGKILL): one at a time, the last nodes
        would wait for a controller quorum that the first ones took away."""
        results: dict[int, bool] = {}
        errors: list[str] = []

        def stop(node_id: int, broker: LocalBroker) -> None:
            try:
                results[node_id] = broker.down(timeout)
            except BrokerError as exc:
                errors.append(str(exc))

        threads = [threading.Thread(target=stop, args=item) for item in self.nodes.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise BrokerError("; ".join(errors))
        return any(results.values())

    # -- faults ----------------------------------------------------------------------------

    def leader_of(self, topic: str, partition: int, timeout: float = 10.0) -> int:
        """The node leading ``topic``'s ``partition`` now (-1 while it has none)."""
        from confluent_kafka.admin import AdminClient

        from pipeline.broker import _SILENT

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0, "logger": _SILENT})
        md = admin.list_topics(topic, timeout=timeout)
        return md.topics[topic].partitions[partition].leader

    def signal(self, node_id: int, sig: int) -> int:
        """Send ``sig`` to one node's JVM (SIGKILL, SIGSTOP, SIGCONT); returns its pid."""
        pid = self.nodes[node_id].pid()
        if pid is None:
            raise BrokerError(f"node {node_id} is not running")
        os.kill(pid, sig)
        if sig == signal.SIGKILL:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.nodes[node_id].pid() is not None:
                time.sleep(0.05)
        return pid


def _spare_port(taken: set[int]) -> int:
    """A controller port: below the ephemeral range, as a node restarts on it (lasting_ports)."""
    while True:
        port = lasting_ports(1)
        if port not in taken:
            taken.add(port)
            return port
