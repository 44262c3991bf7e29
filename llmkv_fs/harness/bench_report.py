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
import platform
import re
import sys
from typing import Any

from llmkv_fs.volume.fsinfo import mount_of

__all__ = [
    "fs_of",
    "loop_backing",
    "machine_info",
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


# -- the machine -------------------------------------------------------------------


def loop_backing(device: str) -> str | None:
    """The file behind a loop device (/dev/loopN), else None."""
    name = os.path.basename(device)
    if not name.startswith("loop"):
        return None
    try:
        with open(f"/sys/block/{name}/loop/backing_file", encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def fs_of(path: str) -> dict[str, str]:
    """Mount point, filesystem type and device of ``path`` (the mount table);
    for a loop device also the file behind it (``backing``)."""
    mount = mount_of(path)
    if mount is None:
        return {"mount": "/", "fstype": "?", "device": "?"}
    out = {"mount": mount.mount_point, "fstype": mount.fstype, "device": mount.device}
    backing = loop_backing(mount.device)
    if backing:
        out["backing"] = f"{backing} ({fs_of(backing)['fstype']})"
    return out


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def machine_info(dirs: list[str]) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from llmkv_fs.engine.startup.numa import read_topology

    try:
        vllm_version = version("vllm")
    except PackageNotFoundError:
        vllm_version = None
    try:  # the built-in tier's native batch I/O; without it, a Python loop
        fsio_c = importlib.util.find_spec("vllm.fs_io_C") is not None
    except ImportError:
        fsio_c = False
    topo = read_topology()
    ram = _ram_gib()
    return {
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "allowed_cpus": len(topo.allowed_cpus),
        "numa_nodes": sum(1 for cpus in topo.nodes.values() if cpus),
        "ram_gib": round(ram, 1) if ram else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "vllm": vllm_version,
        "vllm_fs_io_C": fsio_c,
        "media": {d: fs_of(d) for d in dirs},
    }


def describe_machine(m: dict) -> str:
    media = "; ".join(
        f"`{d}` {fs['fstype']} ({fs['device']} on {fs['mount']}"
        + (f", backed by {fs['backing']})" if fs.get("backing") else ")")
        for d, fs in m["media"].items()
    )
    return (
        f"Machine `{m['node']}`: {m['cpus']} CPUs ({m['allowed_cpus']} allowed), "
        f"{m['numa_nodes']} NUMA node(s), {m['ram_gib']} GiB RAM, Linux {m['kernel']}, "
        f"Python {m['python']}, vLLM {m['vllm']} "
        f"(fs_io_C {'loaded' if m['vllm_fs_io_C'] else 'absent'}). "
        f"Media: {media}."
    )


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
) -> None:
    """GB/s against thread counts (evenly spaced), one line per series, the
    dashed ones for the physical reference; 1100 x 600 pixels."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(11, 6), dpi=100)
    fig.subplots_adjust(left=0.082, right=0.773, top=0.85, bottom=0.133)
    ax = fig.add_subplot()
    fig.text(0.082, 0.945, title, fontsize=15)
    fig.text(0.082, 0.905, subtitle, fontsize=10, color="#505050")
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
    # Right of the plot area: never over a line.
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=True)
    fig.savefig(path)


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
