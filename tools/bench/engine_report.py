"""tools/bench/engine.py's tables: the medians of every configuration, and
ours / vLLM's built-in at its best thread count (per direction, case,
stand-in and state) from the same rounds, and with several roots the
aggregate GB/s against one root."""

from __future__ import annotations

__all__ = ["print_report", "ratios", "root_scaling"]

DIRECTIONS = ("store", "load")


def ratios(configs: list[dict], medians: dict[str, dict]) -> list[dict]:
    """For each of our configurations: its store and load GB/s over the
    built-in's best of the thread counts measured beside it (same stand-in
    setting, same state), naming that count. Empty without built-in runs."""
    out = []
    for ours in configs:
        if ours["mode"] == "builtin":
            continue
        peers = [
            c
            for c in configs
            if c["mode"] == "builtin"
            and c["standin"] == ours["standin"]
            and c["steady"] == ours["steady"]
        ]
        if not peers:
            continue
        entry = {"ours": ours["label"]}
        for d in ("store", "load"):
            best = max(peers, key=lambda c: medians[c["label"]][f"{d}_gbps"])
            theirs = medians[best["label"]]
            entry[d] = medians[ours["label"]][f"{d}_gbps"] / theirs[f"{d}_gbps"]
            entry[f"{d}_builtin"] = best["label"]
            entry[f"{d}_builtin_gbps"] = theirs[f"{d}_gbps"]
            entry[f"{d}_builtin_standin"] = theirs[f"{d}_standin_ratio"]
        out.append(entry)
    return out


def _one_root_peer(config: dict, row: dict, rows: list[dict]) -> tuple[str, dict] | None:
    """Ours on the first root alone for ``config`` in ``row``: the same
    configuration with roots=1 in the row (--root-sets), else the same label
    in a row of the first root alone, same case and per side (--dir a --dir a,b)."""
    if config.get("roots"):
        label = f"{config['base']}/roots=1"
        return (label, row["configs"][label]) if label in row["configs"] else None
    for other in rows:
        if (
            other["roots"] == row["roots"][:1]
            and other["case"]["name"] == row["case"]["name"]
            and other["per_side"] == row["per_side"]
            and config["label"] in other["configs"]
        ):
            return other["medium"], other["configs"][config["label"]]
    return None


def root_scaling(configs: list[dict], rows: list[dict]) -> None:
    """Sets row["scaling"]: for each of our configurations on several roots
    (and its one-root peer), the aggregate GB/s, ours / the built-in (on the
    first root, its best thread count, same rounds) and ours / ours on the
    first root alone."""
    for row in rows:
        row["scaling"] = []
        by_label = {e["ours"]: e for e in row["ratios"]}
        for config in configs:
            if config["mode"] == "builtin":
                continue
            n_roots = config.get("roots") or len(row["roots"])
            if len(row["roots"]) == 1 and not config.get("roots"):
                continue  # a one-root medium: the ordinary tables say it all
            m = row["configs"][config["label"]]
            entry: dict = {"ours": config["label"], "n_roots": n_roots}
            for d in DIRECTIONS:
                entry[f"{d}_gbps"] = m[f"{d}_gbps"]
                builtin = by_label.get(config["label"])
                entry[f"{d}_vs_builtin"] = builtin[d] if builtin else None
            entry["root_store_blocks"] = m["root_store_blocks"]
            peer = _one_root_peer(config, row, rows)
            entry["one_root"] = peer[0] if peer else None
            for d in DIRECTIONS:
                entry[f"{d}_vs_one_root"] = m[f"{d}_gbps"] / peer[1][f"{d}_gbps"] if peer else None
            row["scaling"].append(entry)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _print_scaling(rows: list[dict]) -> None:
    if not any(r.get("scaling") for r in rows):
        return
    print(
        "\nseveral roots: aggregate GB/s; ours / built-in (first root, best thread count, "
        "same rounds); ours / ours on the first root alone\n\n"
        "| medium | case | per side | ours | roots | store GB/s | load GB/s | store / built-in "
        "| load / built-in | store / 1 root | load / 1 root | blocks stored per root |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for e in r.get("scaling", []):
            print(
                f"| {r['medium']} | {r['case']['name']} | {r['per_side']} | {e['ours']} | "
                f"{e['n_roots']} | {e['store_gbps']:.2f} | {e['load_gbps']:.2f} | "
                f"{_x(e['store_vs_builtin'])} | {_x(e['load_vs_builtin'])} | "
                f"{_x(e['store_vs_one_root'])} | {_x(e['load_vs_one_root'])} | "
                + " / ".join(str(b) for b in e["root_store_blocks"])
                + " |"
            )


def _standin_cell(m: dict) -> str:
    if not m["store_standin_ratio"]:
        return "-"
    return f"{m['store_standin_ratio']:.2f} / {m['load_standin_ratio']:.2f}"


def print_report(args, rows: list[dict], idle_rate: float) -> None:
    print(
        f"\n{args.block_mib:g} MiB blocks; cases: "
        + ", ".join(
            f"{r['case']['name']} = {r['case']['blocks']} blocks in jobs of {r['case']['per_job']}"
            for r in rows[: len(args.case)]
        )
        + f"; median of {args.rounds}; checksum={args.checksum} durability={args.durability}; "
        f"stand-in idle rate {idle_rate:.0f}/s\n"
    )
    print(
        "| medium | case | per side | configuration | store GB/s | load GB/s | owner us/block "
        "store/load | stand-in store/load vs idle | PTE kB | O_DIRECT |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['medium']} | {r['case']['name']} | {r['per_side']}"
        for label, m in r["configs"].items():
            print(
                f"{head} | {label} | {m['store_gbps']:.2f} | {m['load_gbps']:.2f} | "
                f"{m['store_owner_us']:.1f} / {m['load_owner_us']:.1f} | {_standin_cell(m)} | "
                f"{m['worker_pte_kib']:.0f} | {m['o_direct']} |"
            )
        if r["reference"]:
            ref = r["reference"]
            print(
                f"{head} | C reference | {ref['store_gbps']:.2f} | {ref['load_gbps']:.2f} "
                "| - | - | - | - |"
            )
    if any(r["ratios"] for r in rows):
        print(
            "\nours / built-in at its best thread count (same rounds)\n\n"
            "| medium | case | per side | ours | store ratio (built-in best) | "
            "load ratio (built-in best) | built-in stand-in store/load |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            for e in r["ratios"]:
                print(
                    f"| {r['medium']} | {r['case']['name']} | {r['per_side']} | {e['ours']} | "
                    f"**{e['store']:.2f}** ({e['store_builtin']} {e['store_builtin_gbps']:.2f}) | "
                    f"**{e['load']:.2f}** ({e['load_builtin']} {e['load_builtin_gbps']:.2f}) | "
                    + (
                        f"{e['store_builtin_standin']:.2f} / {e['load_builtin_standin']:.2f} |"
                        if e["store_builtin_standin"]
                        else "- |"
                    )
                )
    _print_scaling(rows)
