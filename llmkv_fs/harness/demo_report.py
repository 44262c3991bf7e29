"""What ``llmkv-fs demo`` prints: one line per request, each replica's
tally, and the volume as ``llmkv-fs stats`` sees it."""

from __future__ import annotations

from typing import Any

from llmkv_fs.harness.demo_replica import ReplicaProcess
from llmkv_fs.ops.stats import volume_stats
from llmkv_fs.units import format_bytes

__all__ = ["describe", "print_tally", "print_volume", "say", "volume_summary"]


def say(text: str = "") -> None:
    print(text, flush=True)


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 and nbytes else "-"


def describe(name: str, r: dict[str, Any], doc: int, stored_by: str | None) -> str:
    hits = r["hit_cpu"] + r["hit_fs"]
    src = []
    if r["hit_cpu"]:
        src.append(f"{r['hit_cpu']} CPU tier")
    if r["hit_fs"]:
        src.append(
            f"{r['hit_fs']} volume"
            + (f", stored by {stored_by}" if stored_by and stored_by != name else "")
        )
    bad = f", {len(r['mismatched'])} WRONG" if r["mismatched"] else ""
    where = f" ({'; '.join(src)})" if src else ""
    return f"{name}: doc {doc} {hits:>2}/{r['chunks']} hit{where}, {r['miss']} computed{bad}"


def print_tally(p: ReplicaProcess, label: str = "") -> None:
    t, c = p.tally, p.tally.counters
    say(
        f"replica {p.name} ({label}pid {p.info.get('pid')}): {t.requests} requests, "
        f"{t.chunks} chunks looked up, {t.hits} hits ({t.hit_cpu} from its CPU tier, "
        f"{t.hit_fs} from the volume, {t.hit_other} of them stored by another replica) "
        f"= {t.hit_rate:.1f}% hit rate"
    )
    verdict = (
        f"all {t.hits} loaded chunks byte-exact"
        if not t.mismatched
        else f"{len(t.mismatched)} loaded chunks WRONG ({t.bad_bytes} bytes differ)"
    )
    say(
        f"  loads  {format_bytes(t.load_bytes)} volume->CPU at {_rate(t.load_bytes, t.load_s)}"
        f" (lookup to HIT, wall); stores {format_bytes(t.store_bytes)} CPU->volume at "
        f"{_rate(t.store_bytes, t.store_s)} (until published, wall)"
    )
    corrupt = {k: v for k, v in c.items() if k.startswith("load_corrupt_") and v}
    say(
        f"  {verdict}; tier: {c.get('blocks_verified', 0)} verified, "
        f"{c.get('blocks_unverified', 0)} unverified (trailer-less) loads, "
        f"{c.get('blocks_written', 0)} written, {c.get('blocks_present', 0)} already present, "
        f"{c.get('quarantined', 0)} quarantined{' ' + str(corrupt) if corrupt else ''}"
    )


def volume_summary(root: str) -> dict[str, Any]:
    report = volume_stats(root, threads=2)
    return {
        "source": "llmkv_fs.ops.stats",
        "digests": [
            {
                "name": d["name"],
                "blocks": d["blocks"],
                "sealed": d["sealed_blocks"],
                "bytes": d["bytes"],
                "chunk": d["chunk_bytes"],
                "quarantined": d["quarantined"]["count"],
                "reasons": d["quarantined"]["reasons"],
                "temp": d["temp"]["count"],
                "live": len(d["leases"]["live"]),
                "stale": len(d["leases"]["stale"]),
                "seeds": d["seed_fingerprints"],
            }
            for d in report["digests"]
        ],
        "warnings": report["warnings"],
    }


def print_volume(root: str, during: dict[str, Any] | None) -> None:
    summary = volume_summary(root)
    say(f"\non the volume ({root}, via {summary['source']}):")
    for d in summary["digests"]:
        reasons = ", ".join(f"{k} {n}" for k, n in d["reasons"].items())
        say(
            f"  {d['name']}/: {d['blocks']} blocks{' (sealed)' if d['sealed'] else ''}, "
            f"{format_bytes(d['bytes'])}"
            f"{' (' + format_bytes(d['chunk']) + ' chunks + 4 KiB trailer)' if d['chunk'] else ''}"
            f"; {d['quarantined']} quarantined{' (' + reasons + ')' if reasons else ''}; "
            f"{d['temp']} temp files; leases now {d['live']} live, {d['stale']} stale"
        )
    if during:
        for d in during["digests"]:
            say(
                f"  while replicas 1 and 2 ran: {d['live']} live leases on {d['name']}, "
                f"seed fingerprints {d['seeds'] or '(n/a)'}"
                f"{' -- they agree' if len(d['seeds']) == 1 and d['live'] > 1 else ''}"
            )
    for w in summary["warnings"] + (during or {}).get("warnings", []):
        say(f"  !!! {w}")
