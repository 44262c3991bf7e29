"""The tables of tools/bench/latency.py's matrix (pure: latency.json in,
markdown out), one function per table: the delay as checked, ours against
the built-in at every delay, the lookup per lookup_threads, and single
checks in round trips. Cells are formatted as tools/bench/lookup_report.py
formats its own."""

from __future__ import annotations

import dataclasses
from typing import Any

from llmkv_fs.config import TierSettings
from tools.bench.lookup_report import CASES, fmt, fops_cell

DIRECTIONS = ("store", "load")


def default_lookup_threads() -> int:
    """lookup_threads' default in this tree's settings."""
    field = next(f for f in dataclasses.fields(TierSettings) if f.name == "lookup_threads")
    return int(field.default)  # type: ignore[arg-type]


# -- cells ---------------------------------------------------------------------------------


def engine_cells(engine: dict | None, case: str, block_mib: float | None = None) -> dict:
    """Ours and the built-in's store and load GB/s in ``case`` of an engine
    run's JSON (its first row of that case)."""
    if not engine:
        return {}
    for row in engine["rows"]:
        if row["case"]["name"] != case:
            continue
        ours = next(m for label, m in row["configs"].items() if not label.startswith("builtin"))
        builtin = next(
            (m for label, m in row["configs"].items() if label.startswith("builtin")), None
        )
        out = {}
        for d in DIRECTIONS:
            o = ours[f"{d}_gbps"]
            b = builtin[f"{d}_gbps"] if builtin else None
            out[d] = {"ours": o, "builtin": b, "ratio": o / b if b else None}
        return out
    return {}


def lookup_cells(lookup: dict | None, threads: int) -> dict:
    """Ours at ``threads`` and the built-in, seconds per case, and the
    built-in's time over ours."""
    if not lookup:
        return {}
    summary = lookup["summary"]
    ours, builtin = summary.get(f"ours/{threads}"), summary.get("builtin")
    out = {}
    for case in CASES:
        o = ours[case] if ours else None
        b = builtin[case]["s"] if builtin else None
        out[case] = {
            "ours": o["s"] if o else None,
            "builtin": b,
            "ratio": b / o["s"] if o and o["s"] and b else None,
            "wrong": o["wrong"] if o else 0,
            "expired": o["expired"] if o else 0,
        }
    return out


def fmt_load(load: Any) -> str:
    return "-" if not load else " / ".join(f"{x:.2f}" for x in load)


# -- the tables ----------------------------------------------------------------------------


def render(result: dict) -> str:
    """latency.json as markdown tables."""
    lines = _heading(result) + _delay_table(result) + _comparison_table(result)
    sweep = [d for d in result["delays"] if d.get("lookup")]
    if sweep:
        lines += _threads_table(result["args"], sweep) + _round_trips_table(sweep)
    return "\n".join(lines) + "\n"


def _heading(result: dict) -> list[str]:
    a = result["args"]
    info = result["machine"]
    return [
        f"## Latency matrix: GlusterFS {result.get('gluster_version', '?')} on loopback, "
        f"one brick, {a['server_threads']} brick I/O threads, delay-gen on every file operation",
        "",
        f"Machine: {info['node']}, {info['cpus']} CPUs ({info['cpu_model']}), "
        f"{info['ram_gib']} GiB, Linux {info['kernel']}, Python {info['python']}. "
        f"Load average before {fmt_load(result['load_before'])}, after "
        f"{fmt_load(result.get('load_after'))}.",
    ]


def _delay_table(result: dict) -> list[str]:
    lines = [
        "",
        "### The delay, checked (stat of a missing name from the second mount)",
        "",
        "| delay µs | negative stat p50 ms | brick fops per stat | restart s |",
        "|---:|---:|---|---:|",
    ]
    for d in result["delays"]:
        lines.append(
            f"| {d['us']} | {d['stat_p50_s'] * 1e3:.2f} | "
            f"{fops_cell(d.get('stat_fops_per_call'))} | {d['restart_s']:.1f} |"
        )
    return lines


def _comparison_table(result: dict) -> list[str]:
    a = result["args"]
    threads = result.get("headline_threads") or default_lookup_threads()
    lines = [
        "",
        f"### Ours against the built-in (ratio: ours' speed over the built-in's; lookups with "
        f"lookup_threads={threads}; engine: {a['per_side']} + {a['per_side']} I/O threads "
        f"against the built-in's {a['builtin_threads']} + {a['builtin_threads']})",
        "",
        "| delay µs | case | ours | built-in | ratio |",
        "|---:|---|---:|---:|---:|",
    ]
    for d in result["delays"]:
        lines += _lookup_rows(a, d, threads) + _engine_rows(a, d)
    return lines


def _lookup_rows(a: dict, d: dict, threads: int) -> list[str]:
    """One delay's lookups of the comparison: ours at ``threads`` and the built-in."""
    rows = []
    look = lookup_cells(d.get("lookup"), threads)
    for case, what in zip(CASES, ("all hits", "all misses")):
        c = look.get(case)
        if c:
            note = f" ({c['wrong']} wrong, {c['expired']} past the deadline)" if c["wrong"] else ""
            rows.append(
                f"| {d['us']} | lookup of {a['lookup_keys']} keys, {what}, s | "
                f"{fmt(c['ours'], '.3f')}{note} | {fmt(c['builtin'], '.3f')} | "
                f"{fmt(c['ratio'], '.2f')} |"
            )
    return rows


def _engine_rows(a: dict, d: dict) -> list[str]:
    """One delay's engine runs of the comparison, store and load of each."""
    runs = [
        (d.get("engine"), "long", f"one job of {a['long_blocks']} × {a['block_mib']:g} MiB"),
        (
            d.get("engine"),
            "many",
            f"{a['many_blocks']} × {a['block_mib']:g} MiB in jobs of {a['blocks_per_job']}",
        ),
    ]
    if d.get("engine_small"):
        small = f"one job of {a['long_blocks']} × {a['small_block_mib']:g} MiB"
        runs.append((d["engine_small"], "long", small))
    rows = []
    for engine, case, what in runs:
        got = engine_cells(engine, case)
        for direction in DIRECTIONS:
            c = got.get(direction)
            if c:
                rows.append(
                    f"| {d['us']} | {what}, {direction} GB/s | {c['ours']:.3f} | "
                    f"{fmt(c['builtin'], '.3f')} | {fmt(c['ratio'], '.2f')} |"
                )
    return rows


def _threads_table(a: dict, sweep: list[dict]) -> list[str]:
    threads = [int(x) for x in a["lookup_threads"].split(",")]
    lines = [
        "",
        f"### The lookup of {a['lookup_keys']} keys per lookup_threads: seconds from the "
        "first lookup to the last verdict (built-in / ours)",
        "",
        "| delay µs | case | "
        + " | ".join(f"ours/{x}" for x in threads)
        + " | built-in | plain stat/1 | plain stat/"
        + str(max(threads))
        + " |",
        "|---:|---|" + "---:|" * (len(threads) + 3),
    ]
    for d in sweep:
        summary = d["lookup"]["summary"]
        for case in CASES:
            cells = [_ours_cell(summary, x, case) for x in threads]
            cells.append(fmt(summary.get("builtin", {}).get(case, {}).get("s"), ".3f"))
            cells += [
                fmt(summary.get(f"plain stat/{x}", {}).get(case, {}).get("s"), ".3f")
                for x in (1, max(threads))
            ]
            lines.append(f"| {d['us']} | {case} | " + " | ".join(cells) + " |")
    return lines


def _ours_cell(summary: dict, threads: int, case: str) -> str:
    """Ours' seconds at ``threads``, the built-in's time over them, and any
    wrong verdicts."""
    o = summary.get(f"ours/{threads}", {}).get(case)
    b = summary.get("builtin", {}).get(case)
    if not o:
        return "-"
    cell = f"{o['s']:.3f}"
    if b and o["s"]:
        cell += f" ({b['s'] / o['s']:.1f}×)"
    if o["wrong"]:
        cell += f" {o['wrong']} wrong"
    return cell


def _round_trips_table(sweep: list[dict]) -> list[str]:
    lines = [
        "",
        "### Round trips per check (single checks on one thread, nothing cached: "
        "(ms per check - the same at delay 0) / delay; and the brick's file operations)",
        "",
        "| delay µs | check | hit ms | hit round trips | hit fops | miss ms "
        "| miss round trips | miss fops |",
        "|---:|---|---:|---:|---|---:|---:|---|",
    ]
    for d in sweep:
        for tool, cases in d["lookup"]["single"].items():
            cells: list[str] = []
            for case in CASES:
                c = cases[case]
                cells += [
                    f"{c['per_check_s'] * 1e3:.3f}",
                    fmt(c.get("round_trips"), ".2f"),
                    fops_cell(c.get("fops_per_check"), at_least=0.05),
                ]
            lines.append(f"| {d['us']} | {tool} | " + " | ".join(cells) + " |")
    return lines
