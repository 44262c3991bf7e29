"""The report of tools/bench/lookup.py (pure: figures in, figures or text
out): the medians of every configuration's rounds, the built-in's time over
ours, single checks in round trips to the server, and the markdown tables of
one run's JSON. tools/bench/latency_report.py's tables reuse its cells."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

CASES = ("hit", "miss")


# -- arithmetic ----------------------------------------------------------------------------


def round_trips(per_check_s: float, delay_us: float, base_s: float | None = None) -> float | None:
    """A check's round trips to the server: its time less the same check
    on the undelayed volume (``base_s``; none given: nothing subtracted),
    over the delay added to each file operation. None without a delay."""
    if delay_us <= 0:
        return None
    return (per_check_s - (base_s or 0.0)) / (delay_us / 1e6)


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    """Per configuration and case: the median seconds and steps, and every
    wrong or expired verdict of any round."""
    out: dict[str, dict[str, dict]] = {}
    for label, cases in runs.items():
        out[label] = {}
        for case, rs in cases.items():
            out[label][case] = {
                "s": median_or_none([r["s"] for r in rs]),
                "steps": median_or_none([r["steps"] for r in rs if r.get("steps") is not None]),
                "sched_cpu_s": median_or_none(
                    [r["sched_cpu_s"] for r in rs if r.get("sched_cpu_s") is not None]
                ),
                "wrong": sum(r["wrong"] for r in rs),
                "expired": sum(r.get("expired", 0) for r in rs),
                "samples": [r["s"] for r in rs],
            }
    return out


def speedups(summary: dict[str, dict[str, dict]], threads: Sequence[int]) -> dict[str, dict]:
    """The built-in's time over ours, per lookup_threads and case (>1: ours faster)."""
    builtin = summary.get("builtin")
    out: dict[str, dict] = {}
    if not builtin:
        return out
    for t in threads:
        ours = summary.get(f"ours/{t}")
        if not ours:
            continue
        out[str(t)] = {
            case: builtin[case]["s"] / ours[case]["s"]
            for case in CASES
            if ours[case]["s"] and builtin[case]["s"]
        }
    return out


def single_rows(single: dict, delay_us: float, base: dict | None) -> dict[str, dict[str, dict]]:
    """Per tool and case: ms per check, round trips, server fops per check."""
    rows: dict[str, dict[str, dict]] = {}
    for tool, cases in single.items():
        rows[tool] = {}
        for case, got in cases.items():
            base_s = ((base or {}).get(tool) or {}).get(case, {}).get("per_check_s")
            rows[tool][case] = {
                "per_check_s": got["per_check_s"],
                "round_trips": round_trips(got["per_check_s"], delay_us, base_s),
                "base_per_check_s": base_s,
                "fops_per_check": got.get("fops_per_check"),
            }
    return rows


# -- cells ---------------------------------------------------------------------------------


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``; "-" for a figure not measured."""
    return "-" if value is None else format(value, spec)


def fops_cell(fops: dict[str, float] | None, at_least: float = -math.inf) -> str:
    """File operations per call, ``LOOKUP 1.00, READ 2.00`` (those under
    ``at_least`` left out); "-" for none."""
    return (
        ", ".join(f"{k} {v:.2f}" for k, v in sorted((fops or {}).items()) if v >= at_least) or "-"
    )


# -- the tables ----------------------------------------------------------------------------


def render(result: dict) -> str:
    """The tables of one run (its JSON) as text (markdown tables)."""
    lines = _configurations_table(result) + _speedups_table(result) + _single_table(result)
    return "\n".join(lines) + "\n"


def _configurations_table(result: dict) -> list[str]:
    a = result["args"]
    lines = [
        f"### Lookup of one prompt of {a['keys']} blocks, delay {a['delay_us']:g} µs per file "
        f"operation (median of {a['rounds']} rounds; written through {a['dir']}, checked "
        f"through {a['check_dir']}; a scheduler step every {a.get('step_ms', 1.0):g} ms; "
        "sched ms: the stepping thread's CPU in lookups and ends of steps)",
        "",
        "| configuration | all hits s | steps | sched ms | all misses s | steps | sched ms "
        "| wrong | expired |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, cases in result["summary"].items():
        hit, miss = cases["hit"], cases["miss"]
        lines.append(
            f"| {label} | {fmt(hit['s'], '.3f')} | {fmt(hit['steps'], '.0f')} | "
            f"{_ms(hit.get('sched_cpu_s'))} | {fmt(miss['s'], '.3f')} | "
            f"{fmt(miss['steps'], '.0f')} | {_ms(miss.get('sched_cpu_s'))} | "
            f"{hit['wrong'] + miss['wrong']} | {hit['expired'] + miss['expired']} |"
        )
    return lines


def _ms(seconds: float | None) -> str:
    return fmt(None if seconds is None else seconds * 1e3, ".1f")


def _speedups_table(result: dict) -> list[str]:
    if not result.get("speedups"):
        return []
    lines = ["", "| lookup_threads | built-in / ours, hits | built-in / ours, misses |"]
    lines.append("|---:|---:|---:|")
    for t, r in result["speedups"].items():
        lines.append(f"| {t} | {fmt(r.get('hit'), '.2f')} | {fmt(r.get('miss'), '.2f')} |")
    return lines


def _single_table(result: dict) -> list[str]:
    if not result.get("single"):
        return []
    lines = [
        "",
        f"Single checks ({result['args']['single_keys']} one after the other on one thread, "
        "nothing cached): ms per check; round trips = (that - the same at delay 0) / delay; the "
        "brick's file operations per check",
        "",
        "| check | hit ms | hit round trips | hit fops | miss ms | miss round trips | miss fops |",
        "|---|---:|---:|---|---:|---:|---|",
    ]
    for tool, cases in result["single"].items():
        cells = []
        for case in CASES:
            c = cases.get(case, {})
            cells += [
                fmt(c.get("per_check_s") and c["per_check_s"] * 1e3, ".3f"),
                fmt(c.get("round_trips"), ".2f"),
                fops_cell(c.get("fops_per_check")),
            ]
        lines.append(f"| {tool} | " + " | ".join(cells) + " |")
    return lines
