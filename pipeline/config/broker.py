"""[broker]: the local development broker (``llmq broker up``)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import ConfigError


#: The local broker's JVM options. The JIT's optimising tier (C2) spends most of a core for the
#: first minute or two of a broker's life; a development broker is short-lived and shares two
#: cores with everything it serves, so it keeps to the quick tier (``make demo``'s CRITICAL
#: waits were several times longer without it).
DEFAULT_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"


@dataclass
class BrokerSettings:
    """The local development broker started by ``llmq broker up``."""

    port: int = 9092
    #: 1: one broker. More: a replicated local cluster (pipeline/cluster.py), its nodes on
    #: consecutive ports from ``port``; set topics.replication_factor to match.
    nodes: int = 1
    data_dir: str = ".llmq/kafka"
    heap: str = "768m"
    kafka_version: str = "4.4.0"
    #: Where the Kafka jars are cached; empty = $XDG_CACHE_HOME/llmq or ~/.cache/llmq.
    cache_dir: str = ""
    #: More JVM options for the broker, space-separated (as KAFKA_OPTS of Kafka's scripts);
    #: the default keeps the JIT to its quick tier (why: DEFAULT_JVM_OPTIONS above).
    jvm_options: str = DEFAULT_JVM_OPTIONS

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError("broker.port", f"must be a TCP port, got {self.port}")
        if not 1 <= self.nodes <= 9:
            raise ConfigError("broker.nodes", f"must be 1 to 9, got {self.nodes}")
