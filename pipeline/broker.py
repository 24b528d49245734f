"""A local single-node Apache Kafka (KRaft, combined broker+controller) run from Maven jars.

No Docker needed: ``fetch_jars`` resolves ``org.apache.kafka:kafka_2.13`` and its runtime
dependencies with Maven into a cache outside the source tree (once; later calls reuse it),
and ``LocalBroker`` formats storage, starts the JVM in its own process group, waits until
the broker answers metadata requests, and stops it leaving no process behind.

Layout of a data dir::

    server.properties   generated on every start (ports may change between starts)
    log4j2.properties
    controller.port     the controller listener's port, kept across restarts when free
    broker.pid
    data/               Kafka's log.dirs (formatted once)
    logs/server.log     the broker's log; `llmq broker status` prints this path
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pipeline.config import DEFAULT_JVM_OPTIONS
from pipeline.config.topics import min_insync_replicas
from pipeline.errors import BrokerError

log = logging.getLogger(__name__)

_MAIN_CLASS = "kafka.Kafka"
_STORAGE_TOOL = "kafka.tools.StorageTool"


def cache_root(cache_dir: str = "") -> Path:
    """Jars and Maven's own repository live here: outside the source tree, shared by checkouts."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("LLMQ_CACHE_DIR"):
        return Path(os.environ["LLMQ_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "llmq"


def jars_dir(kafka_version: str, cache_dir: str = "") -> Path:
    return cache_root(cache_dir) / f"kafka-{kafka_version}" / "libs"


def fetch_jars(kafka_version: str, cache_dir: str = "", progress=print) -> Path:
    """Resolve the broker's jars with Maven into the cache; a no-op when already complete."""
    target = jars_dir(kafka_version, cache_dir)
    marker = target / ".complete"
    if marker.exists():
        return target
    if shutil.which("mvn") is None:
        raise BrokerError("Maven ('mvn') is not on PATH; it is needed once to fetch the Kafka jars")
    if shutil.which("java") is None:
        raise BrokerError("Java ('java', 17 or newer) is not on PATH; the local broker runs on it")
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / ".fetch.lock"
    with open(lock_path, "w") as lock:
        # Several processes (parallel tests, make targets) may ask at once: one fetches.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return target
        staging = target.parent / f"libs.partial-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        pom = staging.parent / "pom.xml"
        pom.write_text(resources.files("pipeline.resources").joinpath("kafka-pom.xml").read_text())
        cmd = [
            # Not -q: Maven's own lines are what tells how far a first fetch (minutes) has got.
            "mvn", "-B", "-Dstyle.color=never", "-f", str(pom),
            f"-Dkafka.version={kafka_version}",
            f"-Dmaven.repo.local={cache_root(cache_dir) / 'm2'}",
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={staging}",
        ]
        progress(f"fetching Apache Kafka {kafka_version} jars with Maven into {target} (once)")
        counter = MavenProgress(progress)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        for line in proc.stdout:
            counter.line(line)
        returncode = proc.wait()
        if returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
            shutil.rmtree(staging, ignore_errors=True)
            tail = "\n".join(counter.tail)
            raise BrokerError(f"Maven could not fetch org.apache.kafka:kafka_2.13:{kafka_version}:\n{tail}")
        counter.done()
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        marker.write_text(kafka_version + "\n")
    return target


class MavenProgress:
    """Turns Maven's output into a few progress lines: how many files it has downloaded (a
    first fetch resolves a hundred or so, plugins included) and how many jars it copied."""

    def __init__(self, progress, every_s: float = 5.0, clock=time.monotonic, keep: int = 20):
        self.progress = progress
        self.every_s = every_s
        self.clock = clock
        self.downloaded = 0
        self.downloaded_jars = 0
        self.copied = 0
        self.tail: list[str] = []  # Maven's last lines, for the error message
        self._keep = keep
        self._last = clock()

    def line(self, text: str) -> None:
        text = text.rstrip()
        bare = text[7:] if text.startswith("[INFO] ") else text
        if bare.startswith("Downloaded from "):
            self.downloaded += 1
            # "Downloaded from central: https://…/x-1.0.jar (12 kB at 40 kB/s)"
            url = bare.split(": ", 1)[-1].split(" ", 1)[0]
            self.downloaded_jars += url.endswith(".jar")
        elif bare.startswith("Copying "):
            self.copied += 1
        if text:
            self.tail = (self.tail + [text])[-self._keep:]
        now = self.clock()
        if now - self._last >= self.every_s and (self.downloaded or self.copied):
            self._last = now
            self.progress(f"  Maven: {self.downloaded} files downloaded ({self.downloaded_jars} jars), "
                          f"{self.copied} jars copied")

    def done(self) -> None:
        fetched = f", {self.downloaded} files downloaded" if self.downloaded else " (all from Maven's cache)"
        jars = f"{self.copied} jar{'s' if self.copied != 1 else ''}"
        self.progress(f"  Maven: {jars} copied{fetched}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (for the local broker, tests, benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lasting_ports(count: int, low: int = 20_000) -> int:
    """The first of ``count`` consecutive free ports below the kernel's ephemeral range, for
    servers that restart on the same port: a port from that range (``free_port``) may be given
    to some client's outgoing connection while its server is down, and the restart then cannot
    bind it."""
    import random

    try:
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32_768
    high = max(high, low + 1000)
    for _ in range(200):
        first = random.randrange(low, high - count)
        if not any(port_in_use(first + i) or not _bindable(first + i) for i in range(count)):
            return first
    raise BrokerError(f"no {count} free consecutive ports between {low} and {high}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def broker_answers(bootstrap: str, timeout: float = 3.0, client_config: dict | None = None) -> bool:
    """True when a Kafka broker at ``bootstrap`` answers a metadata request.

    ``client_config`` adds security properties (SASL_SSL brokers need credentials to answer).
    """
    host, _, port = bootstrap.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=min(timeout, 1.0)):
            pass
    except OSError:
        return False
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**(client_config or {}), "bootstrap.servers": bootstrap, "log_level": 0,
                         "logger": _SILENT})
    try:
        md = admin.list_topics(timeout=timeout)
        return bool(md.brokers)
    except Exception:
        return False


class _Silent(logging.Logger):
    def __init__(self):
        super().__init__("llmq.broker.probe", level=logging.CRITICAL + 1)


_SILENT = _Silent()


@dataclass
class BrokerStatus:
    running: bool
    bootstrap: str
    pid: int | None
    log_file: Path
    data_dir: Path


def new_cluster_id() -> str:
    """A random KRaft cluster id: a UUID in URL-safe base64, never starting with "-" (the storage
    tool would read such an id as an option, as Kafka's own Uuid.randomUuid() also avoids)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


@dataclass(frozen=True)
class NodeRole:
    """Who a broker is in its cluster: alone (the defaults), or one of ``replicas`` nodes that
    share a cluster id and a static controller quorum (``voters``, KRaft's
    ``controller.quorum.voters``), each node both broker and controller."""

    node_id: int = 1
    voters: str = ""
    controller_port: int = 0
    cluster_id: str = ""
    replicas: int = 1

    @property
    def min_isr(self) -> int:
        return min_insync_replicas(self.replicas)

    def replication_props(self) -> dict[str, str]:
        """A replicated cluster's defaults: internal topics on every node, and a write
        acknowledged by acks=all only once a majority has it (RF 3, min ISR 2: one node may
        be down without stopping writes, and a leader's death loses nothing acknowledged)."""
        rf, isr = str(self.replicas), str(self.min_isr)
        return {"offsets.topic.replication.factor": rf, "transaction.state.log.replication.factor": rf,
                "transaction.state.log.min.isr": isr, "share.coordinator.state.topic.replication.factor": rf,
                "share.coordinator.state.topic.min.isr": isr, "default.replication.factor": rf,
                "min.insync.replicas": isr}


class LocalBroker:
    """A local broker; with ``secure`` its one client listener is SASL_SSL (SCRAM-SHA-512) with a
    private CA, and the standard ACL authorizer denies whatever no ACL allows."""

    def __init__(self, port: int = 9092, data_dir: str | os.PathLike = ".llmq/kafka", *,
                 kafka_version: str = "4.4.0", heap: str = "768m", cache_dir: str = "",
                 progress=print, secure: bool = False, jvm_options: str = DEFAULT_JVM_OPTIONS,
                 node: "NodeRole | None" = None):
        self.port = port
        # Alone (the default), or one node of a cluster (pipeline/cluster.py).
        self.node = node or NodeRole()
        self.jvm_options = shlex.split(jvm_options)
        self.secure = secure
        self.data_dir = Path(data_dir).resolve()
        self.kafka_version = kafka_version
        self.heap = heap
        self.cache_dir = cache_dir
        self.progress = progress

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "logs" / "server.log"

    @property
    def _pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    @property
    def properties(self) -> Path:
        return self.data_dir / "server.properties"

    def pid(self) -> int | None:
        try:
            pid = int(self._pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    @property
    def tls_dir(self) -> Path:
        return self.data_dir / "tls"

    @property
    def secrets_dir(self) -> Path:
        return self.data_dir / "secrets"

    def is_secure(self) -> bool:
        """Whether this data dir was formatted for SASL_SSL (the flag only matters at format time)."""
        try:
            return (self.data_dir / "mode").read_text().strip() == "secure"
        except OSError:
            return self.secure

    def client_config(self, role: str = "admin") -> dict:
        """librdkafka properties for ``role`` on this broker (empty for a plaintext broker)."""
        if not self.is_secure():
            return {}
        from pipeline.security import SCRAM_MECHANISM, read_secret

        return {"security.protocol": "SASL_SSL", "sasl.mechanism": SCRAM_MECHANISM, "sasl.username": role,
                "sasl.password": read_secret(self.secrets_dir / f"{role}.password"),
                "ssl.ca.location": str(self.tls_dir / "ca.pem")}

    def client_env(self, role: str) -> dict[str, str]:
        """LLMQ_* environment for an llmq process acting as ``role`` on this broker."""
        env = {"LLMQ_BOOTSTRAP": self.bootstrap}
        if self.is_secure():
            from pipeline.security import SCRAM_MECHANISM

            env.update({"LLMQ_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", "LLMQ_KAFKA__SASL_MECHANISM": SCRAM_MECHANISM,
                        "LLMQ_KAFKA__SASL_USERNAME": role,
                        "LLMQ_KAFKA__SASL_PASSWORD_FILE": str(self.secrets_dir / f"{role}.password"),
                        "LLMQ_KAFKA__SSL_CA_LOCATION": str(self.tls_dir / "ca.pem")})
        return env

    def _answers(self, timeout: float = 3.0) -> bool:
        try:
            conf = self.client_config("admin")
        except OSError:
            return False
        return broker_answers(self.bootstrap, timeout, conf)

    def status(self, probe: bool = True) -> BrokerStatus:
        return BrokerStatus(probe and self._answers(), self.bootstrap, self.pid(), self.log_file, self.data_dir)

    # -- up -------------------------------------------------------------------------------

    def memory_options(self) -> list[str]:
        """Heap and collector: G1, Kafka's recommendation, unless ``jvm_options`` chooses
        another collector (the JVM refuses two).

        The whole heap from the start, as Kafka's own start script sets it (``-Xms1G
        -Xmx1G``): started at 256 MiB, G1 kept the heap near 300 MiB, where the broker's
        long-lived data crossed its marking threshold, and under load it ran a concurrent
        cycle every few seconds and mixed collections, with young pauses up to 240 ms.
        The pages are touched only as the heap is used."""
        gc = [] if any(_chooses_collector(o) for o in self.jvm_options) else ["-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20"]
        return [f"-Xms{self.heap}", f"-Xmx{self.heap}", *gc]

    def up(self, timeout: float = 90.0, *, wait: bool = True) -> BrokerStatus:
        """Start the broker unless it already runs; return once it answers metadata requests
        (at once with ``wait=False``: a cluster's node cannot answer before a quorum of its
        controllers runs, so a cluster starts every node, then waits)."""
        pid = self.pid()
        if pid is not None:
            if not wait or self._wait_ready(pid, timeout):
                return self.status()
            raise BrokerError(f"broker process {pid} runs but does not answer on {self.bootstrap}; see {self.log_file}")
        formatted = (self.data_dir / "data" / "meta.properties").exists()
        if formatted and self.is_secure() != self.secure:
            want, have = ("secure", "plaintext") if self.secure else ("plaintext", "secure")
            raise BrokerError(f"{self.data_dir} holds a {have} broker; start it {'with' if have == 'secure' else 'without'}"
                              f" --secure, or use another --data-dir for a {want} one")
        if port_in_use(self.port):
            if broker_answers(self.bootstrap):
                raise BrokerError(f"another Kafka broker (not started from {self.data_dir}) already listens on "
                                  f"{self.bootstrap}; stop it or pick --port")
            raise BrokerError(f"port {self.port} is in use by another program; pick --port")
        jars = fetch_jars(self.kafka_version, self.cache_dir, progress=self.progress)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        controller_port = self._controller_port()
        if self.secure:
            from pipeline.security import ensure_passwords, ensure_tls

            ensure_tls(self.tls_dir)
            ensure_passwords(self.secrets_dir)
        self.write_config(controller_port)
        classpath = f"{jars}/*"
        if not formatted:
            self._format(classpath)
            (self.data_dir / "mode").write_text("secure\n" if self.secure else "plaintext\n")
        cmd = [
            "java", *self.memory_options(),
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            f"-Dllmq.data.dir={self.data_dir}", *self.jvm_options,
            "-cp", classpath, _MAIN_CLASS, str(self.properties),
        ]
        stdout = open(self.data_dir / "logs" / "stdout.log", "ab")
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=self.data_dir)
        stdout.close()
        self._pid_file.write_text(f"{proc.pid}\n")
        if not wait:
            return self.status(probe=False)
        if not self._wait_ready(proc.pid, timeout):
            self.down()
            raise BrokerError(f"broker did not answer on {self.bootstrap} within {timeout:.0f}s; "
                              f"last log lines:\n{_tail(self.log_file)}\n{_tail(self.data_dir / 'logs' / 'stdout.log')}")
        return self.status()

    def _wait_ready(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(pid):
                return False
            if self._answers(timeout=2.0):
                return True
            time.sleep(0.25)
        return False

    def _controller_port(self) -> int:
        if self.node.controller_port:
            return self.node.controller_port
        path = self.data_dir / "controller.port"
        with contextlib.suppress(OSError, ValueError):
            port = int(path.read_text())
            if port != self.port and not port_in_use(port):
                return port
        port = free_port()
        while port == self.port:
            port = free_port()
        path.write_text(f"{port}\n")
        return port

    def write_config(self, controller_port: int) -> None:
        """This node's server.properties: a KRaft broker and controller, with the replication
        settings of a single broker, or of a cluster's node."""
        data = self.data_dir / "data"
        node = self.node
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": node.voters or f"{node.node_id}@127.0.0.1:{controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(data),
            "num.partitions": "6",
            # A single broker: internal topics cannot have more replicas than that, or
            # init_transactions() and group coordination wait forever.
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "10",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            # Classic groups (the gateways: Faust's consumer) may ask for sessions down to 1 s:
            # a killed gateway's partitions move once its session (gateway.session_timeout_ms)
            # expires, and Kafka's 6-s minimum alone would put failover past 6 s.
            "group.min.session.timeout.ms": "1000",
            # Consumer-protocol groups (KIP-848) may ask for a short session, as a test or a
            # demo wants: a crashed worker's partitions move in seconds (workers set their
            # group's consumer.session.timeout.ms); heartbeats carry new assignments.
            "group.consumer.min.session.timeout.ms": "3000",
            "group.consumer.min.heartbeat.interval.ms": "500",
            "group.consumer.heartbeat.interval.ms": "500",
            # The broker recomputes a group's assignment at most this often (1 s by default),
            # which a joining worker waits for.
            "group.consumer.min.assignment.interval.ms": "0",
            "group.consumer.assignment.interval.ms": "100",
            "auto.create.topics.enable": "false",
            "log.retention.hours": "24",
            "log.segment.bytes": str(256 * 1024 * 1024),
            # A deleted topic's files go after a second, not a minute (Kafka's default): tests
            # and benchmarks create and delete hundreds of partitions, and the deferred unlinking
            # kept a broker thread busy during whatever ran a minute later.
            "log.segment.delete.delay.ms": "1000",
            # The log cleaner (compacted topics: the gateway's changelogs, cancellations)
            # allocates its whole dedupe buffer at start, 128 MiB by default: on a 1-GiB heap
            # that was most of the old generation, so G1 ran a concurrent marking cycle every
            # few seconds under load, each with two short pauses.
            "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
            # A fetch that waits is registered under every partition it names (a gateway's and a
            # worker's name dozens) and stays referenced from those lists after it completes
            # until the purgatory purges them, by default once 1,000 completed ones have piled
            # up. At hundreds of fetches a second those dead requests outlived each young
            # collection: the broker copied and promoted them every second or two, and a quiet
            # tenant next to a flooder waited through the pauses. Purged every 10, the flooded
            # rounds had far fewer pauses (BENCHMARKS.md).
            "fetch.purgatory.purge.interval.requests": "10",
            "producer.purgatory.purge.interval.requests": "10",
        }
        if node.replicas > 1:
            props.update(node.replication_props())
        if self.secure or self.is_secure():
            props.update(self._secure_props(controller_port))
        self.properties.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (self.data_dir / "log4j2.properties").write_text(_LOG4J.format(log_file=self.log_file))

    def _secure_props(self, controller_port: int) -> dict[str, str]:
        from pipeline.security import SCRAM_MECHANISM, read_secret

        tls = self.tls_dir
        admin_password = read_secret(self.secrets_dir / "admin.password")
        return {
            # Clients: SASL_SSL only. Controller: TLS with client certificates (SCRAM cannot
            # serve the controller, whose credentials live in the metadata it serves).
            "listeners": f"SASL_SSL://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{self.port}",
            "listener.security.protocol.map": "CONTROLLER:SSL,SASL_SSL:SASL_SSL",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": SCRAM_MECHANISM,
            "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
                'org.apache.kafka.common.security.scram.ScramLoginModule required '
                f'username="admin" password="{admin_password}";',
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(tls / "broker-keystore.pem"),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(tls / "ca.pem"),
            "listener.name.controller.ssl.client.auth": "required",
            "ssl.endpoint.identification.algorithm": "https",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": "User:admin;User:CN=llmq-broker",
            "allow.everyone.if.no.acl.found": "false",
        }

    def _format(self, classpath: str) -> None:
        cluster_id = self.node.cluster_id or new_cluster_id()
        self.progress(f"formatting KRaft storage in {self.data_dir / 'data'} (cluster {cluster_id})")
        extra = []
        if self.secure:
            from pipeline.security import ROLES, SCRAM_MECHANISM, read_secret

            # SCRAM credentials exist from the first start, before any client can connect.
            for role in ROLES:
                password = read_secret(self.secrets_dir / f"{role}.password")
                extra += ["--add-scram", f"{SCRAM_MECHANISM}=[name={role},password={password}]"]
        proc = subprocess.run(
            ["java", "-Xmx256m", f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
             "-cp", classpath, _STORAGE_TOOL, "format", "-t", cluster_id, "-c", str(self.properties), *extra],
            capture_output=True, text=True)
        if proc.returncode != 0:
            # The command line carries SCRAM passwords: show the tool's output only.
            raise BrokerError(f"formatting storage failed:\n{proc.stdout}\n{proc.stderr}")

    # -- down -----------------------------------------------------------------------------

    def down(self, timeout: float = 30.0) -> bool:
        """Stop the broker (SIGTERM, then SIGKILL); return True when one was running."""
        pids = set(self.stray_pids())
        pid = self.pid()
        if pid is not None:
            pids.add(pid)
        for p in pids:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        for p in pids:
            if _alive(p):
                _signal_group(p, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        with contextlib.suppress(FileNotFoundError):
            self._pid_file.unlink()
        still = [p for p in pids if _alive(p)]
        if still:
            raise BrokerError(f"broker processes {still} did not exit")
        return bool(pids)

    def stray_pids(self) -> list[int]:
        """Java processes started from this data dir whose pid file was lost."""
        marker = f"-Dllmq.data.dir={self.data_dir}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in args:
                found.append(int(entry.name))
        return found


def _chooses_collector(option: str) -> bool:
    return option.startswith("-XX:+Use") and option.endswith("GC")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} not written)"


_LOG4J = """\
status = warn
appender.file.type = RollingFile
appender.file.name = FILE
appender.file.fileName = {log_file}
appender.file.filePattern = {log_file}.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 50MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.apache.name = org.apache.kafka
logger.apache.level = INFO
"""


if __name__ == "__main__":  # pragma: no cover - debugging aid
    print(LocalBroker(int(sys.argv[1]) if len(sys.argv) > 1 else 9092).status())
