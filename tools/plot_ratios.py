"""Plot ours / vLLM's built-in ratios from ``tools/bench_engine.py --builtin``
JSON files: one bar group per (case, state, stand-in), one bar per labelled
run of ours, store and load side by side, the 1.0 line marked.

    python tools/plot_ratios.py --out docs/bench/device/issue20_ratios.png \\
        --run "before=docs/bench/device/issue20_baseline_engine.json:workers/" \\
        --run "after=docs/bench/device/issue20_after_many_steady.json:workers[h256]"

Each ``--run LABEL=FILE[:PREFIX]`` takes the ratio rows of FILE whose
configuration starts with PREFIX (default: every row of ours); a label given
more than once gathers the rows of all its files, and a bar is then the
median of its files' ratios (each file one run). Needs
matplotlib (vLLM installs it).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def situation(config: str) -> str:
    """A configuration label's case-independent part: state and stand-in."""
    parts = [p for p in ("standin", "steady") if f"/{p}" in config]
    return "+".join(parts) or "idle, cold"


def load_run(spec: str) -> tuple[str, dict[tuple[str, str], tuple[float, float]]]:
    label, _, rest = spec.partition("=")
    path, _, prefix = rest.partition(":")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    found = {}
    for row in data["rows"]:
        case = row["case"]["name"] if isinstance(row["case"], dict) else row["case"]
        for ratio in row["ratios"]:
            if ratio["ours"].startswith(prefix or "workers"):
                found[case, situation(ratio["ours"])] = (ratio["store"], ratio["load"])
    return label, found


def _median_pair(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="LABEL=FILE[:PREFIX]")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="ours / vLLM built-in at its best thread count")
    args = p.parse_args()
    gathered: dict[str, dict[tuple[str, str], list[tuple[float, float]]]] = {}
    for spec in args.run:  # one label from several files: their rows together
        label, found = load_run(spec)
        for key, ratios in found.items():
            gathered.setdefault(label, {}).setdefault(key, []).append(ratios)
    runs = [
        (label, {key: _median_pair(pairs) for key, pairs in found.items()})
        for label, found in gathered.items()
    ]
    groups = sorted({key for _label, found in runs for key in found})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    width = 0.8 / len(runs)
    for ax, (direction, index) in zip(axes, (("store", 0), ("load", 1))):
        for i, (label, found) in enumerate(runs):
            xs = [g + i * width for g in range(len(groups))]
            ys = [found.get(key, (0.0, 0.0))[index] for key in groups]
            bars = ax.bar(xs, ys, width, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([g + width * (len(runs) - 1) / 2 for g in range(len(groups))])
        ax.set_xticklabels([re.sub(r"\+", "\n", f"{c}\n{s}") for c, s in groups], fontsize=8)
        ax.set_title(direction)
        ax.set_ylabel("ratio (log)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: {len(groups)} groups, {len(runs)} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
