"""Plot aggregate GB/s against the number of roots from
``tools/bench_engine.py`` JSON files with several roots (issue 19): one bar
group per labelled run and case, one bar per root count (ours), the
built-in's best thread count on one root marked as a black line over the
group, store and load side by side.

    python tools/bench_engine_roots_plot.py --out docs/bench/device/issue19_roots.png \\
        --run "tmpfs=docs/bench/device/issue19_roots_tmpfs.json" \\
        --run "loop ext4=docs/bench/device/issue19_roots_loopext4_long.json"

A run's points come from its rows' ``scaling`` entries (``--root-sets``, or
media given as comma lists) and, for one root, from the row of the first
``--dir`` alone. Needs matplotlib (vLLM installs it).
"""

from __future__ import annotations

import argparse
import json
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Points = dict[int, tuple[float, float]]  # roots -> (store, load) GB/s


def _builtin_best(row: dict) -> tuple[float, float]:
    theirs = [m for label, m in row["configs"].items() if label.startswith("builtin/")]
    return (
        max((m["store_gbps"] for m in theirs), default=0.0),
        max((m["load_gbps"] for m in theirs), default=0.0),
    )


def load_run(spec: str) -> tuple[str, dict[str, tuple[Points, tuple[float, float]]]]:
    """LABEL=FILE -> label, {case: (ours by root count, built-in best on one root)}."""
    label, _, path = spec.partition("=")
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    first = rows[0]["roots"][0]
    out: dict[str, tuple[Points, tuple[float, float]]] = {}
    for row in rows:
        points, builtin = out.setdefault(row["case"]["name"], ({}, (0.0, 0.0)))
        if row["roots"] == [first]:  # ours and the built-in on the first root alone
            ours = [m for k, m in row["configs"].items() if not k.startswith("builtin/")]
            points[1] = (ours[0]["store_gbps"], ours[0]["load_gbps"])
            builtin = _builtin_best(row)
        for e in row.get("scaling", []):
            points[e["n_roots"]] = (e["store_gbps"], e["load_gbps"])
            if e["n_roots"] == 1:
                builtin = _builtin_best(row)
        out[row["case"]["name"]] = (points, builtin)
    return label, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="LABEL=FILE")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="aggregate GB/s against roots (ours), built-in on one root")
    args = p.parse_args()
    groups = []  # (group label, points, built-in best)
    for spec in args.run:
        label, cases = load_run(spec)
        for case, (points, builtin) in cases.items():
            groups.append((textwrap.fill(label, 16) + f"\n{case}", points, builtin))
    counts = sorted({n for _g, points, _b in groups for n in points})
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(counts)
    for ax, (direction, index) in zip(axes, (("store", 0), ("load", 1))):
        for i, n in enumerate(counts):
            xs = [g + i * width for g in range(len(groups))]
            ys = [points.get(n, (0.0, 0.0))[index] for _g, points, _b in groups]
            bars = ax.bar(xs, ys, width, label=f"ours, {n} root{'s' if n > 1 else ''}")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        for g, (_label, _points, builtin) in enumerate(groups):
            ax.hlines(
                builtin[index],
                g - width / 2,
                g + width * (len(counts) - 0.5),
                colors="black",
                linewidth=1.5,
                label="built-in, 1 root (best threads)" if g == 0 else None,
            )
        ax.set_xticks([g + width * (len(counts) - 1) / 2 for g in range(len(groups))])
        ax.set_xticklabels([label for label, _p, _b in groups], fontsize=8)
        ax.set_title(direction)
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: {len(groups)} groups, root counts {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
