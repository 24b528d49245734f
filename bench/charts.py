"""Draw docs/bench-isolation.png from bench/results.json (run by `make bench` after the scenarios).

One figure, the comparisons a user asks about first, each beside its baseline from the same run:

* CRITICAL's queue-wait p99 alone and under a BACKGROUND flood, llmq's bands against one FIFO topic;
* a quiet tenant's wait p99 alone and beside a tenant flooding the same band, with the Jain index,
  and beside the same flooder on one FIFO partition;
* CRITICAL's wait on a busy model server, llmq's pacing against a naive 64 in flight.

A scenario missing from results.json leaves its panel saying so instead of failing the run.

    python bench/charts.py [--results bench/results.json] [--out docs/bench-isolation.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLMQ, BASELINE = "#2b6cb0", "#a0aec0"


def _bars(ax, title: str, groups: list[str], series: list[tuple[str, list[float | None], str]], unit: str) -> None:
    width = 0.8 / len(series)
    for i, (label, values, color) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [v or 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=label, color=color)
        for bar, v in zip(bars, values):
            ax.annotate("n/a" if v is None else f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(groups)), groups)
    shown = [v for _, values, _ in series for v in values if v]
    if shown and max(shown) > 30 * min(shown):  # a FIFO backlog of seconds beside waits of milliseconds
        ax.set_yscale("log")
        unit += " (log scale)"
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)


def _missing(ax, title: str, scenario: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.text(0.5, 0.5, f"{scenario}: not in results.json", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def draw(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = results.get("scenarios", {})
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))

    iso = scenarios.get("priority_isolation")
    title = "CRITICAL wait p99, BACKGROUND flood"
    if iso:
        _bars(axes[0], title, ["alone", "flooded"], [
            ("llmq (bands)", [iso.get("critical_p99_alone_ms"), iso.get("critical_p99_flood_ms")], LLMQ),
            ("FIFO (one topic)", [iso.get("baseline_fifo_p99_alone_ms"), iso.get("baseline_fifo_p99_flood_ms")],
             BASELINE),
        ], "ms")
    else:
        _missing(axes[0], title, "priority_isolation")

    fair = scenarios.get("tenant_fairness")
    title = "quiet tenant wait p99, beside a flooder"
    if fair:
        jain = fair.get("jain_index")
        _bars(axes[1], title + (f" (Jain {jain:.2f})" if isinstance(jain, (int, float)) else ""),
              ["alone", "with flooder"],
              [("llmq (fair shares)", [fair.get("quiet_p99_alone_ms"), fair.get("quiet_p99_with_flooder_ms")], LLMQ),
               ("FIFO (one partition)", [None, fair.get("baseline_fifo_p99_with_flooder_ms")], BASELINE)],
              "ms")
    else:
        _missing(axes[1], title, "tenant_fairness")

    util = scenarios.get("backend_utilization")
    title = "CRITICAL wait p99 on a busy model server"
    if util and isinstance(util.get("naive"), dict):
        naive = util["naive"]
        _bars(axes[2], title, ["CRITICAL wait p99", "a request's time in the server"], [
            ("llmq (paced)", [util.get("critical_wait_p99_ms"), util.get("service_ms")], LLMQ),
            ("naive (64 in flight)", [naive.get("critical_wait_p99_ms"), naive.get("in_server_ms_p50")], BASELINE),
        ], "ms")
    else:
        _missing(axes[2], title, "backend_utilization")

    runs = sorted({v["run_at"][:10] for v in scenarios.values() if isinstance(v, dict) and v.get("run_at")})
    when = f"scenarios run {', '.join(runs)}" if runs else results.get("conditions", {}).get("date", "")
    fig.suptitle(f"llmq beside its baselines in the same runs, from bench/results.json ({when})", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-isolation.png")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[dev]'); no chart drawn", file=sys.stderr)
        return 1
    out = draw(json.loads(args.results.read_text()), args.out)
    print(f"chart written to {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
