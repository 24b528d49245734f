"""`make fuzz`: a coverage-less mutation fuzzer over the worker's admission path.

Feeds messages straight into ``Worker.handle`` (a real Worker with the default settings,
a fake producer that acknowledges at once, the zero-latency simulated backend; no broker)
and checks, for every message, that the worker

* does not raise,
* publishes exactly one outcome: a response (COMPLETED, or REJECTED/EXPIRED with a known
  reason) on the responses topic, or a dead letter with the original bytes and a known
  ``llmq.dlq.reason`` on the DLQ topic,
* moves the partition's committable position past it,
* takes less than ``--max-ms`` for it,

and that the process's peak RSS stays under ``--max-rss-mb``.

Inputs come from four generators: random bytes (bare or behind a valid header), valid
requests of both schema revisions mutated at the byte level (bit flips, truncation,
insertions, huge varints, splices), and structurally valid Avro with hostile field values
(control characters, invalid UTF-8, out-of-range numbers and enum indexes, oversized
strings and maps). Inputs with a rarely seen outcome are kept as seeds for more mutation.

    python bench/fuzz.py                      # 10 minutes
    python bench/fuzz.py --minutes 1 --seed 42

Progress goes to stdout every ``--progress-s`` seconds; at the end a summary is printed
and written to bench/fuzz.json. Exit status: 0 = clean, 1 = an exception or a broken
invariant (the input is printed as hex), 2 = peak RSS over the bound, 3 = a message over
the time bound.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import resource
import sys
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import Settings  # noqa: E402
from pipeline.models import Priority, Request, Status, TaskTier, now_ms  # noqa: E402
from pipeline.serde import SchemaStore  # noqa: E402
from pipeline.testing import FakeMessage, avro_string, zigzag  # noqa: E402
from pipeline.worker.backends.simulated import SimulatedBackend  # noqa: E402
from pipeline.worker.loop import Worker  # noqa: E402

OUT = ROOT / "bench" / "fuzz.json"

DLQ_REASONS = {"too_large", "truncated", "bad_magic", "unknown_fingerprint", "unknown_schema_id", "malformed",
               "limit_exceeded", "invalid_field", "empty"}
REASON_PREFIXES = {Status.REJECTED: ("invalid_request: ", "duplicate_request_id: "),
                   Status.EXPIRED: ("deadline_passed: ",)}

# -- the wire format, written by hand so that anything can be written ----------------------------

_STORE = SchemaStore.load()
_REVISIONS = {r.revision: r for r in _STORE.revisions("llm_request")}
# Bodies are written as the current revision (3) or as the older writers every reader still
# resolves to it (2 and 1); the codec checks the bytes of all three alike.
HEADERS = {r: b"\xc3\x01" + _REVISIONS[r].fingerprint.le_bytes for r in (1, 2, 3)}
FIELDS = {2: ("request_id", "tenant_id", "priority", "prompt", "model", "max_tokens", "created_at", "timeout_ms",
              "user_tier", "task_tier", "allow_degrade", "notify_queued", "trace_id", "metadata")}
FIELDS[1] = tuple(f for f in FIELDS[2] if f not in ("notify_queued", "trace_id"))
FIELDS[3] = FIELDS[2] + ("admitted_at", "effective_priority", "degraded_from")
KINDS = {"request_id": "string", "tenant_id": "string", "priority": "long", "prompt": "string", "model": "string",
         "max_tokens": "long", "created_at": "long", "timeout_ms": "long", "user_tier": "string",
         "task_tier": "long", "allow_degrade": "byte", "notify_queued": "byte", "trace_id": "union",
         "metadata": "map", "admitted_at": "union", "effective_priority": "union", "degraded_from": "union"}


def _check_schema() -> None:
    """The hand-written field lists must match the published schemas."""
    for revision, fields in FIELDS.items():
        rev = _REVISIONS[revision]
        names = tuple(f["name"] for f in rev.parsed["fields"])
        if names != fields:
            raise SystemExit(f"bench/fuzz.py: request schema revision {revision} has fields {names}; update FIELDS")


zz, _string = zigzag, avro_string


def _field(kind: str, value) -> bytes:
    if isinstance(value, (bytes, bytearray)) and kind != "string":
        return bytes(value)  # raw bytes in place of the field
    if kind == "string":
        return _string(value)
    if kind == "long":
        return zz(value)
    if kind == "byte":
        return bytes((value & 0xFF,))
    if kind == "union":
        return b"\x00" if value is None else b"\x02" + _string(value)
    if not value:  # map
        return b"\x00"
    return zz(len(value)) + b"".join(_string(k) + _string(v) for k, v in value) + b"\x00"


def raw_message(revision: int, values: dict) -> bytes:
    return HEADERS[revision] + b"".join(_field(KINDS[name], values[name]) for name in FIELDS[revision])


# -- the target ----------------------------------------------------------------------------------


class FakeProducer:
    """Acknowledges every message at once; remembers only what the current message produced."""

    def __init__(self):
        self.sent: list[FakeMessage] = []
        self.count = 0

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None, **_):
        msg = FakeMessage(topic, 0, self.count, value, key, headers)
        self.count += 1
        self.sent.append(msg)
        if on_delivery is not None:
            on_delivery(None, msg)

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        return 0


class InvariantError(AssertionError):
    pass


class Target:
    """One worker and the partition the fuzzer writes to."""

    def __init__(self, settings: Settings):
        self.worker = Worker(settings, SimulatedBackend(), worker_id="fuzz-worker")
        self.producer = self.worker.session.producer = FakeProducer()
        self.topic = settings.topics.request_topic(Priority.NORMAL)
        self.tp = (self.topic, 0)
        self.offset = 0

    def metric_series(self) -> int:
        return sum(len(getattr(s, "children", ())) for s in vars(self.worker.metrics).values())

    def run(self, value, key, headers) -> str:
        """Handle one message; return its outcome ("dlq:<reason>", "response:<status>[:<code>]")."""
        worker, producer = self.worker, self.producer
        offset = self.offset
        self.offset += 1
        producer.sent.clear()
        worker.handle(FakeMessage(self.topic, 0, offset, value, key, headers))
        sent = producer.sent
        if len(sent) != 1:
            raise InvariantError(f"{len(sent)} outcomes for one message")
        position = worker.checkpoint.tracker.to_commit()
        if position != [(self.tp, offset + 1)]:
            raise InvariantError(f"committable position {position}, expected {offset + 1}")
        worker.checkpoint.tracker.mark_committed(position)
        if worker.checkpoint.tracker.in_flight(self.tp) or worker.running:
            raise InvariantError("work left in flight after a synchronous outcome")
        out = sent[0]
        if out.topic() == worker.dlq_topic:
            reason = next((v for k, v in out.headers() or () if k == "llmq.dlq.reason"), b"").decode()
            if reason not in DLQ_REASONS:
                raise InvariantError(f"unknown dead-letter reason {reason!r}")
            if out.value() != value or out.key() != key:
                raise InvariantError("the dead letter does not carry the original key and value")
            return f"dlq:{reason}"
        if out.topic() != worker.responses_topic:
            raise InvariantError(f"published to {out.topic()!r}")
        resp = worker.codec.decode_response(out.value())
        if resp.status is Status.COMPLETED:
            if resp.reason is not None:
                raise InvariantError(f"COMPLETED with a reason {resp.reason!r}")
            return "response:COMPLETED"
        prefixes = REASON_PREFIXES.get(resp.status)
        if prefixes is None or not (resp.reason or "").startswith(prefixes):
            raise InvariantError(f"{resp.status.value} with reason {resp.reason!r}")
        return f"response:{resp.status.value}:{resp.reason.split(':', 1)[0]}"


# -- input generators ----------------------------------------------------------------------------

INTERESTING_INTS = (0, 1, -1, 2, -2, 16, 63, 64, 127, 128, -128, 255, 256, 8191, 8192, 60_000, 1_000_000, 1_000_001,
                    2**31 - 1, -(2**31), 2**31, -(2**31) - 1, 2**32, 2**53, 2**62, 2**63 - 1, -(2**63))
HOSTILE_CHARS = ("\x00", "\n", "\r", "\t", "\x1b", "\x7f", "\x85", "\x9f", "\u202e", "\u2028", "\u200b", "\ufeff", "é",
                 "€", "\U0001f600", "a", "Z", "0", "-", " ", "%s", "{}", "'", '"', "\\", "\ud800")
INTERESTING_BYTES = (0x00, 0x01, 0x02, 0x7E, 0x7F, 0x80, 0x81, 0xC3, 0xFE, 0xFF)


class Generator:
    def __init__(self, rng: random.Random, max_seeds: int = 512):
        self.rng = rng
        self.max_seeds = max_seeds
        self.seeds: list[bytes] = []
        for _ in range(32):
            req = self.valid_request()
            self.seeds.append(self.encode(req, self.rng.choice((1, 2, 3))))

    # values ---------------------------------------------------------------------------------

    def uuid(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def length(self, cap: int) -> int:
        """Log-uniform in [0, cap]: mostly short, sometimes long."""
        return min(cap, int(2 ** (self.rng.random() * cap.bit_length())) - 1)

    def text(self) -> str | bytes:
        rng = self.rng
        r = rng.random()
        if r < 0.25:
            return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz-_.0123456789") for _ in range(rng.randint(1, 24)))
        if r < 0.45:
            return "".join(rng.choice(HOSTILE_CHARS) for _ in range(rng.randint(0, 40)))
        if r < 0.55:
            return rng.randbytes(rng.randint(0, 40))  # raw bytes: maybe invalid UTF-8
        if r < 0.62:
            return ""
        if r < 0.72:
            u = self.uuid()
            return rng.choice((u, u.upper(), u + "\n", u.replace("-", ""), u[:-1], " " + u, u + "\x00"))
        if r < 0.97:
            return rng.choice(HOSTILE_CHARS[:-1]) * self.length(70_000)
        return "p" * self.length(300_000)  # over the prompt cap now and then

    def number(self) -> int:
        rng = self.rng
        r = rng.random()
        if r < 0.5:
            return rng.choice(INTERESTING_INTS) + rng.choice((0, 0, 0, 1, -1))
        if r < 0.8:
            return rng.randint(-(2**31), 2**31 - 1)
        return rng.randint(-(2**63), 2**63 - 1)

    def valid_request(self) -> Request:
        rng = self.rng
        return Request(
            request_id=self.uuid(), tenant_id=f"tenant-{rng.randint(0, 50)}", priority=rng.choice(list(Priority)),
            prompt="hello " * rng.randint(1, 30), model=rng.choice(("sim-small", "sim-large", "m")),
            max_tokens=rng.randint(1, 4096), created_at=now_ms() - rng.randint(-1000, 10_000),
            timeout_ms=rng.randint(60_000, 3_600_000), user_tier=rng.choice(("standard", "premium", "")),
            task_tier=rng.choice(list(TaskTier)), allow_degrade=rng.random() < 0.5,
            notify_queued=rng.random() < 0.5, trace_id=rng.choice((None, self.uuid().replace("-", ""))),
            metadata={f"k{i}": "v" * rng.randint(0, 20) for i in range(rng.randint(0, 6))},
        )

    @staticmethod
    def encode(req: Request, revision: int) -> bytes:
        values = req.to_record()
        values["priority"] = list(Priority).index(req.priority)
        values["task_tier"] = list(TaskTier).index(req.task_tier)
        values["allow_degrade"] = int(req.allow_degrade)
        values["notify_queued"] = int(req.notify_queued)
        values["metadata"] = list(req.metadata.items())
        return raw_message(revision, values)

    # inputs ---------------------------------------------------------------------------------

    def random_bytes(self) -> bytes:
        rng = self.rng
        prefix = rng.choice((b"", b"", HEADERS[3], HEADERS[2], HEADERS[1], b"\x00" + rng.randbytes(4), b"\xc3\x01",
                             b"\xc3\x01" + rng.randbytes(8)))
        return prefix + rng.randbytes(self.length(rng.choice((64, 1024, 70_000))))

    def hostile_structured(self) -> bytes:
        rng = self.rng
        req = self.valid_request()
        values = req.to_record()
        values.update(priority=list(Priority).index(req.priority), task_tier=list(TaskTier).index(req.task_tier),
                      allow_degrade=int(req.allow_degrade), notify_queued=int(req.notify_queued),
                      metadata=list(req.metadata.items()))
        p = rng.choice((0.05, 0.2, 0.5, 1.0))  # how many fields turn hostile
        for name in FIELDS[3]:
            if rng.random() >= p:
                continue
            kind = KINDS[name]
            if kind == "string":
                values[name] = self.text()
            elif name in ("priority", "task_tier"):
                values[name] = rng.randint(-3, 8) if rng.random() < 0.8 else self.number()
            elif kind == "long":
                values[name] = self.number()
            elif kind == "byte":
                values[name] = rng.choice((0, 1, 2, 0x80, 0xFF))
            elif kind == "union":
                values[name] = rng.choice((None, self.text(), b"\x04", b"\x01", b"\x03" + zz(3) + b"abc"))
            else:  # metadata
                n = rng.choice((0, 1, 8, 64, 65, 100, self.length(2000)))
                entries = [(self.text() if rng.random() < 0.3 else f"k{i}", self.text() if rng.random() < 0.3
                            else "v") for i in range(n)]
                if rng.random() < 0.1:  # a block count that lies
                    values[name] = zz(rng.choice((2**62, -(2**62), 2**31, -1, n + 1))) + b"".join(
                        _string(k) + _string(v) for k, v in entries[:4]) + b"\x00"
                else:
                    values[name] = entries
        return raw_message(rng.choice((1, 2, 3, 3)), values)

    def mutated(self) -> bytes:
        rng = self.rng
        buf = bytearray(rng.choice(self.seeds))
        for _ in range(rng.choice((1, 1, 2, 3, 5, 8))):
            # Mostly in the body, sometimes in the 10-byte header.
            size = len(buf)
            if size == 0:
                i = 0
            elif rng.random() < 0.1 or size <= 10:
                i = rng.randrange(min(10, size))
            else:
                i = rng.randrange(10, size)
            op = rng.randrange(10)
            if op == 0 and buf:
                buf[min(i, size - 1)] ^= 1 << rng.randrange(8)
            elif op == 1 and buf:
                buf[min(i, size - 1)] = rng.choice(INTERESTING_BYTES)
            elif op == 2:
                del buf[i:]
            elif op == 3:
                buf[i:i] = rng.randbytes(rng.randint(1, 16))
            elif op == 4:
                buf[i:i] = zz(rng.choice(INTERESTING_INTS))
            elif op == 5:
                del buf[i:i + rng.randint(1, 16)]
            elif op == 6:
                chunk = buf[i:i + rng.randint(1, 32)]
                buf[i:i] = chunk * rng.randint(1, 64)
            elif op == 7:
                other = rng.choice(self.seeds)
                j = rng.randrange(len(other) + 1)
                buf[i:] = other[j:]
            elif op == 8:
                buf[i:i + 1] = b"\xff" * rng.randint(1, 11)  # an over-long varint
            else:
                buf[i:i] = zz(rng.choice((2**62, -(2**62), 2**31, 2**63 - 1)))  # a huge count or length
        return bytes(buf)

    def key_and_headers(self):
        rng = self.rng
        r = rng.random()
        if r < 0.9:
            return b"tenant", None
        if r < 0.95:
            return None, [("tenant_id", b"admin"), ("priority", b"CRITICAL"), ("llmq.dlq.reason", b"spoofed"),
                          ("none", None)]
        return rng.randbytes(self.length(100_000)), [(f"h{i}", rng.randbytes(8)) for i in range(self.length(500))]

    def next(self) -> tuple[str, bytes | None, bytes | None, list | None]:
        r = self.rng.random()
        if r < 0.001:
            kind, value = "tombstone", None
        elif r < 0.2:
            kind, value = "random", self.random_bytes()
        elif r < 0.6:
            kind, value = "mutated", self.mutated()
        else:
            kind, value = "hostile", self.hostile_structured()
        key, headers = self.key_and_headers()
        return kind, value, key, headers

    def keep(self, value: bytes | None) -> None:
        if value is None or len(value) > 70_000:
            return
        if len(self.seeds) < self.max_seeds:
            self.seeds.append(value)
        else:
            self.seeds[self.rng.randrange(len(self.seeds))] = value


# -- the loop ------------------------------------------------------------------------------------


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def describe(value, key, headers, limit: int = 4096) -> str:
    def hexed(b):
        if b is None:
            return "None"
        text = b[:limit].hex()
        return text + (f"... ({len(b)} bytes)" if len(b) > limit else f" ({len(b)} bytes)")

    hdrs = None if headers is None else [(k, None if v is None else v[:32].hex()) for k, v in headers[:20]]
    return f"value: {hexed(value)}\nkey:   {hexed(key)}\nheaders: {hdrs}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz (default 10)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock; printed)")
    ap.add_argument("--max-rss-mb", type=float, default=500.0, help="fail if peak RSS exceeds this (default 500)")
    ap.add_argument("--max-ms", type=float, default=1000.0, help="fail if one message takes longer (default 1000)")
    ap.add_argument("--progress-s", type=float, default=30.0, help="seconds between progress lines (default 30)")
    ap.add_argument("--keep-going", action="store_true", help="count crashes and go on instead of stopping")
    ap.add_argument("--out", type=Path, default=OUT, help=f"summary JSON (default {OUT.relative_to(ROOT)})")
    args = ap.parse_args(argv)

    _check_schema()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("pipeline").setLevel(logging.CRITICAL)  # one warning per dead letter otherwise
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % (2**32)
    rng = random.Random(seed)
    settings = Settings.load(env={})
    target = Target(settings)
    gen = Generator(rng)
    print(f"fuzzing Worker.handle for {args.minutes:g} min, seed {seed}, limits {target.worker.codec.limits}",
          flush=True)

    outcomes: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    crashes = 0
    failure: dict | None = None
    exit_code = 0
    slowest_s, slowest_what = 0.0, ""
    execs = 0
    start = time.monotonic()
    end = start + args.minutes * 60
    next_progress = start + args.progress_s
    last_execs, last_t = 0, start

    def report(now: float) -> None:
        nonlocal last_execs, last_t
        rate = (execs - last_execs) / max(now - last_t, 1e-9)
        last_execs, last_t = execs, now
        top = ", ".join(f"{k}={v}" for k, v in outcomes.most_common(8))
        print(f"[{now - start:6.0f}s] execs {execs} ({rate:,.0f}/s) | peak RSS {peak_rss_mb():.0f} MB | "
              f"slowest {slowest_s * 1000:.1f} ms ({slowest_what}) | metric series {target.metric_series()} | "
              f"crashes {crashes} | {top}", flush=True)

    while True:
        now = time.monotonic()
        if now >= end:
            break
        if now >= next_progress:
            report(now)
            next_progress = now + args.progress_s
        kind, value, key, headers = gen.next()
        t0 = time.perf_counter()
        try:
            outcome = target.run(value, key, headers)
        except Exception as exc:  # noqa: BLE001 - the point of the exercise
            dt = time.perf_counter() - t0
            crashes += 1
            what = "invariant broken" if isinstance(exc, InvariantError) else "unexpected exception"
            print(f"\n*** {what} ({kind} input, exec {execs}, {dt * 1000:.1f} ms): {exc!r}", flush=True)
            traceback.print_exc(file=sys.stdout)
            print(describe(value, key, headers), flush=True)
            failure = failure or {"what": what, "error": repr(exc), "kind": kind,
                                  "value_hex": None if value is None else value[:65536].hex()}
            outcomes[f"crash:{type(exc).__name__}"] += 1
            exit_code = exit_code or 1
            execs += 1
            if not args.keep_going:
                break
            target = Target(settings)  # its tracker now holds a message that never finished
            continue
        dt = time.perf_counter() - t0
        execs += 1
        by_kind[kind] += 1
        if outcomes[outcome] < 10:
            gen.keep(value)  # a rare outcome: worth mutating further
        outcomes[outcome] += 1
        if dt > slowest_s:
            slowest_s, slowest_what = dt, f"{kind} {len(value) if value is not None else 0} B -> {outcome}"
        if dt * 1000 > args.max_ms:
            print(f"\n*** one message took {dt * 1000:.0f} ms (> {args.max_ms:g} ms): {kind} -> {outcome}")
            print(describe(value, key, headers), flush=True)
            failure = failure or {"what": "too slow", "ms": dt * 1000, "kind": kind,
                                  "value_hex": None if value is None else value[:65536].hex()}
            exit_code = exit_code or 3
            break
        if execs % 256 == 0 and peak_rss_mb() > args.max_rss_mb:
            print(f"\n*** peak RSS {peak_rss_mb():.0f} MB exceeds {args.max_rss_mb:g} MB after {execs} execs "
                  f"({target.metric_series()} metric series held by the worker)", flush=True)
            failure = failure or {"what": "rss", "peak_rss_mb": peak_rss_mb(),
                                  "metric_series": target.metric_series()}
            exit_code = exit_code or 2
            break

    elapsed = time.monotonic() - start
    report(time.monotonic())
    summary = {
        "minutes": round(elapsed / 60, 3),
        "execs": execs,
        "crashes": crashes,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "slowest_ms": round(slowest_s * 1000, 3),
        "outcomes": dict(outcomes.most_common()),
        "seed": seed,
        "execs_per_s": round(execs / max(elapsed, 1e-9), 1),
        "inputs": dict(by_kind.most_common()),
        "slowest": slowest_what,
        "metric_series": target.metric_series(),
        "failure": failure,
        "exit_code": exit_code,
    }
    print("\nsummary:")
    print(f"  {execs} execs in {elapsed:.0f} s ({summary['execs_per_s']:,.0f}/s), seed {seed}")
    print(f"  crashes {crashes}, peak RSS {summary['peak_rss_mb']} MB, slowest {summary['slowest_ms']} ms "
          f"({slowest_what})")
    for outcome, n in outcomes.most_common():
        print(f"  {outcome:45s} {n:>10}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"  written to {args.out}")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
