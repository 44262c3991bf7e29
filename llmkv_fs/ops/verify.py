"""Read every block file on a cache volume and check it: trailer magic and
version, the key against the file's path, payload length, the trailer's own
checksum and the payload's xxh3. Trailer-less files of exactly the chunk size
(vLLM's built-in tier wrote them) count as unverified; any other size is bad.
Symlinks are never followed: a block path that is one is bad, any other is
reported and left alone. Exit status 1 when a file is bad or unreadable (a
directory that cannot be listed included: its blocks went unchecked).

With --repair, bad files move into their rank directory's .quarantine/ --
only if the path still names the inode that was read, so it is safe while
tiers are live: a block republished meanwhile is left alone. With
--kv-events-config, each such move is announced first (a BlockRemoved),
waiting for the router's subscription; exit status 3 when a run otherwise
clean could not deliver its events (``ops/events/options.py``).

Here the files to read are chosen (one walk), the results counted on the
owner thread and the report and command made; the reader threads are
``ops/verify_readers.py``, the progress bar ``ops/progress.py``.

Several roots (a tier's root_dir list with path_sharding by_block_hash, or
several ROOT arguments): each root verified on its own, then the total; the
exit status is the worst of the roots'.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import stat
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llmkv_fs.checks import TierConfigError
from llmkv_fs.layout.names import config_path, in_quarantine, is_block_name
from llmkv_fs.layout.sealed import Keyring
from llmkv_fs.ops import kinds, scan, walker
from llmkv_fs.ops.blockcheck import (
    BAD,
    ERROR,
    FOREIGN,
    SEALED,
    UNVERIFIED,
    VANISHED,
    VERIFIED,
    Result,
    infer_chunk_size,
    namespace_sealing,
)
from llmkv_fs.ops.events.options import (
    add_event_arguments,
    announcer_from_args,
    delivery_status,
)
from llmkv_fs.ops.per_root import (
    EXIT_BAD_ROOT,
    RootOutcome,
    add_root_argument,
    roots_from_args,
    run_roots,
    sum_totals,
)
from llmkv_fs.ops.problems import EXAMPLES_PER_KIND, Problems
from llmkv_fs.ops.progress import Progress
from llmkv_fs.ops.repair import quarantine
from llmkv_fs.ops.stats import add_digest_argument, select_digests
from llmkv_fs.ops.verify_readers import check_all
from llmkv_fs.ops.verify_text import print_report
from llmkv_fs.units import format_bytes
from llmkv_fs.volume.keyfiles import keyring_from_args

if TYPE_CHECKING:
    from llmkv_fs.ops.events.announcer import Announcer

__all__ = ["add_arguments", "run", "verify_volume"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_root_argument(parser, "cache root directory (the tier's root_dir)")
    parser.add_argument(
        "--repair",
        action="store_true",
        help="move bad files into their rank directory's .quarantine/",
    )
    add_digest_argument(parser)
    scan.add_threads_argument(parser)
    parser.add_argument(
        "--seal-key-file",
        action="append",
        default=[],
        metavar="[ID=]PATH",
        help="authenticate sealed blocks with the key in PATH under key id ID (default 1); "
        "repeat for every key (seal_key_files). Without one, sealed blocks are counted "
        "sealed_unchecked: they cannot be authenticated, which says nothing bad of them",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    add_event_arguments(parser, "a BlockRemoved for every file --repair moves aside")


# Result status -> its counter in the report.
_COUNT = {
    VERIFIED: "verified",
    UNVERIFIED: "unverified",
    BAD: "bad",
    ERROR: "errors",
    VANISHED: "vanished",
    SEALED: "sealed_unchecked",  # no key given: cannot authenticate (not bad)
    FOREIGN: "foreign_key",  # sealed with a key not given (not bad)
}


def _new_counts() -> dict:
    return {"files": 0, **dict.fromkeys(_COUNT.values(), 0), "bytes_read": 0}


class _Unread:
    """What the walk could not read (directories, entries) and the symlinks
    it saw and left alone."""

    def __init__(self, problems: Problems, symlinks: list[str]):
        self.problems = problems
        self.symlinks = symlinks
        self.errors: list[dict[str, Any]] = []

    def add(self, digest: str, op: str, path: str, exc: OSError) -> None:
        problem = self.problems.add(exc, path, op)
        self.errors.append(
            {"path": path, "digest": digest, "reason": f"{op}-error", "detail": problem.detail}
        )

    def unproven(self, d: scan.Digest, why: str) -> None:
        """``d``'s sealing is unproven (``why``): its blocks are judged each
        by its own trailer, which cannot tell a forgery in a sealed
        namespace. An error, so the run is never OK."""
        path = config_path(d.config_dir)
        detail = f"{why}: whether its blocks must be sealed is unknown"
        self.problems.add_kind("unproven-config", path, "read config", detail)
        self.errors.append(
            {"path": path, "digest": d.name, "reason": "unproven-config", "detail": detail}
        )


def _collect(digests: list[scan.Digest], threads: int, unread: _Unread) -> tuple[list, dict]:
    """List every rank directory (one walk, ``threads`` listings in flight)
    and size each digest's chunk: (items to check, per-digest counts).
    What could not be listed, and the symlinks seen, go to ``unread``."""
    tops = [(d, d.rank_dirs[r]) for d in digests for r in sorted(d.rank_dirs)]
    found: dict[str, list] = {d.name: [] for d in digests}
    for listing in walker.walk([rank_dir for _, rank_dir in tops], threads):
        d, rank_dir = tops[listing.top]
        if listing.error is not None:
            unread.add(d.name, "list", listing.path, listing.error)
        for op, path, exc in listing.problems:
            unread.add(d.name, op, path, exc)
        if in_quarantine(rank_dir, listing.path):
            continue
        for entry in listing.files:
            # By name, not by scan's kind: a symlink or FIFO named like a
            # block is reported (and never followed or opened).
            if entry.kind != kinds.TEMP and is_block_name(os.path.basename(entry.path)):
                found[d.name].append((rank_dir, entry))
            elif entry.kind == kinds.SYMLINK:
                unread.symlinks.append(entry.path)
    items: list[tuple[str, str, kinds.FileEntry, int, bool | None]] = []
    per_digest: dict[str, dict[str, Any]] = {}
    for d in digests:
        entries = found[d.name]
        chunk = infer_chunk_size(
            (e.path, e.st.st_size) for _, e in entries if stat.S_ISREG(e.st.st_mode)
        )
        sealed, unproven = namespace_sealing(d)
        per_digest[d.name] = {
            "name": d.name,
            "chunk_bytes": chunk.payload,
            "chunk_source": chunk.source,
            "ranks": sorted(d.rank_dirs),
            "sealed": sealed,
            **_new_counts(),
        }
        if sealed is None and entries:
            unread.unproven(d, unproven)
        items.extend((d.name, rank_dir, e, chunk.payload or 0, sealed) for rank_dir, e in entries)
    for e in unread.errors:
        per_digest[e["digest"]]["errors"] += 1
    return items, per_digest


class _Results:
    """Counts and lists of one run, filled from the checkers' results
    (owner thread only: check_all calls ``add`` there)."""

    def __init__(
        self,
        per_digest: dict[str, dict[str, Any]],
        unread: _Unread,
        repair: bool,
        announce: Announcer | None,
    ):
        self.per_digest = per_digest
        self.announce = announce
        self.errors = unread.errors
        self.problems = unread.problems
        self.repair = repair
        self.totals = _new_counts()
        self.totals["atime_touched"] = 0
        self.totals["errors"] = len(self.errors)  # what the walk could not read
        self.bad: list[dict[str, Any]] = []

    def add(self, digest: str, rank_dir: str, result: Result) -> None:
        totals = self.totals
        for counts in (self.per_digest[digest], totals):
            counts["files"] += 1
            counts[_COUNT[result.status]] += 1
            counts["bytes_read"] += result.nbytes
        if not result.atime_preserved:
            totals["atime_touched"] += 1
        if result.status == BAD:
            record = {
                "path": result.path,
                "digest": digest,
                "reason": result.reason,
                "detail": result.detail,
                "repair": None,
                "quarantined_to": None,
            }
            if self.repair:
                record["repair"], record["quarantined_to"] = quarantine(
                    rank_dir, result, self.problems, self.announce
                )
            self.bad.append(record)
        elif result.status == ERROR:
            self.problems.add_kind(
                result.error_kind or result.reason, result.path, result.reason, result.detail
            )
            self.errors.append(
                {
                    "path": result.path,
                    "digest": digest,
                    "reason": result.reason,
                    "detail": result.detail,
                }
            )


def verify_volume(
    root: str,
    digest_names: list[str] | None = None,
    threads: int | str | None = None,
    repair: bool = False,
    progress_stream=None,
    announce: Announcer | None = None,
    keyring: Keyring | None = None,
) -> dict:
    """The whole run as a JSON-able report (see docs/operations.md); sealed
    blocks are authenticated with ``keyring`` (None: counted
    ``sealed_unchecked``, checked up to their key and length). ``threads``:
    as ``--threads`` (``scan.threads_for``)."""
    threads = scan.threads_for(root, threads, reads=True)
    root_listing = scan.list_root(root)
    digests = select_digests(root, digest_names, root_listing)
    unread = _Unread(root_listing.problems, [] if digest_names else list(root_listing.symlinks))
    listed = time.monotonic()
    items, per_digest = _collect(digests, threads, unread)
    listing_s = time.monotonic() - listed
    results = _Results(per_digest, unread, repair, announce if repair else None)
    totals, bad, errors = results.totals, results.bad, results.errors
    total_bytes = sum(e.st.st_size for _, _, e, *_ in items if stat.S_ISREG(e.st.st_mode))
    progress = Progress("verify", progress_stream, total=len(items), unit=" files")

    def tick() -> None:
        done = f"{format_bytes(totals['bytes_read'])}/{format_bytes(total_bytes)}"
        progress.update(f"{done}, bad {totals['bad']}", totals["files"])

    start = time.monotonic()
    try:
        check_all(items, threads, results.add, tick, keyring)
    finally:
        progress.done()
    elapsed = time.monotonic() - start
    bad.sort(key=lambda r: r["path"])
    errors.sort(key=lambda r: r["path"])
    return {
        "root": root,
        "repair": repair,
        "threads": threads,
        "digests": [per_digest[d.name] for d in digests],
        "totals": totals,
        "bad": bad,
        "errors": errors,
        "problems": unread.problems.as_dict(),
        "symlinks": {
            "count": len(unread.symlinks),
            "examples": sorted(unread.symlinks)[:EXAMPLES_PER_KIND],
        },
        "listing_s": round(listing_s, 6),
        "elapsed_s": round(elapsed, 6),
        "files_per_s": round(totals["files"] / elapsed, 1) if elapsed > 0 else None,
        "bytes_per_s": round(totals["bytes_read"] / elapsed) if elapsed > 0 else None,
    }


def _one_root(
    args: argparse.Namespace,
    root: str,
    announce: Announcer | None,
    keyring: Keyring | None = None,
) -> RootOutcome:
    if not os.path.isdir(root):
        return RootOutcome(2, error=f"{root}: not a directory")
    try:
        report = verify_volume(
            root, args.digest, args.threads, args.repair, announce=announce, keyring=keyring
        )
    except LookupError as exc:
        return RootOutcome(2, error=str(exc))
    text = io.StringIO()
    print_report(report, text)
    status = 1 if report["totals"]["bad"] or report["totals"]["errors"] else 0
    return RootOutcome(status, report, text.getvalue())


def _totals(done: Sequence[tuple[str, RootOutcome]]) -> tuple[dict[str, Any], list[str]]:
    reports = [o.report for _, o in done if o.report is not None]
    t = sum_totals(reports)
    n = len(reports)
    counts = "  ".join(f"{k} {t.get(k, 0)}" for k in ("verified", "unverified", "bad"))
    line = (
        f"{t.get('files', 0)} files on {n} root(s) read, {format_bytes(t.get('bytes_read', 0))}:"
        f"  {counts}  unreadable {t.get('errors', 0)}  vanished {t.get('vanished', 0)}"
    )
    wrong = []
    if t.get("bad") or t.get("errors"):
        wrong.append(f"{t.get('bad', 0)} bad, {t.get('errors', 0)} unreadable")
    if n < len(done):
        wrong.append(f"{len(done) - n} root(s) not verified")
    return t, [line, f"result: {'; '.join(wrong) or 'OK'}"]


def run(args: argparse.Namespace) -> int:
    try:
        keyring = keyring_from_args(args.seal_key_file)
    except TierConfigError as exc:
        print(f"llmkv-fs verify: {exc}", file=sys.stderr)
        return 2
    roots = roots_from_args("verify", args.root)
    if roots is None:
        return EXIT_BAD_ROOT
    announce = announcer_from_args("verify", args, roots, one_shot=True) if args.repair else None
    try:
        status = run_roots(
            "verify",
            roots,
            lambda root: _one_root(args, root, announce, keyring),
            as_json=args.json,
            dumps=lambda obj: json.dumps(obj, indent=1),
            totals=_totals,
        )
    finally:
        if announce is not None:
            announce.close()
    return delivery_status("verify", announce, status)
