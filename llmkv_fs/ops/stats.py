"""What is on a cache volume, per digest: run config, rank directories,
blocks and bytes, how recently blocks were used, the tiers holding leases
(and whether they hash blocks alike), temp files, quarantined files and
anything unexpected. Reads metadata only (plus at most a few trailer pages
per digest to tell the chunk size, and in a digest whose config.json names
a sealing scheme every block's trailer page: a block counts as sealed by
its own trailer, never by that unauthenticated file's word); never changes
the volume, never follows a symlink. What cannot be read is counted under
``problems`` and skipped.

Here the report is assembled (config, leases, warnings, totals, the
filesystem) and the command run; the walk that tallies a digest's files is
``ops/stats_walk.py``.

Several roots (a tier's root_dir list with path_sharding by_block_hash, or
several ROOT arguments): a report per root, then blocks and bytes per root
and in all.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from llmkv_fs.layout.blockfile import TRAILER_SIZE
from llmkv_fs.layout.paths import run_config_digest
from llmkv_fs.layout.sealed import NAMESPACE_FIELD
from llmkv_fs.ops import scan
from llmkv_fs.ops.blockcheck import SEALED, infer_chunk_size, sealed_trailer
from llmkv_fs.ops.per_root import (
    RootOutcome,
    add_root_argument,
    run_listed_roots,
    sum_totals,
)
from llmkv_fs.ops.problems import Problems
from llmkv_fs.ops.stats_text import print_report
from llmkv_fs.ops.stats_walk import AGE_BUCKETS, OTHER_LISTED, walk_digest
from llmkv_fs.units import format_bytes
from llmkv_fs.volume.files import file_type
from llmkv_fs.volume.fsinfo import volume_usage
from llmkv_fs.volume.leases import Lease, LeaseDir

__all__ = [
    "add_arguments",
    "add_digest_argument",
    "run",
    "seed_warnings",
    "select_digests",
    "volume_stats",
]

_SEED_WARNING = "replicas will not share cache"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_root_argument(parser, "cache root directory (the tier's root_dir)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    scan.add_threads_argument(parser)
    add_digest_argument(parser)


def add_digest_argument(parser: argparse.ArgumentParser) -> None:
    """``--digest NAME``: what ``select_digests`` chooses by (stats, verify)."""
    parser.add_argument(
        "--digest",
        action="append",
        metavar="NAME",
        help="only this digest (directory name or 12-hex digest); repeatable; with "
        "several roots it must be on each",
    )


def select_digests(
    root: str, names: list[str] | None, listing: scan.RootListing | None = None
) -> list[scan.Digest]:
    """Every digest under ``root``, or those named (by directory name or
    12-hex digest). LookupError names a NAME that matches nothing."""
    digests = (listing or scan.list_root(root)).digests
    if not names:
        return digests
    chosen: list[scan.Digest] = []
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


def _sealing(config: dict | None) -> str | None:
    """The sealing scheme a digest's config.json names (None: not sealed)."""
    scheme = (config or {}).get(NAMESPACE_FIELD)
    return scheme if isinstance(scheme, str) else None


def _sealed_trailers(
    blocks: list[tuple[str, str, int]], chunk: int | None, threads: int
) -> dict[str, Any]:
    """The report's ``sealed_blocks`` and ``not_sealed``: what a sealed
    namespace's block files are by their own trailers (one page each, read
    on ``threads`` threads), SEALED or why not."""
    if not chunk:  # no chunk size: every block file there is empty
        found = collections.Counter({"truncated": len(blocks)} if blocks else {})
    else:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="llmkv-stats") as pool:
            found = collections.Counter(
                pool.map(lambda b: sealed_trailer(b[0], b[1], b[2], chunk), blocks)
            )
    sealed = found.pop(SEALED, 0)
    return {"sealed_blocks": sealed, "not_sealed": dict(sorted(found.items()))}


def _config_digest_ok(d: scan.Digest, config: dict | None) -> bool | None:
    if config is None:
        return None
    try:
        return run_config_digest(config) == d.digest
    except (TypeError, ValueError):  # not JSON-serialisable back: not vLLM's
        return False


def lease_json(lease: Lease, now: float) -> dict[str, Any]:
    """A lease as the tools print it in --json (doctor adds its own fields)."""
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


def _warnings(
    d: scan.Digest,
    config: dict[str, Any] | None,
    live: list[Lease],
    fingerprints: list[str],
    not_sealed: int = 0,
) -> list[str]:
    warnings = []
    if not_sealed:
        warnings.append(
            f"WARNING: {not_sealed} block files of sealed {d.name} are not sealed blocks "
            "(a replica refuses them as bad): run llmkv-fs verify --repair"
        )
    warnings.extend(seed_warnings(d.name, len(live), fingerprints))
    if _config_digest_ok(d, config) is False:
        warnings.append(f"WARNING: {d.name}/config.json does not hash to digest {d.digest}")
    return warnings


def seed_warnings(name: str, live: int, fingerprints: list[str]) -> list[str]:
    """The warning when the ``live`` replicas of digest ``name`` hash blocks
    with ``fingerprints`` (sorted, distinct) that cannot match: several
    seeds, or a random per-process one. [] when they share."""
    if len(fingerprints) > 1:
        return [
            f"WARNING: {live} live replicas of {name} hash blocks with "
            f"{len(fingerprints)} different seeds ({', '.join(fingerprints)}): {_SEED_WARNING} "
            "(set the same PYTHONHASHSEED and prefix-cache hash algorithm everywhere)"
        ]
    if any(fp.startswith("random-") for fp in fingerprints):
        return [
            f"WARNING: a live replica of {name} hashes with a random per-process seed: "
            f"{_SEED_WARNING} (set PYTHONHASHSEED)"
        ]
    return []


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(now - then, 3)


def _leases(
    d: scan.Digest, now: float, this_host: str, problems: Problems
) -> tuple[dict[str, Any], list[Lease]]:
    """The report's ``leases`` (live, stale, bad and why ``leases/`` could
    not be read) and the live ones."""
    try:
        found, error = d.lease_dir(), None
    except OSError as exc:  # leases/ a symlink (never followed), unreadable, ...
        problems.add(exc, exc.filename or d.config_dir, "read leases")
        found, error = LeaseDir([], []), exc.strerror or str(exc)
    live: list[Lease] = []
    stale: list[Lease] = []
    for lease in found.leases:
        (live if lease.is_live(now, this_host) else stale).append(lease)
    report = {
        "live": [lease_json(x, now) for x in live],
        "stale": [lease_json(x, now) for x in stale],
        "bad": [{"path": b.path, "why": b.why} for b in found.bad],
        "error": error,
    }
    return report, live


def _digest_stats(
    d: scan.Digest, now: float, this_host: str, threads: int, problems: Problems
) -> dict[str, Any]:
    config = d.read_config()
    sealing = _sealing(config)
    found = walk_digest(d, now, threads, problems, keep_blocks=sealing is not None)
    ranks = found.ranks
    chunk = infer_chunk_size(found.probe)
    trailers = _sealed_trailers(found.blocks, chunk.payload, threads)
    leases, live = _leases(d, now, this_host, problems)
    fingerprints = sorted({lease.seed_fingerprint for lease in live})
    return {
        "name": d.name,
        "digest": d.digest,
        "model": (config or {}).get("model_name", d.model),
        "has_config": config is not None,
        "config": _config_summary(config),
        "config_digest_ok": _config_digest_ok(d, config),
        "ranks": {str(k): v for k, v in ranks.items()},
        "blocks": sum(r["blocks"] for r in ranks.values()),
        "bytes": sum(r["bytes"] for r in ranks.values()),
        # The sealing scheme config.json names (layout/sealed.py); a block
        # counts as sealed by its own trailer (checked without a key), any
        # other block there is bad to a replica, counted by why.
        "sealing": sealing,
        **trailers,
        "chunk_bytes": chunk.payload,
        "chunk_source": chunk.source,
        "trailer_bytes": TRAILER_SIZE if chunk.source == "trailer" else None,
        "file_sizes": {str(s): n for s, n in found.sizes.most_common(5)},
        "last_used": {
            "buckets": {b: found.buckets.get(b, 0) for b, _ in AGE_BUCKETS},
            "oldest": found.oldest,
            "newest": found.newest,
            "oldest_age_s": _age(now, found.oldest),
            "newest_age_s": _age(now, found.newest),
        },
        "leases": leases,
        "seed_fingerprints": fingerprints,
        "seed_mismatch": len(fingerprints) > 1,
        "temp": {
            "count": found.temp_count,
            "bytes": found.temp_bytes,
            "oldest_mtime": found.temp_oldest_mtime,
            "oldest_age_s": _age(now, found.temp_oldest_mtime),
        },
        "quarantined": {
            "count": found.quarantined_count,
            "bytes": found.quarantined_bytes,
            "reasons": dict(sorted(found.quarantined_reasons.items())),
        },
        "other": {
            "count": found.other_count,
            "entries": sorted(found.other, key=lambda e: e["path"]),
        },
        "nfs_silly_renamed": {"count": found.silly_count, "bytes": found.silly_bytes},
        "unreadable_dirs": found.unreadable,
        "warnings": _warnings(d, config, live, fingerprints, sum(trailers["not_sealed"].values())),
    }


def _unexpected_in_root(listing: scan.RootListing, problems: Problems) -> list[dict[str, str]]:
    out = []
    for path in listing.symlinks + listing.other:
        try:
            out.append({"path": path, "type": file_type(os.lstat(path).st_mode)})
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.add(exc, path, "lstat")
    return sorted(out, key=lambda e: e["path"])


def _statvfs(root: str) -> dict[str, float]:
    usage = volume_usage(root)
    # free_bytes counts the root reserve too (f_bfree); available_bytes does not.
    return {
        "size_bytes": usage.total_bytes,
        "free_bytes": usage.total_bytes - usage.used_bytes,
        "available_bytes": usage.free_bytes,
        "used_bytes": usage.used_bytes,
        "used_percent": round(usage.used_percent, 2),  # df's, as gc and the guard count
        "inodes": usage.inodes,
        "inodes_free": usage.inodes_free,
    }


def volume_stats(
    root: str,
    threads: int | str | None = None,
    digest_names: list[str] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """One root's report; ``threads`` as ``--threads`` (``scan.threads_for``)."""
    now = time.time() if now is None else now
    this_host = socket.gethostname()
    listing = scan.list_root(root)
    problems = listing.problems
    digests = select_digests(root, digest_names, listing)
    threads = scan.threads_for(root, threads)
    per = [_digest_stats(d, now, this_host, threads, problems) for d in digests]
    unexpected = [] if digest_names else _unexpected_in_root(listing, problems)
    totals = {
        "digests": len(per),
        **{k: sum(p[k] for p in per) for k in ("blocks", "bytes", "sealed_blocks")},
        "not_sealed_blocks": sum(sum(p["not_sealed"].values()) for p in per),
        "temp_files": sum(p["temp"]["count"] for p in per),
        "temp_bytes": sum(p["temp"]["bytes"] for p in per),
        "quarantined_files": sum(p["quarantined"]["count"] for p in per),
        "quarantined_bytes": sum(p["quarantined"]["bytes"] for p in per),
        "other": sum(p["other"]["count"] for p in per),
        "nfs_silly_renamed": sum(p["nfs_silly_renamed"]["count"] for p in per),
        "live_leases": sum(len(p["leases"]["live"]) for p in per),
        "stale_leases": sum(len(p["leases"]["stale"]) for p in per),
        "bad_leases": sum(len(p["leases"]["bad"]) for p in per),
        "problems": problems.count,
    }
    return {
        "root": root,
        "time": now,
        "digests": per,
        "unexpected": unexpected,
        "gc_trash": [] if digest_names else listing.trash,
        "totals": totals,
        "problems": problems.as_dict(),
        "filesystem": _statvfs(root),
        "warnings": [w for p in per for w in p["warnings"]],
    }


def _one_root(args: argparse.Namespace, root: str) -> RootOutcome:
    if not os.path.isdir(root):
        return RootOutcome(2, error=f"{root}: not a directory")
    try:
        report = volume_stats(root, args.threads, args.digest)
    except LookupError as exc:
        return RootOutcome(2, error=str(exc))
    text = io.StringIO()
    print_report(report, text, OTHER_LISTED)
    return RootOutcome(0, report, text.getvalue())


def _totals(done: Sequence[tuple[str, RootOutcome]]) -> tuple[dict[str, Any], list[str]]:
    """Blocks and bytes per root and in all (a digest on two roots counts
    on each)."""
    reports = [o.report for _, o in done if o.report is not None]
    total = sum_totals(reports)
    rows = [["ROOT", "DIGESTS", "BLOCKS", "BYTES", "TEMP", "QUAR", "PROBLEMS"]]
    for root, outcome in done:
        t = outcome.report["totals"] if outcome.report is not None else None
        rows.append(_row(root, t) if t is not None else [root, "-", "-", "-", "-", "-", "-"])
    label = "total" if len(reports) == len(done) else f"total ({len(reports)} of {len(done)})"
    rows.append(_row(label, total))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return total, lines


def _row(name: str, t: dict[str, Any]) -> list[str]:
    return [
        name,
        str(t.get("digests", 0)),
        str(t.get("blocks", 0)),
        format_bytes(t.get("bytes", 0)),
        str(t.get("temp_files", 0)),
        str(t.get("quarantined_files", 0)),
        str(t.get("problems", 0)),
    ]


def run(args: argparse.Namespace) -> int:
    return run_listed_roots(
        "stats",
        args.root,
        lambda root: _one_root(args, root),
        as_json=args.json,
        dumps=lambda obj: json.dumps(obj, indent=1, sort_keys=False),
        totals=_totals,
    )
