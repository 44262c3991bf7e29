"""What is on a cache volume, per digest: run config, rank directories,
blocks and bytes, how recently blocks were used, the tiers holding leases
(and whether they hash blocks alike), temp files, quarantined files and
anything unexpected. Reads metadata only (plus at most a few trailer pages
per digest to tell the chunk size); never changes the volume.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import stat
import sys
import time
from typing import Any

from llmkv_fs.layout.blockfile import TRAILER_SIZE, last_used
from llmkv_fs.layout.fsinfo import volume_usage
from llmkv_fs.layout.leases import Lease
from llmkv_fs.layout.names import in_quarantine, is_block_name, parse_quarantine_name
from llmkv_fs.layout.paths import run_config_digest
from llmkv_fs.ops import scan
from llmkv_fs.ops.blockcheck import infer_chunk_size
from llmkv_fs.units import format_bytes, format_duration

__all__ = ["add_arguments", "run", "select_digests", "volume_stats"]

# Upper bounds (seconds) of the last-used buckets; the last one is open.
AGE_BUCKETS = (("<1h", 3600), ("<1d", 86400), ("<7d", 7 * 86400), ("older", None))
_OTHER_LISTED = 100  # unexpected entries listed per digest (all are counted)
_SEED_WARNING = "replicas will not share cache"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="cache root directory (the tier's root_dir)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--threads", type=int, default=8, metavar="N", help="parallel directory listers (default 8)"
    )
    parser.add_argument(
        "--digest",
        action="append",
        metavar="NAME",
        help="only this digest (directory name or 12-hex digest); repeatable",
    )


def select_digests(
    root: str, names: list[str] | None, listing: scan.RootListing | None = None
) -> list[scan.Digest]:
    """Every digest under ``root``, or those named (by directory name or
    12-hex digest). LookupError names a NAME that matches nothing."""
    digests = (listing or scan.list_root(root)).digests
    if not names:
        return digests
    chosen = []
    for name in names:
        hits = [d for d in digests if name in (d.name, d.digest)]
        if not hits:
            raise LookupError(f"no digest {name!r} under {root}")
        chosen.extend(h for h in hits if h not in chosen)
    return sorted(chosen, key=lambda d: d.name)


def _config_summary(config: dict | None) -> dict[str, Any] | None:
    if config is None:
        return None
    summary = {k: v for k, v in config.items() if k != "kv_cache_groups"}
    groups = config.get("kv_cache_groups")
    if isinstance(groups, list):
        summary["kv_cache_groups"] = [
            {
                "tokens_per_block": g.get("tokens_per_block"),
                "layers": len(g.get("layer_names") or []),
            }
            for g in groups
            if isinstance(g, dict)
        ]
    return summary


def _config_digest_ok(d: scan.Digest, config: dict | None) -> bool | None:
    if config is None:
        return None
    try:
        return run_config_digest(config) == d.digest
    except (TypeError, ValueError):  # not JSON-serialisable back: not vLLM's
        return False


def _lease_json(lease: Lease, now: float) -> dict[str, Any]:
    return {
        "host": lease.host,
        "pid": lease.pid,
        "started_ns": lease.started_ns,
        "vllm_version": lease.vllm_version,
        "llmkv_fs_version": lease.llmkv_fs_version,
        "hash_algo": lease.hash_algo,
        "seed_fingerprint": lease.seed_fingerprint,
        "heartbeat_age_s": round(now - lease.refreshed, 3),
        "path": lease.path,
    }


def _entry_type(st: os.stat_result) -> str:
    mode = st.st_mode
    for test, name in (
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "char-device"),
        (stat.S_ISBLK, "block-device"),
        (stat.S_ISDIR, "directory"),
    ):
        if test(mode):
            return name
    return "file"


def _quarantine_reason(name: str) -> str:
    parsed = parse_quarantine_name(name)
    return parsed.reason if parsed is not None else "unknown"


def _digest_stats(d: scan.Digest, now: float, this_host: str, threads: int) -> dict[str, Any]:
    config = d.read_config()
    buckets = collections.Counter()
    oldest = newest = None
    sizes: collections.Counter = collections.Counter()
    probe: list[tuple[str, int]] = []
    temp = {"count": 0, "bytes": 0, "oldest_mtime": None}
    quarantined = {"count": 0, "bytes": 0, "reasons": collections.Counter()}
    other: list[dict[str, str]] = []
    other_count = 0
    silly = {"count": 0, "bytes": 0}
    unreadable: list[dict[str, str]] = []
    ranks = {rank: {"blocks": 0, "bytes": 0} for rank in sorted(d.rank_dirs)}
    tops: list[tuple[str, str]] = [(d.rank_dirs[r], scan.RANK_AREA) for r in ranks]
    top_rank = list(ranks)
    if d.has_config_dir:
        tops.append((d.config_dir, scan.CONFIG_AREA))
    for listing in scan.walk(tops, threads):
        if listing.error is not None:
            unreadable.append({"path": listing.path, "detail": str(listing.error)})
        top_dir, area = tops[listing.top]
        quarantined_here = area == scan.RANK_AREA and in_quarantine(top_dir, listing.path)
        for e in listing.files:
            name = os.path.basename(e.path)
            if quarantined_here:  # whatever it is: the tiers or verify put it there
                quarantined["count"] += 1
                quarantined["bytes"] += e.st.st_size
                quarantined["reasons"][_quarantine_reason(name)] += 1
            elif e.kind == scan.BLOCK and stat.S_ISREG(e.st.st_mode) and is_block_name(name):
                r = ranks[top_rank[listing.top]]
                r["blocks"] += 1
                r["bytes"] += e.st.st_size
                sizes[e.st.st_size] += 1
                if sizes[e.st.st_size] <= 3:
                    probe.append((e.path, e.st.st_size))
                used = last_used(e.st)
                oldest = used if oldest is None else min(oldest, used)
                newest = used if newest is None else max(newest, used)
                age = now - used
                buckets[next(b for b, limit in AGE_BUCKETS if limit is None or age < limit)] += 1
            elif e.kind == scan.TEMP:
                temp["count"] += 1
                temp["bytes"] += e.st.st_size
                if temp["oldest_mtime"] is None or e.st.st_mtime < temp["oldest_mtime"]:
                    temp["oldest_mtime"] = e.st.st_mtime
            elif e.kind == scan.SILLY_RENAMED:
                silly["count"] += 1
                silly["bytes"] += e.st.st_size
            elif e.kind in (scan.CONFIG, scan.LEASE):
                continue
            else:  # OTHER, SYMLINK, and any kind scan may add later
                other_count += 1
                if len(other) < _OTHER_LISTED:
                    other.append({"path": e.path, "type": _entry_type(e.st)})
    chunk = infer_chunk_size(probe)
    leases = d.leases()
    live, stale = [], []
    for lease in leases:
        (live if lease.is_live(now, this_host) else stale).append(lease)
    fingerprints = sorted({lease.seed_fingerprint for lease in live})
    warnings = []
    if len(fingerprints) > 1:
        warnings.append(
            f"WARNING: {len(live)} live replicas of {d.name} hash blocks with "
            f"{len(fingerprints)} different seeds ({', '.join(fingerprints)}): {_SEED_WARNING} "
            "(set the same PYTHONHASHSEED and prefix-cache hash algorithm everywhere)"
        )
    elif any(fp.startswith("random-") for fp in fingerprints):
        warnings.append(
            f"WARNING: a live replica of {d.name} hashes with a random per-process seed: "
            f"{_SEED_WARNING} (set PYTHONHASHSEED)"
        )
    if _config_digest_ok(d, config) is False:
        warnings.append(f"WARNING: {d.name}/config.json does not hash to digest {d.digest}")
    blocks = sum(r["blocks"] for r in ranks.values())
    return {
        "name": d.name,
        "digest": d.digest,
        "model": (config or {}).get("model_name", d.model),
        "has_config": config is not None,
        "config": _config_summary(config),
        "config_digest_ok": _config_digest_ok(d, config),
        "ranks": {str(k): v for k, v in ranks.items()},
        "blocks": blocks,
        "bytes": sum(r["bytes"] for r in ranks.values()),
        "chunk_bytes": chunk.payload,
        "chunk_source": chunk.source,
        "trailer_bytes": TRAILER_SIZE if chunk.source == "trailer" else None,
        "file_sizes": {str(s): n for s, n in sizes.most_common(5)},
        "last_used": {
            "buckets": {b: buckets.get(b, 0) for b, _ in AGE_BUCKETS},
            "oldest": oldest,
            "newest": newest,
            "oldest_age_s": None if oldest is None else round(now - oldest, 3),
            "newest_age_s": None if newest is None else round(now - newest, 3),
        },
        "leases": {
            "live": [_lease_json(x, now) for x in live],
            "stale": [_lease_json(x, now) for x in stale],
        },
        "seed_fingerprints": fingerprints,
        "seed_mismatch": len(fingerprints) > 1,
        "temp": {
            **temp,
            "oldest_age_s": None
            if temp["oldest_mtime"] is None
            else round(now - temp["oldest_mtime"], 3),
        },
        "quarantined": {**quarantined, "reasons": dict(sorted(quarantined["reasons"].items()))},
        "other": {"count": other_count, "entries": sorted(other, key=lambda e: e["path"])},
        "nfs_silly_renamed": silly,
        "unreadable_dirs": unreadable,
        "warnings": warnings,
    }


def _unexpected_in_root(listing: scan.RootListing) -> list[dict[str, str]]:
    out = []
    for path in listing.symlinks + listing.other:
        try:
            out.append({"path": path, "type": _entry_type(os.lstat(path))})
        except FileNotFoundError:
            continue
    return sorted(out, key=lambda e: e["path"])


def _statvfs(root: str) -> dict[str, int]:
    usage = volume_usage(root)
    # free_bytes counts the root reserve too (f_bfree); available_bytes does not.
    return {
        "size_bytes": usage.total_bytes,
        "free_bytes": usage.total_bytes - usage.used_bytes,
        "available_bytes": usage.free_bytes,
        "used_bytes": usage.used_bytes,
        "inodes": usage.inodes,
        "inodes_free": usage.inodes_free,
    }


def volume_stats(
    root: str, threads: int = 8, digest_names: list[str] | None = None, now: float | None = None
) -> dict[str, Any]:
    now = time.time() if now is None else now
    this_host = socket.gethostname()
    listing = scan.list_root(root)
    digests = select_digests(root, digest_names, listing)
    per = [_digest_stats(d, now, this_host, max(1, threads)) for d in digests]
    totals = {
        "digests": len(per),
        **{k: sum(p[k] for p in per) for k in ("blocks", "bytes")},
        "temp_files": sum(p["temp"]["count"] for p in per),
        "temp_bytes": sum(p["temp"]["bytes"] for p in per),
        "quarantined_files": sum(p["quarantined"]["count"] for p in per),
        "quarantined_bytes": sum(p["quarantined"]["bytes"] for p in per),
        "other": sum(p["other"]["count"] for p in per),
        "nfs_silly_renamed": sum(p["nfs_silly_renamed"]["count"] for p in per),
        "live_leases": sum(len(p["leases"]["live"]) for p in per),
        "stale_leases": sum(len(p["leases"]["stale"]) for p in per),
    }
    return {
        "root": root,
        "time": now,
        "digests": per,
        "unexpected": [] if digest_names else _unexpected_in_root(listing),
        "gc_trash": [] if digest_names else listing.trash,
        "totals": totals,
        "filesystem": _statvfs(root),
        "warnings": [w for p in per for w in p["warnings"]],
    }


def _table(rows: list[list[str]], out) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)


def _print_human(report: dict[str, Any], out) -> None:
    print(f"volume {report['root']}", file=out)
    rows = [
        ["DIGEST", "MODEL", "RANKS", "BLOCKS", "BYTES", "LIVE", "STALE", "TEMP", "QUAR", "OTHER"]
    ]
    for p in report["digests"]:
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
    for p in report["digests"]:
        print(f"\n{p['name']}", file=out)
        for w in p["warnings"]:
            print(f"  !!! {w}", file=out)
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
        per_rank = ", ".join(
            f"r{r}: {v['blocks']} / {format_bytes(v['bytes'])}" for r, v in p["ranks"].items()
        )
        print(
            f"  blocks     {p['blocks']} files, {format_bytes(p['bytes'])}"
            f"{'  (' + per_rank + ')' if len(p['ranks']) > 1 else ''}",
            file=out,
        )
        lu = p["last_used"]
        hist = "  ".join(f"{b} {n}" for b, n in lu["buckets"].items())
        print(
            f"  last used  {hist}   oldest {format_duration(lu['oldest_age_s'])} ago, "
            f"newest {format_duration(lu['newest_age_s'])} ago",
            file=out,
        )
        live, stale = p["leases"]["live"], p["leases"]["stale"]
        print(f"  leases     {len(live)} live, {len(stale)} stale", file=out)
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
            print(f"  !!! cannot list {u['path']}: {u['detail']}", file=out)
        if p["nfs_silly_renamed"]["count"]:
            s = p["nfs_silly_renamed"]
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
            print(f"    ... and {o['count'] - 10} more (--json lists {_OTHER_LISTED})", file=out)
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
    used_pct = 100.0 * fs["used_bytes"] / fs["size_bytes"] if fs["size_bytes"] else 0.0
    inode_pct = (100.0 * (fs["inodes"] - fs["inodes_free"]) / fs["inodes"]) if fs["inodes"] else 0.0
    print(
        f"filesystem {format_bytes(fs['size_bytes'])} size, {format_bytes(fs['used_bytes'])} used "
        f"({used_pct:.0f}%), {format_bytes(fs['available_bytes'])} available; "
        f"inodes {inode_pct:.0f}% used",
        file=out,
    )
    for w in report["warnings"]:
        print(f"!!! {w}", file=out)


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.root):
        print(f"llmkv-fs stats: {args.root}: not a directory", file=sys.stderr)
        return 2
    try:
        report = volume_stats(args.root, args.threads, args.digest)
    except LookupError as exc:
        print(f"llmkv-fs stats: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=1, sort_keys=False)
        print()
    else:
        _print_human(report, sys.stdout)
    return 0
