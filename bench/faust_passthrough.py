"""gateway_throughput's second baseline: the most a Faust agent admits in one process.

One agent over a request topic, as the gateway's are (a ``noack()`` stream of events, each
acknowledged with ``event.ack()``), forwards every record's bytes unchanged to one output topic
through librdkafka, as the gateway's outputs go. Nothing is decoded, decided, encoded or written to
a table, and a record is acknowledged as soon as it is handed to librdkafka, not after its
delivery: what is left is Faust's own cost per record (fetch, drain loop, stream, ack), the ceiling
of any gateway built as a Faust agent on this machine.

    python bench/faust_passthrough.py --bootstrap HOST:PORT --source TOPIC --out TOPIC

Run by bench/gateway_bench.py as its own process; it runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import tempfile
import uuid


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers")
    parser.add_argument("--source", required=True, help="the request topic to read")
    parser.add_argument("--out", required=True, help="where every record's bytes go")
    parser.add_argument("--partitions", type=int, default=6, help="the source topic's partition count")
    args = parser.parse_args(argv)

    import faust
    from confluent_kafka import Producer

    app = faust.App(f"faust-passthrough-{uuid.uuid4().hex[:8]}", broker=f"kafka://{args.bootstrap}",
                    store="memory://", autodiscover=False, web_enabled=False, topic_partitions=args.partitions,
                    consumer_auto_offset_reset="earliest", datadir=tempfile.mkdtemp(prefix="faust-passthrough-"))
    source = app.topic(args.source, key_type=bytes, value_type=bytes, value_serializer="raw")
    producer = Producer({"bootstrap.servers": args.bootstrap, "linger.ms": 2, "acks": "all"})
    out = args.out

    @app.agent(source, name="forward")
    async def forward(stream):
        async for event in stream.noack().events():
            msg = event.message
            while True:
                try:
                    producer.produce(out, msg.value, msg.key)
                    break
                except BufferError:
                    producer.poll(0.01)
            producer.poll(0)
            event.ack()

    @app.on_before_shutdown.connect
    async def flush(sender, **kwargs):
        producer.flush(30)

    faust.Worker(app, loglevel="warning", quiet=True, redirect_stdouts=False).execute_from_commandline()


if __name__ == "__main__":
    main()
