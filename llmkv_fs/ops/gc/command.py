"""``llmkv-fs gc``'s arguments and its run loop: one pass under the
volume's lock, or ``--watch`` passes until SIGTERM. Exit codes are below.

KV events: a one-pass gc is a one-shot tool (``ops/events/oneshot.py``:
it waits for its subscribers at its first announcement and exits
EXIT_UNDELIVERED when its events could not be delivered); ``--watch``
publishes through vLLM's publisher, best effort. A dry run builds no
publisher and binds nothing."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmkv_fs.ops.events.options import (
    EXIT_UNDELIVERED,
    add_event_arguments,
    announcer_from_args,
    delivery_status,
)
from llmkv_fs.ops.gc.lock import LockBusy, VolumeLock
from llmkv_fs.ops.gc.rules import Policy, pids_are_ours
from llmkv_fs.ops.gc.sweep import gc_pass
from llmkv_fs.ops.per_root import (
    EXIT_BAD_ROOT,
    RootOutcome,
    add_root_argument,
    roots_from_args,
    run_roots,
)
from llmkv_fs.ops.progress import Progress
from llmkv_fs.ops.scan import add_threads_argument, threads_for
from llmkv_fs.units import format_bytes, parse_duration, parse_percent_or_off, parse_size

if TYPE_CHECKING:
    from llmkv_fs.ops.events.announcer import Announcer

__all__ = [
    "EXIT_BUSY",
    "EXIT_ERRORS",
    "EXIT_SIGTERM",
    "EXIT_UNDELIVERED",
    "add_arguments",
    "run",
]

EXIT_ERRORS = 1  # the pass ran, some entries could not be read or acted on (in the report)
EXIT_BUSY = 75  # EX_TEMPFAIL: another gc holds the volume's lock
EXIT_SIGTERM = 143  # a one-shot run stopped by SIGTERM (--watch exits 0)
# EXIT_UNDELIVERED (3): the pass ran clean, but some of its KV events were not delivered.

DEFAULTS = {
    "min_age": "7d",  # a weekend plus slack: a model idle over a long weekend keeps its cache
    "tmp_age": "1h",  # far beyond any block write, even on a stalled NFS server
    "protect": "10m",  # blocks a running request may still be about to load
    "high": "85",  # below the tier's own space guard (max_usage_percent, 95)
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_root_argument(parser, "the cache volume's root_dir")
    parser.add_argument(
        "--dry-run", action="store_true", help="report what would be removed; change nothing"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON (one line per pass with --watch)",
    )
    _add_ages(parser)
    _add_capacity(parser)
    _add_scope(parser)
    _add_running(parser)
    add_event_arguments(parser, "a BlockRemoved for each block file gc removes (before its unlink)")


def _add_ages(parser: argparse.ArgumentParser) -> None:
    """How old what gc removes must be."""
    d = DEFAULTS
    parser.add_argument(
        "--min-age",
        type=parse_duration,
        default=parse_duration(d["min_age"]),
        metavar="AGE",
        help=f"remove a digest without a live lease only when "
        f"nothing in it was used for AGE (default {d['min_age']})",
    )
    parser.add_argument(
        "--tmp-age",
        type=parse_duration,
        default=parse_duration(d["tmp_age"]),
        metavar="AGE",
        help="remove a temp file older than AGE even if its "
        f"writer's host is not this one (default {d['tmp_age']})",
    )
    parser.add_argument(
        "--protect",
        type=parse_duration,
        default=parse_duration(d["protect"]),
        metavar="AGE",
        help="never evict a block used within AGE, never "
        f"remove an empty directory younger than AGE (default {d['protect']})",
    )


def _add_capacity(parser: argparse.ArgumentParser) -> None:
    """When gc evicts least-recently-used blocks, and down to what."""
    d = DEFAULTS
    parser.add_argument(
        "--max-bytes",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="evict LRU blocks while the cache holds more than SIZE "
        "(e.g. 800Gi, 1T; default: no limit); with several roots, on each root",
    )
    parser.add_argument(
        "--high",
        type=parse_percent_or_off,
        default=parse_percent_or_off(d["high"]),
        metavar="PCT",
        help="evict LRU blocks when the volume is at least PCT "
        f"percent full, 'off' to disable (default {d['high']}); with several roots, "
        "each root's own volume",
    )
    parser.add_argument(
        "--low",
        type=parse_percent_or_off,
        default=None,
        metavar="PCT",
        help="... until it is at most PCT percent full (default: high - 10)",
    )


def _add_scope(parser: argparse.ArgumentParser) -> None:
    """Which digests gc looks at, and which it never touches."""
    parser.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="DIGEST_OR_NAME",
        help="never remove or evict this digest (12-hex digest, directory "
        "name or model); repeatable",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="MODEL",
        help="only look at digests of this model (org/name or directory form); repeatable",
    )


def _add_running(parser: argparse.ArgumentParser) -> None:
    """How a run goes: listing threads, proof of death, watch mode, the lock."""
    add_threads_argument(parser)
    parser.add_argument(
        "--pid-check",
        choices=("auto", "on", "off"),
        default="auto",
        help="trust 'this host, no such pid' as proof a writer is dead; auto: "
        "on, except in a Kubernetes pod without a shared process namespace",
    )
    parser.add_argument(
        "--watch",
        type=parse_duration,
        default=None,
        metavar="INTERVAL",
        help="sidecar mode: a pass, then INTERVAL of rest, again and again until "
        "SIGTERM (then exit 0)",
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help=f"wait for another gc's lock instead of exiting with status {EXIT_BUSY}",
    )


def _policy(args: argparse.Namespace) -> Policy:
    if args.high is not None:
        low = args.low if args.low is not None else max(0.0, args.high - 10)
        if low > args.high:
            raise SystemExit(f"llmkv-fs gc: --low {low:g} is above --high {args.high:g}")
    else:
        low = args.low
        if low is not None:
            raise SystemExit("llmkv-fs gc: --low needs --high")
    pid_check = {"on": True, "off": False}.get(args.pid_check)
    if pid_check is None:
        pid_check = pids_are_ours()
    return Policy(
        min_age=args.min_age,
        tmp_age=args.tmp_age,
        protect=args.protect,
        max_bytes=args.max_bytes,
        high=args.high,
        low=low,
        pid_check=pid_check,
    )


def _one_root(
    args: argparse.Namespace,
    policy: Policy,
    stop: threading.Event,
    watching: bool,
    several: bool,
    root: str,
    announce: Announcer | None = None,
) -> RootOutcome:
    """One pass on ``root`` under its own lock. A single root was checked
    once before the first pass, as ever; each of several roots is checked
    before each of its passes."""
    if several and not os.path.isdir(root):
        return RootOutcome(2, error=f"{root} is not a directory")
    lock = VolumeLock(root)
    try:
        if not lock.acquire(wait=args.wait, stop=stop):
            # Stopped while waiting.
            return RootOutcome(0, error="stopped while waiting for its lock" if several else "")
    except LockBusy as exc:
        return RootOutcome(EXIT_BUSY, error=str(exc))
    except OSError as exc:
        return RootOutcome(EXIT_ERRORS, error=f"cannot take the lock {lock.path}: {exc.strerror}")
    try:
        # An entry that cannot be read or acted on is in the report; a root
        # that fails ends the pass early, reported too (report.aborted).
        report = gc_pass(
            root,
            policy,
            lock,
            keep=args.keep,
            models=args.model,
            threads=threads_for(root, args.threads),
            dry_run=args.dry_run,
            progress=Progress("gc", sys.stderr),
            stop=stop.is_set,
            announce=announce,
        )
    finally:
        lock.release()
    if report.interrupted:
        status = 0 if watching else EXIT_SIGTERM
    else:
        status = EXIT_ERRORS if report.problems or report.aborted else 0
    error = f"pass stopped early: {report.aborted}" if report.aborted else ""
    return RootOutcome(status, report.as_dict(), report.human() + "\n", error)


def _totals(done: Sequence[tuple[str, RootOutcome]]) -> tuple[dict[str, Any], list[str]]:
    """What the pass removed on all roots together."""
    reports = [o.report for _, o in done if o.report is not None]
    total = {
        "digests_removed": sum(r["digests_removed"] for r in reports),
        "temps_removed": sum(r["temps"]["removed"] for r in reports),
        "evicted_blocks": sum(r["capacity"]["evicted_blocks"] for r in reports),
        "evicted_bytes": sum(r["capacity"]["evicted_bytes"] for r in reports),
        "dirs_pruned": sum(r["dirs_pruned"] for r in reports),
        "bytes_freed": sum(r["bytes_freed"] for r in reports),
        "error_count": sum(r["error_count"] for r in reports),
    }
    dry = any(r["dry_run"] for r in reports)
    t = total
    line = (
        f"{'would remove' if dry else 'removed'} on {len(reports)} of {len(done)} roots: "
        f"{t['digests_removed']} digests, {t['temps_removed']} temp files, "
        f"{t['evicted_blocks']:,} blocks evicted ({format_bytes(t['evicted_bytes'])}), "
        f"{t['dirs_pruned']} empty directories; {format_bytes(t['bytes_freed'])} "
        f"{'to free' if dry else 'freed'}; errors: {t['error_count']}"
    )
    return total, [line]


def run(args: argparse.Namespace) -> int:
    roots = roots_from_args("gc", args.root)
    if roots is None:
        return EXIT_BAD_ROOT
    if len(roots) == 1 and not os.path.isdir(roots[0]):
        print(f"llmkv-fs gc: {roots[0]} is not a directory", file=sys.stderr)
        return EXIT_BAD_ROOT
    policy = _policy(args)
    stop = threading.Event()
    if args.dry_run and args.kv_events_config:
        print("llmkv-fs gc: --dry-run: no KV events are published", file=sys.stderr)
    # One for every pass (--watch keeps it); none for a dry run, which touches nothing.
    one_shot = args.watch is None
    announce = None if args.dry_run else announcer_from_args("gc", args, roots, one_shot=one_shot)

    def one_pass(watching: bool) -> int:
        return run_roots(
            "gc",
            roots,
            lambda root: _one_root(args, policy, stop, watching, len(roots) > 1, root, announce),
            as_json=args.json,
            dumps=lambda obj: json.dumps(obj, indent=None if watching else 1, sort_keys=True),
            totals=_totals,
            stop=stop.is_set,
            stopped_status=0 if watching else EXIT_SIGTERM,
        )

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if one_shot:
            status = one_pass(watching=False)
            if announce is not None:
                announce.close()
            return delivery_status("gc", announce, status)
        while not stop.is_set():
            try:
                status = one_pass(watching=True)
            except Exception:  # a sidecar keeps going; the next pass starts afresh
                traceback.print_exc()
                status = EXIT_ERRORS
            if status == EXIT_BUSY and len(roots) == 1:
                print("llmkv-fs gc: skipping this pass", file=sys.stderr, flush=True)
            stop.wait(args.watch)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if announce is not None:
            announce.close()
