"""tools/bench_engine.py's tables: the medians of every configuration, and
ours / vLLM's built-in at its best thread count (per direction, case,
stand-in and state) from the same rounds."""

from __future__ import annotations

__all__ = ["print_report", "ratios"]


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
