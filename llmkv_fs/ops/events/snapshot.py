"""``llmkv-fs events snapshot``: announce every block on the volume (all its
roots) as a ``BlockStored``, at a bounded rate, so a KV-aware router that
restarted (its index empty) learns the shared tier's contents without
waiting for new traffic.

Each block gets the event vLLM's connector sends when a tier stores a chunk
(one hash, no tokens: ``announcer.py``); quarantined files, temp files and
anything not at a block path of a rank directory are not blocks. Nor is
what no replica would serve: anything but a regular file, a file on
another device than its root (behind a mount inside the tree), a file whose
size is not its digest's block size (with or without trailer; the size
inferred as ``verify`` does, reading a few trailers per digest). Those are
counted as ``skipped``. The walk holds one digest's keys at a time. The
rate limit spaces the batches (``--rate`` events a second, on average from
the start): a snapshot of millions of blocks must not flood the indexer or
the network.

A one-shot tool: it waits for the router's subscription before the first
event and exits 3 when events were not delivered (``ops/events/oneshot.py``).

A block removed while the snapshot runs may be announced after it was
removed: run the snapshot before (re)starting gc's events, or accept that
the next gc pass or the tiers' own removals correct it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from llmkv_fs.checks import number_between, option
from llmkv_fs.layout.blockfile import file_sizes
from llmkv_fs.layout.names import parse_block_path
from llmkv_fs.ops import kinds, walker
from llmkv_fs.ops.blockcheck import PROBE_PER_SIZE, chunk_size_of
from llmkv_fs.ops.events.options import (
    add_event_arguments,
    announcer_from_args,
    delivery_status,
)
from llmkv_fs.ops.per_root import EXIT_BAD_ROOT, add_root_argument, roots_from_args
from llmkv_fs.ops.scan import default_threads, list_root

if TYPE_CHECKING:
    from llmkv_fs.ops.events.announcer import Announcer

__all__ = ["add_arguments", "run", "snapshot"]

DEFAULT_RATE = 20_000  # events a second
MAX_RATE = 10_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="events_command", required=True)
    snap = sub.add_parser(
        "snapshot",
        help="publish a BlockStored for every block on the volume",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_root_argument(snap, "the cache volume's root_dir")
    snap.add_argument(
        "--rate",
        type=option(number_between(1, MAX_RATE, "events a second"), float),
        default=DEFAULT_RATE,
        metavar="N",
        help=f"at most N events a second on average (default {DEFAULT_RATE:,})",
    )
    snap.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_event_arguments(snap, "a BlockStored for every block (required)")


def snapshot(
    roots: Sequence[str],
    announce: Announcer,
    rate: float = DEFAULT_RATE,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Announce every block under ``roots``; what it did, per root."""
    started = clock()
    sent = 0
    per_root: list[dict[str, Any]] = []
    for root in roots:
        blocks = 0
        skipped: collections.Counter[str] = collections.Counter()
        try:
            for key in _blocks_of(root, skipped):
                announce.stored(key)
                blocks += 1
                if announce.pending >= announce.batch_events:
                    sent += announce.flush()
                    _pace(sent, rate, started, clock, sleep)
        except OSError as exc:
            per_root.append(
                {"root": root, "blocks": blocks, "skipped": dict(skipped), "error": str(exc)}
            )
            continue
        per_root.append({"root": root, "blocks": blocks, "skipped": dict(skipped), "error": None})
    sent += announce.flush()
    return {
        "roots": per_root,
        "blocks": sum(r["blocks"] for r in per_root),
        "skipped": sum(sum(r["skipped"].values()) for r in per_root),
        "seconds": round(clock() - started, 3),
        "events": announce.report(),
    }


def _pace(
    sent: int,
    rate: float,
    started: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> None:
    ahead = sent / rate - (clock() - started)
    if ahead > 0:
        sleep(ahead)


def _blocks_of(root: str, skipped: collections.Counter[str]):
    """The key of every block file under ``root``'s rank directories that
    a replica would serve (never in a quarantine: ``kinds.BLOCK`` excludes
    those, and anything but a regular file); what it passes over is
    counted in ``skipped`` by why."""
    device = os.stat(root).st_dev
    listing = list_root(root)
    for digest in listing.digests:
        tops = [(path, kinds.RANK_AREA) for _rank, path in sorted(digest.rank_dirs.items())]
        by_size: dict[int, list[bytes]] = collections.defaultdict(list)
        probes: dict[int, list[str]] = collections.defaultdict(list)
        with contextlib.closing(walker.walk(tops, default_threads(root))) as listings:
            for found in listings:
                top = tops[found.top][0]
                for entry in found.files:
                    if entry.kind != kinds.BLOCK:
                        continue
                    key = parse_block_path(top, entry.path)
                    if key is None:
                        continue
                    if entry.st.st_dev != device:
                        skipped["behind a mount"] += 1
                        continue
                    size = entry.st.st_size
                    by_size[size].append(key)
                    if len(probes[size]) < PROBE_PER_SIZE:
                        probes[size].append(entry.path)
        served = _served_sizes(by_size, probes)
        for size, keys in by_size.items():
            if size in served:
                yield from keys
            else:
                skipped["wrong size"] += len(keys)


def _served_sizes(by_size: dict[int, list[bytes]], probes: dict[int, list[str]]) -> frozenset[int]:
    """The file sizes a replica serves in one digest: its block size (as
    ``verify`` infers it, blockcheck.chunk_size_of) with trailer, or without
    (vLLM's built-in tier)."""
    chunk = chunk_size_of({size: len(keys) for size, keys in by_size.items()}, probes)
    return frozenset() if chunk.payload is None else file_sizes(chunk.payload, trailerless=True)


def run(args: argparse.Namespace) -> int:
    roots = roots_from_args("events snapshot", args.root)
    if roots is None:
        return EXIT_BAD_ROOT
    if not args.kv_events_config:
        print("llmkv-fs events snapshot: --kv-events-config is required", file=sys.stderr)
        return EXIT_BAD_ROOT
    announce = announcer_from_args("events snapshot", args, roots, one_shot=True)
    assert announce is not None
    try:
        summary = snapshot(roots, announce, args.rate)
    finally:
        announce.close()
    summary["events"] = announce.report()
    summary["events_troubles"] = announce.troubles()
    if args.json:
        print(json.dumps(summary, indent=1, sort_keys=True))
    else:
        for r in summary["roots"]:
            error = f" (stopped: {r['error']})" if r["error"] else ""
            passed = ", ".join(f"{n:,} {why}" for why, n in sorted(r["skipped"].items()))
            passed = f"; not served, skipped: {passed}" if passed else ""
            print(f"{r['root']}: {r['blocks']:,} blocks announced{passed}{error}")
        e = summary["events"]
        print(
            f"{summary['blocks']:,} BlockStored in {summary['seconds']:.1f}s: "
            f"{e.get('published', 0):,} published, {e.get('undelivered', 0):,} not delivered, "
            f"{e.get('errors', 0):,} failed",
            flush=True,
        )
    status = 1 if any(r["error"] for r in summary["roots"]) else 0
    return delivery_status("events snapshot", announce, status)
