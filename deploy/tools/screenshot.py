"""`make screenshot`: docs/prometheus-demo.png, the real stack under the demo's load, as Prometheus shows it.

Grafana cannot be installed here, so the picture is Debian's Prometheus web UI (headless Debian
chromium) over the series the dashboard is built from: band depth, queue-wait p99 per band and
consumer lag. Everything is real: a local broker, `llmq demo` (gateway, two workers, a flood of
mostly BACKGROUND work, one rate-limited tenant), `llmq lag-exporter`, and Prometheus scraping
them every second with deploy/prometheus's recording rules.

    python deploy/tools/screenshot.py [--out docs/prometheus-demo.png] [--seconds 100]

Needs chromium (`apt-get install chromium`) and the prometheus binary `make setup` unpacks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipeline.broker import LocalBroker, free_port  # noqa: E402
from pipeline.config import Settings  # noqa: E402

GATEWAY_PORT, WORKER_PORT = 6066, 9111  # the demo's gateway web port; workers on WORKER_PORT + i

#: What an operator looks at first, as the dashboard's panels compute it.
PANELS = {
    "band depth (gateway)": "sum by (priority) (llmq_gateway_queue_depth)",
    "queue wait p99 per band, seconds": (
        "histogram_quantile(0.99, sum by (priority, le) (rate(llmq_queue_wait_seconds_bucket[30s])))"),
    "consumer lag (kafka_exporter's name)": "sum by (consumergroup, topic) (kafka_consumergroup_lag)",
}


def _say(msg: str) -> None:
    print(f"[screenshot] {msg}", flush=True)


def _prometheus_binary() -> str:
    cached = ROOT / ".venv" / ".prometheus-bin"
    if cached.exists():
        found = Path(cached.read_text().strip()) / "prometheus"
        if found.exists():
            return str(found)
    found = shutil.which("prometheus")
    if not found:
        sys.exit("prometheus not found: run `make setup` first")
    return found


#: Debian's build serves its web UI from this path, compiled in; no flag moves it.
DEBIAN_WEB_UI = Path("/usr/share/prometheus/web")


def _web_ui(prometheus: str) -> None:
    """Make the web UI's templates and scripts reachable where Debian's prometheus looks for them.

    A packaged install has them there. The copy `make setup` unpacks keeps them beside the binary,
    so, where it may (as root), this links that path to the unpacked copy, and says so."""
    if (DEBIAN_WEB_UI / "templates" / "_base.html").exists():
        return
    unpacked = Path(prometheus).resolve().parents[1] / "share" / "prometheus"
    if not (unpacked / "web" / "templates" / "_base.html").exists():
        sys.exit(f"this prometheus has no web UI templates at {DEBIAN_WEB_UI}: install Debian's package "
                 "(apt-get install prometheus)")
    if DEBIAN_WEB_UI.parent.exists() or not os.access(DEBIAN_WEB_UI.parents[1], os.W_OK):
        sys.exit(f"Debian's prometheus reads its web UI from {DEBIAN_WEB_UI}, which is missing. Install the "
                 f"package (apt-get install prometheus), or link it: ln -s {unpacked} {DEBIAN_WEB_UI.parent}")
    DEBIAN_WEB_UI.parent.symlink_to(unpacked, target_is_directory=True)
    _say(f"linked {DEBIAN_WEB_UI.parent} -> {unpacked} (Debian's prometheus reads its web UI there)")


def _chromium() -> str:
    found = shutil.which("chromium")
    if not found:
        sys.exit("chromium not found: `apt-get install chromium` (Debian's package)")
    return found


def _wait_http(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def graph_url(base: str, range_s: int) -> str:
    params = {}
    for i, expr in enumerate(PANELS.values()):
        params.update({f"g{i}.expr": expr, f"g{i}.tab": "0", f"g{i}.stacked": "0",
                       f"g{i}.range_input": f"{max(range_s, 60)}s", f"g{i}.show_exemplars": "0"})
    return f"{base}/graph?{urllib.parse.urlencode(params)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "prometheus-demo.png")
    parser.add_argument("--seconds", type=float, default=100.0, help="seconds of demo load before the picture")
    args = parser.parse_args(argv)
    chromium, prometheus = _chromium(), _prometheus_binary()
    _web_ui(prometheus)
    work = Path(tempfile.mkdtemp(prefix="llmq-shot-"))
    procs: list[subprocess.Popen] = []
    broker = LocalBroker(free_port(), work / "kafka", kafka_version=Settings().broker.kafka_version, progress=_say)
    try:
        _say(f"starting a broker at {broker.bootstrap}")
        broker.up()
        env = {**os.environ, "LLMQ_BOOTSTRAP": broker.bootstrap}
        prom_port, lag_port = free_port(), free_port()
        targets = {"llmq-gateway": [GATEWAY_PORT], "llmq-workers": [WORKER_PORT, WORKER_PORT + 1],
                   "llmq-lag-exporter": [lag_port]}
        jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: "
                       f"[{', '.join(repr(f'127.0.0.1:{p}') for p in ports)}]\n" for job, ports in targets.items())
        rules = ROOT / "deploy" / "prometheus"
        (work / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {rules / 'llmq-recording.yml'}\n  - {rules / 'llmq-alerts.yml'}\n"
            f"scrape_configs:\n{jobs}")
        procs.append(subprocess.Popen([prometheus, f"--config.file={work / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={work / 'tsdb'}",
                                       f"--web.listen-address=127.0.0.1:{prom_port}"],
                                      stdout=subprocess.DEVNULL, stderr=open(work / "prometheus.log", "w")))
        base = f"http://127.0.0.1:{prom_port}"
        _wait_http(f"{base}/-/ready", 30)
        # Long enough a load that the picture is taken while it runs (the demo stops what it started).
        rate = 300
        demo = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "demo", "--requests",
                                 str(int(rate * (args.seconds + 30))), "--rate", str(rate),
                                 "--worker-metrics-port", str(WORKER_PORT)],
                                env=env, stdout=open(work / "demo.log", "w"), stderr=subprocess.STDOUT)
        procs.append(demo)
        procs.append(subprocess.Popen([sys.executable, "-m", "pipeline.cli", "lag-exporter", "--metrics-port",
                                       str(lag_port), "--interval", "2"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(work / "lag.log", "w")))
        started = time.monotonic()
        while time.monotonic() - started < args.seconds:
            if demo.poll() is not None:
                _say(f"the demo ended early: {(work / 'demo.log').read_text()[-1500:]}")
                return 1
            time.sleep(5)
            _say(f"{time.monotonic() - started:.0f}/{args.seconds:.0f} s of load")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={work / 'chromium'}", "--hide-scrollbars", "--window-size=1400,2650",
                        "--virtual-time-budget=15000", f"--screenshot={args.out}",
                        graph_url(base, int(args.seconds))],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        _say(f"screenshot written to {args.out}")
        return 0
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        broker.down()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
