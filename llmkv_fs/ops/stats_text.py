"""``llmkv-fs stats`` for people: the report of ops.stats.volume_stats as a
table of digests, then a section per digest and the volume's totals."""

from __future__ import annotations

from typing import Any, TextIO

from llmkv_fs.ops.problems import problem_lines, shorten
from llmkv_fs.units import format_bytes, format_duration

__all__ = ["print_report"]


def print_report(report: dict[str, Any], out: TextIO, other_listed: int) -> None:
    """``other_listed``: how many unexpected entries per digest --json lists."""
    print(f"volume {report['root']}", file=out)
    _print_overview(report["digests"], out)
    for p in report["digests"]:
        _print_digest(p, out, other_listed)
    _print_volume(report, out)


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)


def _print_overview(digests: list[dict[str, Any]], out: TextIO) -> None:
    rows = [
        ["DIGEST", "MODEL", "RANKS", "BLOCKS", "BYTES", "LIVE", "STALE", "TEMP", "QUAR", "OTHER"]
    ]
    for p in digests:
        rows.append(
            [
                p["name"],
                str(p["model"]),
                " ".join(f"r{r}" for r in p["ranks"]) or "-",
                str(p["blocks"]),
                format_bytes(p["bytes"]),
                str(len(p["leases"]["live"])),
                str(len(p["leases"]["stale"])),
                str(p["temp"]["count"]),
                str(p["quarantined"]["count"]),
                str(p["other"]["count"]),
            ]
        )
    _table(rows, out)


def _print_digest(p: dict[str, Any], out: TextIO, other_listed: int) -> None:
    print(f"\n{p['name']}", file=out)
    for w in p["warnings"]:
        print(f"  !!! {w}", file=out)
    _print_config(p, out)
    _print_blocks(p, out)
    _print_leases(p, out)
    _print_leftovers(p, out, other_listed)


def _print_config(p: dict[str, Any], out: TextIO) -> None:
    c = p["config"]
    if c is None:
        print("  config     (no readable config.json)", file=out)
    else:
        groups = c.get("kv_cache_groups") or []
        fields = " ".join(
            f"{k}={v}" for k, v in c.items() if k not in ("model_name", "kv_cache_groups")
        )
        gtxt = ", ".join(
            f"{g['tokens_per_block']} tok/block x {g['layers']} layers" for g in groups
        )
        print(f"  config     {fields}", file=out)
        print(f"  kv groups  {len(groups)}: {gtxt}", file=out)
    source = {"trailer": "a trailer"}.get(p["chunk_source"], p["chunk_source"])
    chunk = (
        (f"{format_bytes(p['chunk_bytes'])} payload ({p['chunk_bytes']} B, from {source})")
        if p["chunk_bytes"]
        else source
    )
    print(f"  chunk      {chunk}", file=out)


def _print_blocks(p: dict[str, Any], out: TextIO) -> None:
    per_rank = ", ".join(
        f"r{r}: {v['blocks']} / {format_bytes(v['bytes'])}" for r, v in p["ranks"].items()
    )
    print(
        f"  blocks     {p['blocks']} files, {format_bytes(p['bytes'])}"
        f"{'  (' + per_rank + ')' if len(p['ranks']) > 1 else ''}",
        file=out,
    )
    if p["sealing"]:
        bad = ", ".join(f"{k} {n}" for k, n in p["not_sealed"].items())
        print(
            f"  sealed     {p['sealed_blocks']} blocks ({p['sealing']})"
            f"{'; not sealed: ' + bad if bad else ''}",
            file=out,
        )
    lu = p["last_used"]
    hist = "  ".join(f"{b} {n}" for b, n in lu["buckets"].items())
    print(
        f"  last used  {hist}   oldest {format_duration(lu['oldest_age_s'])} ago, "
        f"newest {format_duration(lu['newest_age_s'])} ago",
        file=out,
    )


def _print_leases(p: dict[str, Any], out: TextIO) -> None:
    live, stale, bad = p["leases"]["live"], p["leases"]["stale"], p["leases"]["bad"]
    print(f"  leases     {len(live)} live, {len(stale)} stale, {len(bad)} bad", file=out)
    if p["leases"]["error"]:
        print(f"  !!! leases/ cannot be read: {p['leases']['error']}", file=out)
    for x in bad:
        print(f"    bad   {x['path']}: {x['why']}", file=out)
    for state, leases in (("live", live), ("stale", stale)):
        for x in leases:
            print(
                f"    {state:<5} {x['host']} pid {x['pid']}  vllm {x['vllm_version'] or '?'}"
                f"  llmkv_fs {x['llmkv_fs_version'] or '?'}  {x['hash_algo']} seed "
                f"{x['seed_fingerprint']}  "
                f"heartbeat {format_duration(x['heartbeat_age_s'])} ago",
                file=out,
            )
    if p["seed_fingerprints"]:
        print(f"  seeds      {', '.join(p['seed_fingerprints'])}", file=out)


def _print_leftovers(p: dict[str, Any], out: TextIO, other_listed: int) -> None:
    t = p["temp"]
    print(
        f"  temp       {t['count']} files, {format_bytes(t['bytes'])}"
        f"{', oldest ' + format_duration(t['oldest_age_s']) + ' old' if t['count'] else ''}",
        file=out,
    )
    q = p["quarantined"]
    reasons = ", ".join(f"{k} {n}" for k, n in q["reasons"].items())
    print(
        f"  quarantine {q['count']} files, {format_bytes(q['bytes'])}"
        f"{' (' + reasons + ')' if reasons else ''}",
        file=out,
    )
    for u in p["unreadable_dirs"]:
        print(f"  !!! cannot list {shorten(u['path'])}: {u['detail']}", file=out)
    s = p["nfs_silly_renamed"]
    if s["count"]:
        print(
            f"  nfs open   {s['count']} .nfs files ({format_bytes(s['bytes'])}): removed "
            "blocks an NFS client still has open; it frees them at close",
            file=out,
        )
    o = p["other"]
    print(f"  other      {o['count']} unexpected entries", file=out)
    for e in o["entries"][:10]:
        print(f"    {e['type']:<10} {e['path']}", file=out)
    if o["count"] > 10:
        print(f"    ... and {o['count'] - 10} more (--json lists {other_listed})", file=out)


def _print_volume(report: dict[str, Any], out: TextIO) -> None:
    if report["unexpected"]:
        print(f"\nunexpected in root: {len(report['unexpected'])}", file=out)
        for e in report["unexpected"][:20]:
            print(f"  {e['type']:<10} {e['path']}", file=out)
    if report["gc_trash"]:
        print(f"\ngc trash (being deleted): {len(report['gc_trash'])}", file=out)
    t, fs = report["totals"], report["filesystem"]
    print(
        f"\ntotal      {t['digests']} digests, {t['blocks']} blocks, {format_bytes(t['bytes'])}; "
        f"{t['temp_files']} temp ({format_bytes(t['temp_bytes'])}), {t['quarantined_files']} "
        f"quarantined ({format_bytes(t['quarantined_bytes'])}), {t['other']} other; "
        f"leases {t['live_leases']} live, {t['stale_leases']} stale",
        file=out,
    )
    inode_pct = (100.0 * (fs["inodes"] - fs["inodes_free"]) / fs["inodes"]) if fs["inodes"] else 0.0
    print(
        f"filesystem {format_bytes(fs['size_bytes'])} size, {format_bytes(fs['used_bytes'])} used "
        f"({fs['used_percent']:.1f}%, as df and gc count it), "
        f"{format_bytes(fs['available_bytes'])} available; "
        f"inodes {inode_pct:.0f}% used",
        file=out,
    )
    for w in report["warnings"]:
        print(f"!!! {w}", file=out)
    if report["problems"]:
        print(f"could not be read (skipped): {t['problems']}", file=out)
        for line in problem_lines(report["problems"]):
            print(line, file=out)
