"""Plots of issue 12's 16-core engine matrix (docs/benchmarks.md, "On the
16-core machine") from tools/bench_engine.py's --json output (what
tools/device_bench.sh writes as engine.json), one or more runs:

    PYTHONPATH=/path/with/matplotlib python3 tools/plot_device_bench.py
    PYTHONPATH=... python3 tools/plot_device_bench.py --run $OUT/engine.json --out $OUT

Draws device_throughput.png (store and load GB/s against blocks in flight
per side: threads, worker processes, the C reference; idle and with the
scheduler stand-in) and device_standin.png (the stand-in's iterations per
second as a share of its idle rate). The first run gets filled markers, the
others open ones; bars span each point's rounds. The defaults are the three
runs committed under docs/bench/device/. Needs matplotlib; no vLLM.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

if importlib.util.find_spec("llmkv_fs") is None:  # a checkout, not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from llmkv_fs.engine.workers.crew import resolve_io_workers

DEVICE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "bench", "device")
DEFAULT_RUNS = ("engine_matrix.json", "engine_per_side_6_7_8.json", "engine_6_7_8_long.json")
MARKERS = ("o", "s", "^", "D")
TARGET_PER_SIDE = 8
TARGETS = {"store": 18.0, "load": 20.0}  # issue 12: GB/s at 8 per side, idle
STANDIN_TARGET = 95.0  # issue 12: % of the stand-in's idle rate
SERIES = (  # (label, config key or None for the C reference, colour, line style)
    ("threads", "threads/numa=auto", "#1f77b4", "-"),
    ("threads + stand-in", "threads/numa=auto/standin", "#1f77b4", "--"),
    ("worker processes", "workers/numa=auto", "#d62728", "-"),
    ("workers + stand-in", "workers/numa=auto/standin", "#d62728", "--"),
    ("C reference (ref_blockio)", None, "#505050", ":"),
)


class Runs:
    """The runs to draw, their markers and labels, and the shared x axis:
    every per-side value any run measured, evenly spaced."""

    def __init__(self, paths: list[str]):
        self.docs = []
        for path in paths:
            with open(path) as f:
                self.docs.append(json.load(f))
        self.ticks = sorted({row["per_side"] for d in self.docs for row in d["rows"]})
        self.cpus = self.docs[0]["machine"]["cpus"]
        self.auto_workers = resolve_io_workers("auto", self.cpus)

    def each(self):
        """(doc, marker, label) per run."""
        for i, doc in enumerate(self.docs):
            yield doc, MARKERS[i % len(MARKERS)], f"run {i + 1}"

    def legend_note(self) -> str:
        parts = []
        for i, (doc, _, label) in enumerate(self.each()):
            kind = "filled" if i == 0 else "open"
            parts.append(f"{kind}: {label} (median of {doc['args']['rounds']})")
        return ", ".join(parts) + "; bars: min-max of rounds"

    def auto_note(self) -> str:
        return f"green: io_workers=auto on {self.cpus} CPUs ({self.auto_workers} workers)"

    def x(self, per_side: list[int]) -> list[int]:
        return [self.ticks.index(k) for k in per_side]


def points(doc: dict, config: str | None, key: str) -> tuple[list[int], list[float], list]:
    """Per side, the median and the (min, max) of the rounds of one series."""
    xs, ys, spans = [], [], []
    for row in doc["rows"]:
        if config is None:
            median, runs = row.get("reference"), row.get("reference_runs") or []
        else:
            median, runs = row["configs"].get(config), row["runs"].get(config, [])
        if not median:
            continue
        values = [r[key] for r in runs] or [median[key]]
        xs.append(row["per_side"])
        ys.append(median[key])
        spans.append((median[key] - min(values), max(values) - median[key]))
    return xs, ys, spans


def standin_points(doc: dict, config: str, direction: str):
    idle = doc["machine"]["standin_idle_per_s"]
    xs, ys, spans = [], [], []
    for row in doc["rows"]:
        median = row["configs"].get(config)
        if not median:
            continue
        values = [r[f"{direction}_standin"] / idle * 100 for r in row["runs"][config]]
        y = median[f"{direction}_standin"] / idle * 100
        xs.append(row["per_side"])
        ys.append(y)
        spans.append((y - min(values), max(values) - y))
    return xs, ys, spans


def _axes(ax, runs: Runs, ylabel: str) -> None:
    ax.set_xticks(range(len(runs.ticks)), [str(t) for t in runs.ticks])
    ax.set_xlim(-0.3, len(runs.ticks) - 0.7)
    ax.set_xlabel("blocks in flight per side")
    ax.set_ylabel(ylabel)
    ax.grid(color="#e6e6e6")
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    auto_per_side = runs.auto_workers / 2
    if runs.ticks[0] <= auto_per_side <= runs.ticks[-1]:  # between ticks where not measured
        below = max(t for t in runs.ticks if t <= auto_per_side)
        i = runs.ticks.index(below)
        after = runs.ticks[min(i + 1, len(runs.ticks) - 1)]
        frac = (auto_per_side - below) / (after - below) if after > below else 0.0
        ax.axvline(i + frac, color="#2ca02c", linewidth=1, alpha=0.6)


def _draw(ax, at, ys, spans, color, style, marker, label) -> None:
    """Markers and round spans; lines only between neighbouring ticks, a
    faint one across a per-side value the run did not measure. A series the
    run did not measure at all gets no legend entry."""
    if not at:
        return
    open_marker = marker != MARKERS[0]
    width = 1.2 if open_marker else 2
    ax.errorbar(
        at,
        ys,
        yerr=list(zip(*spans)) if spans else None,
        color=color,
        linestyle="none",
        marker=marker,
        markersize=6,
        markerfacecolor="white" if open_marker else color,
        capsize=3,
        elinewidth=0.8,
    )
    for i in range(len(at) - 1):
        gap = at[i + 1] - at[i] > 1
        ax.plot(
            at[i : i + 2],
            ys[i : i + 2],
            color=color,
            linestyle=style,
            linewidth=0.6 if gap else width,
            alpha=0.35 if gap else 1.0,
        )
    # One legend entry showing line and marker together.
    ax.plot(
        [],
        [],
        color=color,
        linestyle=style,
        linewidth=width,
        marker=marker,
        markerfacecolor="white" if open_marker else color,
        label=label,
    )


def plot_throughput(runs: Runs, path: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(13, 6), dpi=100)
    fig.subplots_adjust(left=0.05, right=0.80, top=0.80, bottom=0.10, wspace=0.16)
    title = f"FsEngine on {runs.cpus} CPUs, tmpfs, 2 MiB blocks, checksum on"
    fig.text(0.05, 0.95, title, fontsize=14)
    fig.text(
        0.05,
        0.87,
        "per side k: k read + k write threads, 2k worker processes or 2k C pthreads\n"
        f"{runs.legend_note()}; faint: across a value the run skipped\n"
        f"{runs.auto_note()}; red: issue 12 target at {TARGET_PER_SIDE} per side",
        fontsize=9,
        color="#505050",
    )
    for i, direction in enumerate(("store", "load")):
        ax = fig.add_subplot(1, 2, i + 1)
        for doc, marker, run in runs.each():
            for label, config, color, style in SERIES:
                xs, ys, spans = points(doc, config, f"{direction}_gbps")
                _draw(ax, runs.x(xs), ys, spans, color, style, marker, f"{label}, {run}")
        if TARGET_PER_SIDE in runs.ticks:
            at = runs.ticks.index(TARGET_PER_SIDE)
            ax.plot(
                [at - 0.3, at + 0.3], [TARGETS[direction]] * 2, color="#ff0000", lw=2.5, alpha=0.7
            )
        _axes(ax, runs, "GB/s")
        ax.set_ylim(bottom=0)
        ax.set_title(direction, loc="left")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(0.805, 0.80), fontsize=8.5)
    fig.savefig(path)


def plot_standin(runs: Runs, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5.6), dpi=100)
    fig.subplots_adjust(left=0.07, right=0.74, top=0.78, bottom=0.11)
    fig.text(0.07, 0.94, "Scheduler stand-in's rate while the engine moves blocks", fontsize=14)
    idle = runs.docs[0]["machine"]["standin_idle_per_s"]
    fig.text(
        0.07,
        0.83,
        f"a Python thread in the engine's process: 0.5 ms busy, 1 ms pause (~{idle:.0f}/s idle)\n"
        f"{runs.legend_note()}\n"
        f"red: issue 12 target ({STANDIN_TARGET:.0f} %); {runs.auto_note()}",
        fontsize=9,
        color="#505050",
    )
    ax = fig.add_subplot()
    for doc, marker, run in runs.each():
        for mode, config, color in (
            ("threads", "threads/numa=auto/standin", "#1f77b4"),
            ("workers", "workers/numa=auto/standin", "#d62728"),
        ):
            for direction, style in (("store", "-"), ("load", "--")):
                xs, ys, spans = standin_points(doc, config, direction)
                label = f"{mode}, {direction}s, {run}"
                _draw(ax, runs.x(xs), ys, spans, color, style, marker, label)
    ax.axhline(STANDIN_TARGET, color="#ff0000", linewidth=1.5, alpha=0.7)
    _axes(ax, runs, "stand-in iterations/s, % of idle")
    ax.set_ylim(min(50, ax.get_ylim()[0]), 105)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8.5)
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--run",
        action="append",
        metavar="JSON",
        help="a bench_engine.py --json file (repeat; default: the runs in docs/bench/device)",
    )
    p.add_argument("--out", default=DEVICE, help="where the PNGs go")
    args = p.parse_args()
    runs = Runs(args.run or [os.path.join(DEVICE, name) for name in DEFAULT_RUNS])
    for name, draw in (
        ("device_throughput.png", plot_throughput),
        ("device_standin.png", plot_standin),
    ):
        path = os.path.join(args.out, name)
        draw(runs, path)
        print(os.path.normpath(path))


if __name__ == "__main__":
    main()
