"""Rendering for ``llmkv-fs bench``: the machine's description, the markdown
tables, the JSON document and the PNG plots (matplotlib, the ``[bench]``
extra; without it the plots are skipped with a message).

Everything here works on the plain result dict that ``bench.py`` builds, so a
saved ``--json`` file can be re-rendered without re-running anything.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
import textwrap
from typing import TYPE_CHECKING, Any

from llmkv_fs.harness.machine import describe_machine

if TYPE_CHECKING:  # matplotlib is the optional [bench] extra
    from matplotlib.backend_bases import RendererBase
    from matplotlib.figure import Figure
    from matplotlib.text import Text

__all__ = [
    "fit_text",
    "markdown",
    "plot_all",
    "plotting_missing",
    "write_json",
]

DIRECTIONS = ("store", "load")
SERIES = (
    ("ours", "llmkv_fs", (31, 119, 180)),
    ("builtin", "vLLM built-in fs", (255, 127, 14)),
    ("reference", "fio (physical)", (90, 90, 90)),
)


def chunk_size(block_mib: float) -> str:
    """A chunk size for tables: "64 KiB" below a MiB, else "2 MiB"."""
    return f"{block_mib * 1024:g} KiB" if block_mib < 1 else f"{block_mib:g} MiB"


# -- tables ------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{fmt}}{suffix}"


def markdown(result: dict) -> str:
    a = result["args"]
    out = [describe_machine(result["machine"]), ""]
    out.append(
        f"{a['jobs']} jobs x {a['blocks_per_job']} blocks per direction, median of {a['rounds']} "
        f"alternating rounds; ours: checksum={a['checksum']} durability={a['durability']}; "
        f"threads = n_read_threads = n_write_threads (2x that many serve a one-direction burst; "
        f"the reference runs that many jobs)."
    )
    out += _throughput_table(result["cases"])
    out += _roots_table(result["cases"])
    out += _latency_table(result["cases"])
    out += _mixed_table([c for c in result["cases"] if c.get("mixed")])
    return "\n".join(out) + "\n"


def _throughput_table(cases: list[dict[str, Any]]) -> list[str]:
    out = [
        "",
        "### Throughput (GB/s, median)",
        "",
        "| medium | block | threads | store ours | built-in | ratio | ref | ours % ref "
        "| load ours | built-in | ratio | ref | ours % ref |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        row = [f"`{c['medium']}` {_fstypes(c)}", chunk_size(c["block_mib"]), str(c["threads"])]
        for d in DIRECTIONS:
            ref = c["reference"][d]["gbps"] if c.get("reference") else None
            ours = c["tiers"]["ours"][d]["gbps"]
            row += [
                _f(ours),
                _f(c["tiers"]["builtin"][d]["gbps"]),
                _f(c["ratio"][d], suffix="x"),
                _f(ref),
                _f(100 * ours / ref if ref else None, ".0f", " %"),
            ]
        out.append("| " + " | ".join(row) + " |")
    refs = {(c["reference"]["tool"], c["reference"]["direct"]) for c in cases if c.get("reference")}
    if refs:
        out += [
            "",
            "Reference: "
            + ", ".join(
                f"{tool} ({'O_DIRECT' if direct else 'buffered'})" for tool, direct in sorted(refs)
            )
            + ", one file per block, psync.",
        ]
    return out


def _fstypes(case: dict[str, Any]) -> str:
    """The medium's filesystem type, or its roots' joined by + (several roots)."""
    return "+".join(fs["fstype"] for fs in case.get("fs_roots", [case["fs"]]))


def _roots_table(cases: list[dict[str, Any]]) -> list[str]:
    """Media of several roots: ours' aggregate GB/s against the built-in on the
    first root (same rounds) and against ours on the first root alone."""
    several = [c for c in cases if len(c.get("roots", ())) > 1]
    if not several:
        return []
    out = [
        "",
        "### Several roots (ours sharded by block hash; built-in and reference on the first root)",
        "",
        "| medium | roots | block | threads | store ours | built-in | ratio | ours / 1 root "
        "| load ours | built-in | ratio | ours / 1 root |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in several:
        row = [f"`{c['medium']}` {_fstypes(c)}", str(len(c["roots"]))]
        row += [chunk_size(c["block_mib"]), str(c["threads"])]
        for d in DIRECTIONS:
            one = c.get("vs_one_root", {}).get(d)
            row += [
                _f(c["tiers"]["ours"][d]["gbps"]),
                _f(c["tiers"]["builtin"][d]["gbps"]),
                _f(c["ratio"][d], suffix="x"),
                _f(one, suffix="x"),
            ]
        out.append("| " + " | ".join(row) + " |")
    return out


def _latency_table(cases: list[dict[str, Any]]) -> list[str]:
    out = [
        "",
        "### Job latency and scheduler-thread cost",
        "",
        "| medium | block | threads | dir | p50 ms ours / built-in | p99 ms ours / built-in "
        "| sched µs/block ours / built-in |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        o, b = c["tiers"]["ours"], c["tiers"]["builtin"]
        for d in DIRECTIONS:
            out.append(
                f"| `{c['medium']}` | {chunk_size(c['block_mib'])} | {c['threads']} | {d} "
                f"| {_f(o[d]['p50_ms'])} / {_f(b[d]['p50_ms'])} "
                f"| {_f(o[d]['p99_ms'])} / {_f(b[d]['p99_ms'])} "
                f"| {_f(o[d]['sched_us_per_block'], '.1f')} "
                f"/ {_f(b[d]['sched_us_per_block'], '.1f')} |"
            )
    return out


def _mixed_table(mixed: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    if mixed:
        out += [
            "",
            "### Loads during a store backlog (--mixed)",
            "",
            "| medium | block | threads | backlog (blocks) | loads | idle p50 ms ours / built-in "
            "| p50 ms ours / built-in | p99 ms ours / built-in | ratio p99 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in mixed:
            o, b = c["mixed"]["ours"], c["mixed"]["builtin"]
            p99_ratio = o["p99_ms"] / b["p99_ms"] if o["p99_ms"] and b["p99_ms"] else None
            out.append(
                f"| `{c['medium']}` | {chunk_size(c['block_mib'])} | {c['threads']} "
                f"| {c['mixed']['store_blocks']} | {o['n']} / {b['n']} "
                f"| {_f(o['idle_p50_ms'])} / {_f(b['idle_p50_ms'])} "
                f"| {_f(o['p50_ms'])} / {_f(b['p50_ms'])} | {_f(o['p99_ms'])} / {_f(b['p99_ms'])} "
                f"| {_f(p99_ratio, suffix='x')} |"
            )
    return out


def write_json(result: dict, path: str) -> None:
    if path == "-":
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


# -- plots ---------------------------------------------------------------------------

PLOTS_NEED = "matplotlib is not installed (pip install 'llmkv-fs[bench]')"


def plotting_missing() -> str | None:
    """Why plots cannot be drawn here (a message naming the fix), or None."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # a module object without a spec in sys.modules
        found = False
    return None if found else PLOTS_NEED


def plot_one(
    path: str,
    title: str,
    subtitle: str,
    xs: list[int],
    series: list[tuple[str, tuple[int, int, int], list[float | None], bool]],
) -> Figure:
    """GB/s against thread counts (evenly spaced), one line per series, the
    dashed ones for the physical reference; 1100 x 600 pixels, every word
    inside them. Returns the figure drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(11, 6), dpi=100)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.subplots_adjust(left=0.082, right=0.773, top=0.85, bottom=0.133)
    ax = fig.add_subplot()
    _headings(fig, renderer, title, subtitle)
    for name, color, ys, dashed in series:
        points = [(i, v) for i, v in enumerate(ys) if v is not None]
        ax.plot(
            [i for i, _ in points],
            [v for _, v in points],
            label=name,
            color=tuple(c / 255 for c in color),
            linestyle="--" if dashed else "-",
            linewidth=2,
            marker="o",
            markersize=7,
        )
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    if len(xs) == 1:
        ax.set_xlim(-1, 1)  # the one point in the middle
    else:
        ax.margins(x=0.045)
    values = [v for _, _, ys, _ in series for v in ys if v is not None]
    ax.set_ylim(0, max(values, default=1.0) * 1.1)  # headroom above the highest point
    ax.grid(axis="y", color="#e1e1e1")
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_xlabel("I/O threads per side (n_read_threads = n_write_threads)")
    ax.set_ylabel("GB/s")
    # Right of the plot area: never over a line. The plot area gives way
    # to a legend wider than its margin (long series names).
    legend = ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=True)
    legend_width = legend.get_window_extent(renderer).width / fig.bbox.width
    left = ax.get_position().x0
    fig.subplots_adjust(right=min(0.773, left + (1 - _EDGE - legend_width - left) / 1.02))
    fig.savefig(path)
    return fig


_EDGE = 0.01  # of the figure's width, kept clear at its right edge


def _headings(fig: Figure, renderer: RendererBase, title: str, subtitle: str) -> None:
    """Title and subtitle above the plot area, top-aligned, each below the
    one before: a long medium path, node name or mount path shrinks and
    wraps downwards, never off the figure."""
    width = (1 - _EDGE - 0.082) * fig.bbox.width
    heading = fig.text(0.082, 0.98, title, fontsize=15, va="top")
    fit_text(heading, renderer, width, min_size=10)
    below = (heading.get_window_extent(renderer).y0 - 5) / fig.bbox.height
    sub = fig.text(0.082, below, subtitle, fontsize=10, color="#505050", va="top")
    fit_text(sub, renderer, width, min_size=8)


def fit_text(text: Text, renderer: RendererBase, width_px: float, min_size: float) -> None:
    """Make ``text`` at most ``width_px`` wide: a smaller font (down to
    ``min_size`` points), then lines broken at spaces (or inside a word
    longer than a line)."""
    while text.get_window_extent(renderer).width > width_px and text.get_fontsize() > min_size:
        text.set_fontsize(max(min_size, text.get_fontsize() - 0.5))
    lines = text.get_text().splitlines()
    columns = max((len(line) for line in lines), default=0)
    while columns > 10 and text.get_window_extent(renderer).width > width_px:
        columns = int(columns * 0.9)
        text.set_text("\n".join(textwrap.fill(line, columns) if line else "" for line in lines))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_") or "root"


def plot_all(result: dict, plot_dir: str) -> list[str]:
    """One PNG per medium, block size and direction: GB/s against threads.
    Without matplotlib, says so on stderr and draws nothing."""
    missing = plotting_missing()
    if missing:
        print(f"# plots skipped: {missing}", file=sys.stderr)
        return []
    os.makedirs(plot_dir, exist_ok=True)
    m = result["machine"]
    written = []
    groups: dict[tuple[str, float], list[dict]] = {}
    for c in result["cases"]:
        groups.setdefault((c["medium"], c["block_mib"]), []).append(c)
    for (medium, block), cases in groups.items():
        cases.sort(key=lambda c: c["threads"])
        xs = [c["threads"] for c in cases]
        fs = cases[0]["fs"]
        ref_tool = next((c["reference"]["tool"] for c in cases if c.get("reference")), None)
        for d in DIRECTIONS:
            series = []
            for key, name, color in SERIES:
                label = name
                if key == "reference":
                    if ref_tool is None:
                        continue
                    ys = [c["reference"][d]["gbps"] if c.get("reference") else None for c in cases]
                    label = (
                        "fio (physical)"
                        if ref_tool == "fio"
                        else "python O_DIRECT/psync (physical)"
                    )
                else:
                    ys = [c["tiers"][key][d]["gbps"] for c in cases]
                series.append((label, color, ys, key == "reference"))
            title = (
                f"{d} GB/s vs threads: {medium} ({_fstypes(cases[0])}), {chunk_size(block)} blocks"
            )
            subtitle = (
                f"{m['node']}, {m['cpus']} CPUs, {m['ram_gib']} GiB RAM, {fs['device']} on "
                f"{fs['mount']}; {result['args']['jobs']}x{result['args']['blocks_per_job']} "
                f"blocks/round, median of {result['args']['rounds']}"
            )
            path = os.path.join(plot_dir, f"bench_{_slug(medium)}_{block:g}MiB_{d}.png")
            plot_one(path, title, subtitle, xs, series)
            written.append(path)
    return written
